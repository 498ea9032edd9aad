"""Read PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`) into a `Trace`.

A snapshot holds the allocator's segments as they were when it was dumped and a window of
trace entries (alloc, free_requested, free_completed, segment_alloc, ...). The state at the
start of the window is rebuilt by walking the window backwards from the dump: blocks allocated
in the window did not exist before it, blocks freed in it did (unless the window allocated them
first), segments allocated in it did not exist, segments freed in it did.

    trace = read_torch_snapshot("memory.pickle")
    trace.initial_segments[0].blocks    # the layout of the first segment at the window's start

A block freed in the window but allocated before it is known only by its requested size. Its
block size is the rounded request, plus the tail of its segment slice when that tail is 1 MiB
or less in the large pool: the real allocator never leaves a free large-pool block of 1 MiB or
less (it would not split it off), so such a tail must have been part of the block.
"""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path
from typing import Any

from jaxmem.errors import JaxmemError, TraceError, quote
from jaxmem.runtime.caching_config import K_SMALL_BUFFER, K_SMALL_SIZE, config_from_settings, round_size
from jaxmem.traces.model import Block, Event, Frame, Segment, Trace
from jaxmem.traces.safe_pickle import load_plain_pickle

_ALLOCATED_STATES = ("active_allocated", "active_pending_free")
_ACTION_MAP = {"alloc": "alloc", "free_completed": "free", "segment_alloc": "segment_alloc",
               "segment_map": "segment_alloc", "segment_free": "segment_free",
               "segment_unmap": "segment_free", "oom": "oom"}


def read_torch_snapshot(path: str | Path, device: int | None = None) -> Trace:
    """A Trace from a snapshot pickle, loaded without running any code from it.

    Args:
        path: the .pickle file `torch.cuda.memory._dump_snapshot` wrote.
        device: which GPU's trace to read; default the one with the most events.
    Returns:
        The Trace, with the rebuilt start state in `initial_segments` / `initial_blocks`.
    """
    data = load_plain_pickle(path)
    return snapshot_to_trace(data, str(path), device)


_MAX_INT = 1 << 64   # addresses and sizes beyond 64 bits are not from a real device


def _int(value: Any, source: str, where: str, what: str) -> int:
    if type(value) is not int or not -_MAX_INT < value < _MAX_INT:
        raise TraceError(f"{source}: {where}: {what} is not a 64-bit integer ({quote(value)})")
    return value


def _text(value: Any) -> str:
    # Only a string is taken as text: str() of a list could be the repr of a shared structure
    # that expands without end.
    return value if isinstance(value, str) else ""


def _frames(raw: Any, cache: dict[tuple, Frame], lists: dict[int, tuple[Frame, ...]]) -> tuple[Frame, ...]:
    """The frames of an event; a frames list shared by many events is read once (`lists`,
    keyed by the list's identity), so shared structure costs what it costs in the file."""
    if not isinstance(raw, list):
        return ()
    known = lists.get(id(raw))
    if known is not None:
        return known
    out = []
    for f in raw:
        if isinstance(f, dict):
            line = f.get("line", 0)
            key = (_text(f.get("filename", "")), line if type(line) is int and abs(line) < _MAX_INT else 0,
                   _text(f.get("name", "")))
            frame = cache.get(key)
            if frame is None:
                frame = cache[key] = Frame(*key)
            out.append(frame)
    lists[id(raw)] = result = tuple(out)
    return result


def _settings(raw: Any) -> dict[str, Any]:
    """The allocator settings' plain values (anything nested is dropped: it is not a setting,
    and printing or saving it could expand shared structure)."""
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and (v is None or isinstance(v, (str, bool, float)))
            or isinstance(k, str) and type(v) is int and abs(v) < _MAX_INT}


def snapshot_to_trace(data: Any, source: str = "<snapshot>", device: int | None = None) -> Trace:
    """Build a Trace from an already-loaded snapshot dict (see `read_torch_snapshot`)."""
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list) or not isinstance(data.get("device_traces"), list):
        raise TraceError(f"{source}: not a PyTorch memory snapshot (expected a dict with 'segments' and 'device_traces')")
    device, entries = _device_entries(data["device_traces"], source, device)
    settings = _settings(data.get("allocator_settings"))
    try:
        cfg = config_from_settings(settings)
    except (JaxmemError, TypeError, ValueError, OverflowError) as err:
        raise TraceError(f"{source}: allocator_settings: {str(err)[:200]}") from None
    dump_segments, dump_live = _dump_state(data["segments"], source, device)
    events, prewindow_frees = _window_events(entries, source, cfg)
    start_segments, start_live = _walk_back(events, dump_segments, dump_live)
    segments = _SegmentIndex(start_segments)
    guessed = _size_prewindow_frees(events, prewindow_frees, start_live, segments, cfg, source)
    initial_segments, initial_blocks = _start_layout(start_live, segments, source)
    return Trace(
        events=events, source=source, format="torch-snapshot",
        initial_segments=initial_segments, initial_blocks=initial_blocks,
        allocator_settings=dict(settings), device_capacity=None,
        meta={"device": device, "dump_segments": len(dump_segments), "prewindow_frees": len(prewindow_frees),
              "prewindow_sizes_with_tail": guessed},
    )


def _device_entries(traces: list, source: str, device: int | None) -> tuple[int, list]:
    """The device to read (default: the one with the most events) and its trace entries."""
    if device is None:
        lengths = [len(t) if isinstance(t, list) else 0 for t in traces[:4096]]
        device = max(range(len(lengths)), key=lambda d: lengths[d]) if lengths else 0
    if traces and not 0 <= device < len(traces):
        raise TraceError(f"{source}: no trace for device {device} (the snapshot has {len(traces)})")
    entries = traces[device] if traces else []
    if not isinstance(entries, list):
        raise TraceError(f"{source}: device_traces[{device}] is not a list")
    return device, entries


def _dump_state(raw_segments: list, source: str, device: int
                ) -> tuple[dict[int, dict[str, Any]], dict[int, tuple[int, int | None]]]:
    """The dump-time state of `device`: segment address -> its size, stream, pool and whether
    it is expandable; allocated block address -> (block size, requested size)."""
    dump_segments: dict[int, dict[str, Any]] = {}
    dump_live: dict[int, tuple[int, int | None]] = {}   # block addr -> (size, requested)
    block_lists: set[int] = set()
    for k, seg in enumerate(raw_segments):
        where = f"segment {k}"
        if not isinstance(seg, dict):
            raise TraceError(f"{source}: {where} is not a dict")
        if seg.get("device", device) != device:
            continue
        addr = _int(seg.get("address"), source, where, "address")
        size = _int(seg.get("total_size"), source, where, "total_size")
        if size <= 0 or addr < 0:
            raise TraceError(f"{source}: {where}: bad address/size ({addr}, {size})")
        seg_stream = _int(seg.get("stream", 0) or 0, source, where, "stream")
        blocks = seg.get("blocks") or []
        if not isinstance(blocks, list):
            raise TraceError(f"{source}: {where}: blocks is not a list")
        if blocks and id(blocks) in block_lists:
            # Shared by reference in the pickle: walking it once per segment would make the
            # work grow with the square of the file. PyTorch never writes this.
            raise TraceError(f"{source}: {where}: its block list is the same object as an earlier segment's")
        block_lists.add(id(blocks))
        dump_segments[addr] = {"size": size, "stream": seg_stream,
                               "pool": "small" if seg.get("segment_type") == "small" else "large",
                               "expandable": bool(seg.get("is_expandable", False))}
        _dump_blocks(blocks, addr, source, where, dump_live)
    return dump_segments, dump_live


def _dump_blocks(blocks: list, addr: int, source: str, where: str,
                 dump_live: dict[int, tuple[int, int | None]]) -> None:
    """Adds the allocated blocks of the segment at `addr` to `dump_live`."""
    offset = 0                            # running sum of the sizes before block j
    for j, blk in enumerate(blocks):
        if not isinstance(blk, dict):
            raise TraceError(f"{source}: {where} block {j} is not a dict")
        bsize = _int(blk.get("size"), source, f"{where} block {j}", "size")
        if blk.get("state") in _ALLOCATED_STATES:
            baddr = blk.get("address")
            if type(baddr) is not int:   # older snapshots list blocks without addresses
                baddr = addr + offset
            dump_live[baddr] = (bsize, blk.get("requested_size"))
        offset += bsize


def _window_events(entries: list, source: str, cfg: Any) -> tuple[list[Event], list[int]]:
    """The window's events, forward, with allocations' block sizes; and the indices of the
    frees of blocks allocated before the window (their block size is not known yet: -1)."""
    has_completed = any(isinstance(e, dict) and e.get("action") == "free_completed" for e in entries)
    free_actions = {"free_completed"} if has_completed else {"free", "free_requested"}
    frame_cache: dict[tuple, Frame] = {}
    frame_lists: dict[int, tuple[Frame, ...]] = {}
    events: list[Event] = []
    live: dict[int, int] = {}            # allocated in the window: addr -> block size
    prewindow_frees: list[int] = []      # indices into events
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise TraceError(f"{source}: event {i} is not a dict")
        action = e.get("action")
        if not isinstance(action, str):
            continue                       # not an action PyTorch writes (and maybe unhashable)
        if action in free_actions:
            kind = "free"
        else:
            kind = _ACTION_MAP.get(action)  # type: ignore[arg-type]
            if kind == "free" or kind is None:
                continue                   # free_requested beside free_completed; snapshot; annotations
        where = f"event {i} ({action})"
        addr, size, stream, t = _event_fields(e, source, where)
        frames = _frames(e.get("frames"), frame_cache, frame_lists)
        if kind == "alloc":
            if size == 0:
                raise TraceError(f"{source}: {where}: zero-byte allocation")
            if addr in live:
                raise TraceError(f"{source}: {where}: address {addr:#x} allocated twice without a free")
            bsize = round_size(size, cfg)
            live[addr] = bsize
            events.append(Event("alloc", addr, bsize, stream, float(t), size, frames))
        elif kind == "free":
            bsize = live.pop(addr, -1)
            events.append(Event("free", addr, bsize, stream, float(t), size, frames))
            if bsize < 0:
                prewindow_frees.append(len(events) - 1)
        else:
            events.append(Event(kind, addr, size, stream, float(t), None, frames))
    return events, prewindow_frees


def _event_fields(e: dict, source: str, where: str) -> tuple[int, int, int, int | float]:
    """An entry's address, size, stream and time, each checked."""
    addr = _int(e.get("addr"), source, where, "addr")
    size = _int(e.get("size"), source, where, "size")
    if size < 0:
        raise TraceError(f"{source}: {where}: negative size {size}")
    stream = _int(e.get("stream", 0) or 0, source, where, "stream")
    t = e.get("time_us", 0) or 0
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t or abs(t) > 1e300:
        raise TraceError(f"{source}: {where}: time_us is not a number ({quote(t)})")
    return addr, size, stream, t


def _walk_back(events: list[Event], dump_segments: dict[int, dict[str, Any]],
               dump_live: dict[int, tuple[int, int | None]]
               ) -> tuple[dict[int, dict[str, Any]], dict[int, tuple[int, int | None]]]:
    """The segments and live blocks at the window's start, walking back from the dump."""
    start_live = dict(dump_live)
    start_segments = dict(dump_segments)
    for ev in reversed(events):
        if ev.action == "alloc":
            start_live.pop(ev.addr, None)
        elif ev.action == "free":
            start_live[ev.addr] = (ev.size, ev.requested)
        elif ev.action == "segment_alloc":
            start_segments.pop(ev.addr, None)
        elif ev.action == "segment_free":
            small = ev.size == K_SMALL_BUFFER
            start_segments[ev.addr] = {"size": ev.size, "stream": ev.stream, "pool": "small" if small else "large", "expandable": False}
    return start_segments, start_live


class _SegmentIndex:
    """The start state's segments by address, and which one holds an address."""

    def __init__(self, segments: dict[int, dict[str, Any]]) -> None:
        self.segments = segments
        self.addrs = sorted(segments)

    def segment_of(self, addr: int) -> int | None:
        k = bisect_right(self.addrs, addr) - 1
        if k >= 0 and addr < self.addrs[k] + self.segments[self.addrs[k]]["size"]:
            return self.addrs[k]
        return None


def _size_prewindow_frees(events: list[Event], prewindow_frees: list[int],
                          start_live: dict[int, tuple[int, int | None]], segments: _SegmentIndex,
                          cfg: Any, source: str) -> int:
    """Sets the block size of each pre-window block freed in the window (the rounded request,
    plus a large-pool tail of at most 1 MiB up to the next known block or the segment's end) in
    its event and in `start_live`. Returns how many took such a tail."""
    known = sorted(a for a, (s, _) in start_live.items() if s >= 0)
    guessed = 0
    for idx in prewindow_frees:
        ev = events[idx]
        seg_addr = segments.segment_of(ev.addr)
        if seg_addr is None:
            raise TraceError(f"{source}: event {idx} (free): free of unknown address {ev.addr:#x} "
                             "(never allocated in the window, and in no segment that existed before it)")
        rounded = round_size(ev.requested or 1, cfg)
        seg = segments.segments[seg_addr]
        k = bisect_right(known, ev.addr)
        boundary = min(known[k] if k < len(known) else seg_addr + seg["size"], seg_addr + seg["size"])
        gap = boundary - ev.addr - rounded
        size = rounded + gap if seg["pool"] == "large" and 0 < gap <= K_SMALL_SIZE else rounded
        guessed += size != rounded
        ev.size = size
        start_live[ev.addr] = (size, ev.requested)
    # the same block sizes on every later free of these addresses are already right: a
    # re-allocation in the window goes through the forward table above
    return guessed


def _start_layout(start_live: dict[int, tuple[int, int | None]], segments: _SegmentIndex,
                  source: str) -> tuple[list[Segment], list[Block]]:
    """The start state as segments with their block layout, free gaps included; and the
    allocated blocks."""
    by_segment: dict[int, list[tuple[int, int, int | None]]] = {a: [] for a in segments.addrs}
    for addr, (size, req) in start_live.items():
        seg_addr = segments.segment_of(addr)
        if seg_addr is None:
            raise TraceError(f"{source}: block at {addr:#x} live at the window's start lies in no segment")
        by_segment[seg_addr].append((addr, size, req))
    initial_segments: list[Segment] = []
    initial_blocks: list[Block] = []
    for seg_addr in segments.addrs:
        seg = segments.segments[seg_addr]
        end, cursor, layout = seg_addr + seg["size"], seg_addr, []
        for addr, size, req in sorted(by_segment[seg_addr]):
            if addr < cursor or addr + size > end:
                raise TraceError(f"{source}: blocks overlap at {addr:#x} in the rebuilt start state (segment {seg_addr:#x})")
            if addr > cursor:
                layout.append(Block(cursor, addr - cursor, None, seg["stream"], allocated=False))
            blk = Block(addr, size, req if type(req) is int else None, seg["stream"], allocated=True)
            layout.append(blk)
            initial_blocks.append(blk)
            cursor = addr + size
        if cursor < end:
            layout.append(Block(cursor, end - cursor, None, seg["stream"], allocated=False))
        initial_segments.append(Segment(seg_addr, seg["size"], seg["stream"], seg["pool"], layout, seg["expandable"]))
    return initial_segments, initial_blocks
