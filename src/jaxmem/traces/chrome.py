"""PyTorch profiler Chrome traces (`profile_memory=True`): the `[memory]` instant events.

Each allocation or free the profiler saw is an instant event named "[memory]" whose args hold
`Addr`, `Bytes` (negative for a free), `Total Allocated`, `Total Reserved`, `Device Type`
(0 CPU, 1 CUDA) and `Device Id`. The reader keeps one device (default: the GPU with the most
events), turns rises and falls of `Total Reserved` into segment_alloc / segment_free events (the
recorded allocator's own traffic, as the profiler reports it), and treats frees of blocks
allocated before profiling started as blocks live at the window's start.

    trace = read_chrome_trace("trace.json")       # or .json.gz via load_trace
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from jaxmem.errors import TraceError, quote
from jaxmem.traces.model import Block, Event, Trace

MEMORY_EVENT = "[memory]"
CUDA = 1


def _num(value: Any, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or abs(value) >= 2.0 ** 64:
        raise TraceError(f"{where}: '{what}' must be a 64-bit number, got {quote(value)}")
    return int(value)


def _device_of(args: dict, where: str) -> tuple[int, int]:
    kind, index = args.get("Device Type", 0), args.get("Device Id", 0)
    for what, value in (("Device Type", kind), ("Device Id", index)):
        if type(value) is not int:
            raise TraceError(f"{where}: '{what}' must be an integer, got {quote(value)}")
    return kind, index


def chrome_to_trace(data: Any, source: str = "<chrome trace>", device: tuple[int, int] | None = None) -> Trace:
    """A Trace from a parsed Chrome trace (a dict with traceEvents, or a list of events).

    Args:
        data: the parsed JSON.
        source: the file name, for messages.
        device: (device type, device id) to keep; default the GPU with the most memory events,
            else the CPU.
    """
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise TraceError(f"{source}: not a Chrome trace (no traceEvents list)")
    mem = [(i, e) for i, e in enumerate(raw) if isinstance(e, dict) and e.get("name") == MEMORY_EVENT]
    if not mem:
        raise TraceError(f"{source}: no '[memory]' events (record with profile_memory=True)")
    counts: Counter = Counter()
    for i, e in mem:
        args = e.get("args")
        if not isinstance(args, dict):
            raise TraceError(f"{source}: event {i} ([memory]): no args")
        counts[_device_of(args, f"{source}: event {i} ([memory])")] += 1
    if device is None:
        gpus = [k for k in counts if k[0] == CUDA]
        device = max(gpus or list(counts), key=lambda k: counts[k])
    events: list[Event] = []
    initial: list[Block] = []
    live: dict[int, int] = {}
    reserved: int | None = None
    start_reserved = 0
    for i, e in mem:
        args = e["args"]
        if _device_of(args, source) != device:
            continue
        where = f"{source}: event {i} ([memory])"
        addr = _num(args.get("Addr"), where, "Addr")
        nbytes = _num(args.get("Bytes"), where, "Bytes")
        ts = e.get("ts", 0)
        t = float(ts) if isinstance(ts, float) else float(_num(ts, where, "ts"))
        total_res = args.get("Total Reserved")
        if isinstance(total_res, (int, float)) and not isinstance(total_res, bool):
            total_res = int(total_res)
            if reserved is None:
                start_reserved = total_res
            elif total_res > reserved:
                events.append(Event("segment_alloc", 0, total_res - reserved, 0, t))
            elif total_res < reserved:
                events.append(Event("segment_free", 0, reserved - total_res, 0, t))
            reserved = total_res
        if nbytes > 0:
            if addr in live:
                raise TraceError(f"{where}: address {addr:#x} allocated twice without a free")
            live[addr] = nbytes
            events.append(Event("alloc", addr, nbytes, 0, t, nbytes))
        elif nbytes < 0:
            size = -nbytes
            if addr not in live:
                # allocated before profiling began: live at the window's start
                initial.append(Block(addr, size, size))
            else:
                live.pop(addr)
            events.append(Event("free", addr, size, 0, t, size))
    # the first sample already includes its own event; reserved before it is unknown, so the
    # start is taken as that first reading
    return Trace(events, source, "chrome", initial_blocks=initial,
                 meta={"device": list(device), "recorded_start_reserved": start_reserved})


def read_chrome_trace(path: str | Path) -> Trace:
    """Read a Chrome trace JSON file (see `chrome_to_trace`)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot read ({err})") from None
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: corrupt or truncated JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise TraceError(f"{path}: JSON nested too deeply to be a Chrome trace") from None
    return chrome_to_trace(data, str(path))
