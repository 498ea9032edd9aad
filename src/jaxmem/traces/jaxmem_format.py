"""jaxmem's own trace format: JSON lines, a header object then one object per event.

    {"format": "jaxmem-trace", "version": 1, "source": ..., "initial_segments": [...], ...}
    {"action": "alloc", "addr": 0, "size": 1024, "requested": 1000, "frames": [["f.py", 3, "g"]]}
    {"action": "free", "addr": 0, "size": 1024}

Fields at their default value (stream 0, no frames, no label) are left out. `write_jaxmem_trace`
and `read_jaxmem_trace` round-trip every field of a `Trace`.

    write_jaxmem_trace(trace, "run.jaxmem.jsonl")
    same = read_jaxmem_trace("run.jaxmem.jsonl")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from jaxmem.errors import TraceError, quote
from jaxmem.traces.model import ACTIONS, Block, Event, Frame, Segment, Trace, read_trace_text

FORMAT, VERSION = "jaxmem-trace", 1


def _block_json(b: Block) -> dict[str, Any]:
    return {"addr": b.addr, "size": b.size, "requested": b.requested, "stream": b.stream, "allocated": b.allocated}


def _event_json(e: Event) -> dict[str, Any]:
    out: dict[str, Any] = {"action": e.action, "addr": e.addr, "size": e.size}
    if e.stream:
        out["stream"] = e.stream
    if e.time_us:
        out["time_us"] = e.time_us
    if e.requested is not None:
        out["requested"] = e.requested
    if e.frames:
        out["frames"] = [[f.filename, f.line, f.name] for f in e.frames]
    if e.label:
        out["label"] = e.label
    return out


def trace_lines(trace: Trace) -> Iterable[str]:
    """The file's lines (without newlines), header first."""
    header = {
        "format": FORMAT, "version": VERSION, "source": trace.source, "trace_format": trace.format,
        "initial_segments": [{"addr": s.addr, "size": s.size, "stream": s.stream, "pool": s.pool,
                              "expandable": s.expandable, "blocks": [_block_json(b) for b in s.blocks]}
                             for s in trace.initial_segments],
        "initial_blocks": [_block_json(b) for b in trace.initial_blocks],
        "allocator_settings": trace.allocator_settings, "device_capacity": trace.device_capacity,
        "meta": trace.meta,
    }
    yield json.dumps(header, default=str)
    for e in trace.events:
        yield json.dumps(_event_json(e))


def write_jaxmem_trace(trace: Trace, path: str | Path) -> None:
    """Write `trace` to `path` in the jaxmem format (JSON lines)."""
    with open(path, "w", encoding="utf-8") as out:
        for line in trace_lines(trace):
            out.write(line)
            out.write("\n")


def _int(obj: dict, key: str, where: str, default: int | None = None) -> int:
    value = obj.get(key, default)
    if type(value) is not int or not -(1 << 64) < value < 1 << 64:
        raise TraceError(f"{where}: '{key}' must be a 64-bit integer, got {quote(value)}")
    return value


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: corrupt or truncated line ({err.msg})") from None
    except RecursionError:
        raise TraceError(f"{where}: nested too deeply") from None


def _list(header: dict, key: str, where: str) -> list:
    value = header.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise TraceError(f"{where}: '{key}' must be a list, got {quote(value)}")
    return value


def _dict(header: dict, key: str, where: str) -> dict:
    value = header.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TraceError(f"{where}: '{key}' must be an object, got {quote(value)}")
    return value


def _block(obj: Any, where: str) -> Block:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a block must be an object")
    req = obj.get("requested")
    if req is not None and type(req) is not int:
        raise TraceError(f"{where}: 'requested' must be an integer or null")
    size = _int(obj, "size", where)
    if size < 0:
        raise TraceError(f"{where}: negative size {size}")
    return Block(_int(obj, "addr", where), size, req, _int(obj, "stream", where, 0), bool(obj.get("allocated", True)))


def parse_jaxmem_trace(text: str, source: str = "<jaxmem trace>") -> Trace:
    """A Trace from the text of a jaxmem trace file; TraceError naming the bad line otherwise."""
    lines = text.splitlines()
    if not lines:
        raise TraceError(f"{source}: empty file")
    header = _json_line(lines[0], f"{source}: header line")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError(f"{source}: not a jaxmem trace (no '\"format\": \"{FORMAT}\"' header)")
    if header.get("version") != VERSION:
        raise TraceError(f"{source}: unsupported jaxmem trace version {quote(header.get('version'))}")
    settings = _dict(header, "allocator_settings", source)
    meta = _dict(header, "meta", source)
    segments = []
    for k, s in enumerate(_list(header, "initial_segments", source)):
        where = f"{source}: initial segment {k}"
        if not isinstance(s, dict):
            raise TraceError(f"{where}: must be an object")
        pool = s.get("pool", "large")
        if pool not in ("large", "small"):
            raise TraceError(f"{where}: 'pool' must be \"large\" or \"small\", got {quote(pool)}")
        segments.append(Segment(_int(s, "addr", where), _int(s, "size", where), _int(s, "stream", where, 0),
                                pool, [_block(b, where) for b in _list(s, "blocks", where)],
                                bool(s.get("expandable", False))))
    blocks = [_block(b, f"{source}: initial block {k}") for k, b in enumerate(_list(header, "initial_blocks", source))]
    events: list[Event] = []
    frame_cache: dict[tuple, Frame] = {}
    for n, line in enumerate(lines[1:]):
        if not line.strip():
            continue
        where = f"{source}: event {len(events)} (line {n + 2})"
        obj = _json_line(line, where)
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: must be an object")
        action = obj.get("action")
        if not isinstance(action, str) or action not in ACTIONS:
            raise TraceError(f"{where}: unknown action {quote(action)}")
        size = _int(obj, "size", where)
        if size < 0:
            raise TraceError(f"{where}: negative size {size}")
        req = obj.get("requested")
        if req is not None and (type(req) is not int or req < 0):
            raise TraceError(f"{where}: 'requested' must be a non-negative integer")
        t = obj.get("time_us", 0.0)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not abs(t) < 1e300:
            raise TraceError(f"{where}: 'time_us' must be a number")
        frames = []
        for f in _list(obj, "frames", where):
            if not (isinstance(f, list) and len(f) == 3 and type(f[1]) is int and isinstance(f[0], str)
                    and isinstance(f[2], str)):
                raise TraceError(f"{where}: a frame must be [filename, line, name]")
            key = (f[0], f[1], f[2])
            fr = frame_cache.get(key)
            if fr is None:
                fr = frame_cache[key] = Frame(*key)
            frames.append(fr)
        label = obj.get("label", "")
        events.append(Event(action, _int(obj, "addr", where), size, _int(obj, "stream", where, 0), float(t),
                            req, tuple(frames), label if isinstance(label, str) else ""))
    cap = header.get("device_capacity")
    name, kind = header.get("source"), header.get("trace_format")
    return Trace(events, name if isinstance(name, str) and name else source,
                 kind if isinstance(kind, str) and kind else "jaxmem", segments, blocks, settings,
                 cap if type(cap) is int and 0 < cap < 1 << 64 else None, meta)


def read_jaxmem_trace(path: str | Path) -> Trace:
    """Read a jaxmem trace file (see `parse_jaxmem_trace`)."""
    return parse_jaxmem_trace(read_trace_text(path), str(path))
