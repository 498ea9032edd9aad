"""RAPIDS RMM's allocation log (`logging_resource_adaptor`): CSV `Thread,Time,Action,Pointer,Size,Stream`.

Actions are "allocate", "free" and "allocate failure"; Pointer and Stream are hex, Time is the
wall clock as HH:MM:SS.ffffff. The writer emits the same columns, so RMM's own replay benchmark
can read what jaxmem writes, and jaxmem can read RMM's logs.

    trace = read_rmm_csv("rmm_log.csv")
    write_rmm_csv(trace, "copy.csv")      # alloc/free/oom only: RMM logs nothing else
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from jaxmem.errors import TraceError, quote
from jaxmem.traces.model import Event, Trace, read_trace_text

HEADER = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"]
_ACTIONS = {"allocate": "alloc", "free": "free", "allocate failure": "oom"}
_DAY_US = 86_400_000_000


def _parse_int(text: str, where: str, what: str) -> int:
    t = text.strip()
    try:
        value = int(t, 16) if t.lower().startswith(("0x", "-0x")) else int(t)
    except ValueError:
        raise TraceError(f"{where}: {what} {quote(text)} is not a number") from None
    if not -(1 << 64) < value < 1 << 64:
        raise TraceError(f"{where}: {what} {quote(text)} is not a 64-bit number")
    return value


def _parse_time(text: str, where: str) -> float:
    t = text.strip()
    try:
        if ":" not in t:
            return float(t) * 1e6          # plain seconds
        parts = t.split(":")
        if len(parts) == 4:                # HH:MM:SS:ffffff
            h, m, s, frac = parts
            sec = float(f"{s}.{frac}")
        elif len(parts) == 3:              # HH:MM:SS.ffffff
            h, m, s = parts
            sec = float(s)
        else:
            raise ValueError(t)
        return ((int(h) * 60 + int(m)) * 60 + sec) * 1e6
    except ValueError:
        raise TraceError(f"{where}: cannot read time {quote(text)}") from None


def parse_rmm_csv(text: str, source: str = "<rmm csv>") -> Trace:
    """A Trace from the text of an RMM log; frees must name a pointer allocated earlier."""
    try:
        return _parse(text, source)
    except csv.Error as err:
        raise TraceError(f"{source}: corrupt CSV ({err})") from None


def _parse(text: str, source: str) -> Trace:
    rows = csv.reader(io.StringIO(text.lstrip("\ufeff"), newline=""))
    header = next(rows, None)
    if header is None or [h.strip() for h in header][:6] != HEADER:
        raise TraceError(f"{source}: not an RMM log (expected the header {','.join(HEADER)})")
    events: list[Event] = []
    live: dict[int, int] = {}
    threads: set[str] = set()
    for n, row in enumerate(rows):
        if not row or not "".join(row).strip():
            continue
        where = f"{source}: event {len(events)} (line {n + 2})"
        if len(row) < 6:
            raise TraceError(f"{where}: truncated row ({len(row)} of 6 columns)")
        thread, time_s, action, ptr, size_s, stream_s = (c.strip() for c in row[:6])
        kind = _ACTIONS.get(action.lower())
        if kind is None:
            raise TraceError(f"{where}: unknown action {quote(action)}")
        addr = _parse_int(ptr, where, "pointer") if ptr else 0
        size = _parse_int(size_s, where, "size")
        if size < 0:
            raise TraceError(f"{where}: negative size {size}")
        stream = _parse_int(stream_s, where, "stream") if stream_s else 0
        t = _parse_time(time_s, where)
        threads.add(thread)
        if kind == "alloc":
            if size == 0:
                continue                    # RMM hands out nullptr for 0 bytes; nothing to replay
            if addr in live:
                raise TraceError(f"{where}: pointer {addr:#x} allocated twice without a free")
            live[addr] = size
            events.append(Event("alloc", addr, size, stream, t, size))
        elif kind == "free":
            if size == 0 and addr not in live:
                continue
            if addr not in live:
                raise TraceError(f"{where}: free of unknown address {addr:#x}")
            live.pop(addr)
            events.append(Event("free", addr, size, stream, t, size))
        else:
            events.append(Event("oom", addr, size, stream, t, size))
    return Trace(events, source, "rmm-csv", meta={"threads": len(threads)})


def read_rmm_csv(path: str | Path) -> Trace:
    """Read an RMM log file (see `parse_rmm_csv`)."""
    return parse_rmm_csv(read_trace_text(path), str(path))


def _format_time(time_us: float) -> str:
    us = int(round(time_us)) % _DAY_US
    sec, frac = divmod(us, 1_000_000)
    return f"{sec // 3600:02d}:{sec // 60 % 60:02d}:{sec % 60:02d}.{frac:06d}"


def rmm_csv_text(trace: Trace, thread: int = 0) -> str:
    """The RMM log text for `trace`'s alloc, free and oom events (sizes are the requests)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(HEADER)
    names = {"alloc": "allocate", "free": "free", "oom": "allocate failure"}
    for e in trace.events:
        name = names.get(e.action)
        if name is None:
            continue
        size = e.requested if e.requested is not None else e.size
        w.writerow([thread, _format_time(e.time_us), name, hex(e.addr), size, hex(e.stream)])
    return out.getvalue()


def write_rmm_csv(trace: Trace, path: str | Path) -> None:
    """Write `trace` as an RMM log. Segment events and the start state are not representable."""
    Path(path).write_text(rmm_csv_text(trace), encoding="utf-8")
