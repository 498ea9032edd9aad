"""`load_trace(path)`: read any supported allocation trace, telling the format from the bytes.

Formats: "torch-snapshot" (a pickle from torch.cuda.memory._dump_snapshot), "chrome" (a PyTorch
profiler trace with [memory] events), "rmm-csv" (RMM's logging_resource_adaptor) and "jaxmem"
(JSON lines with a jaxmem-trace header). Gzipped files are read the same way.

    trace = load_trace("memory.pickle")           # format sniffed
    trace = load_trace("log.csv", format="rmm-csv")
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from jaxmem.errors import TraceError, quote
from jaxmem.traces.model import Trace
from jaxmem.units import format_size, parse_size

# A gzipped trace may expand to EXPANSION times its size, and to MIN_LIMIT at least: traces
# compress 5-20 times, a gzip bomb about 1000 times, so work and memory stay bounded by the
# size of the file. JAXMEM_TRACE_MAX_BYTES replaces the limit.
EXPANSION = 50
MIN_LIMIT = 64 << 20

FORMATS = ("torch-snapshot", "chrome", "rmm-csv", "jaxmem")
_ALIASES = {"pickle": "torch-snapshot", "snapshot": "torch-snapshot", "torch": "torch-snapshot",
            "rmm": "rmm-csv", "csv": "rmm-csv", "json": "chrome"}


def sniff_format(data: bytes) -> str | None:
    """The format of a trace's (decompressed) bytes, or None when it is none of them.

    >>> sniff_format(b'Thread,Time,Action,Pointer,Size,Stream\\n'), sniff_format(b'\\x80\\x04}')
    ('rmm-csv', 'torch-snapshot')
    """
    if data[:1] == b"\x80":
        return "torch-snapshot"
    if data[:1] in (b"(", b"}", b"]", b"c") and data.rstrip().endswith(b"."):
        return "torch-snapshot"          # protocol 0/1 pickles: text opcodes, STOP at the end
    head = data[:4096].lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"Thread,Time,Action"):
        return "rmm-csv"
    if head.startswith(b"{"):
        first = data.lstrip().split(b"\n", 1)[0]
        if b'"jaxmem-trace"' in first:
            return "jaxmem"
        return "chrome"
    if head.startswith(b"["):
        return "chrome"
    return None


def _text(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise TraceError(f"{source}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def max_decompressed(compressed: int) -> int:
    """The most bytes a compressed trace of `compressed` bytes may expand to."""
    text = os.environ.get("JAXMEM_TRACE_MAX_BYTES")
    return parse_size(text) if text else max(MIN_LIMIT, EXPANSION * compressed)


def gunzip(data: bytes, source: str, limit: int) -> bytes:
    """The decompressed bytes of a gzip file (every member), refused past `limit` bytes
    without ever holding more than that."""
    out: list[bytes] = []
    total = 0
    while data:
        inflater = zlib.decompressobj(wbits=31)
        try:
            while data:
                chunk = inflater.decompress(data, limit + 1 - total)
                total += len(chunk)
                out.append(chunk)
                if total > limit:
                    raise TraceError(f"{source}: decompresses to more than {format_size(limit)} (the limit: "
                                     f"{EXPANSION} times the file, at least {format_size(MIN_LIMIT)}); set "
                                     "JAXMEM_TRACE_MAX_BYTES higher if the trace is genuine")
                if inflater.eof:
                    break
                data = inflater.unconsumed_tail
                if not chunk and not data:
                    break
            if not inflater.eof:
                raise TraceError(f"{source}: corrupt or truncated gzip (it ends inside a compressed stream)")
        except zlib.error as err:
            raise TraceError(f"{source}: corrupt or truncated gzip ({err})") from None
        data = inflater.unused_data.lstrip(b"\0")  # the next member, if any (zero padding allowed)
    return b"".join(out)


def parse_trace(data: bytes, source: str, format: str | None = None) -> Trace:
    """A Trace from a file's bytes (see `load_trace`)."""
    if data[:2] == b"\x1f\x8b":
        data = gunzip(data, source, max_decompressed(len(data)))
    if not data.strip():
        raise TraceError(f"{source}: empty file")
    fmt = _ALIASES.get(format, format) if format else sniff_format(data)
    if fmt is None and source.lower().endswith((".pickle", ".pkl")):
        fmt = "torch-snapshot"
    if fmt is None:
        raise TraceError(f"{source}: unknown trace format (expected one of: {', '.join(FORMATS)})")
    if fmt == "torch-snapshot":
        from jaxmem.traces.safe_pickle import loads_plain
        from jaxmem.traces.torch_snapshot import snapshot_to_trace

        return snapshot_to_trace(loads_plain(data, source), source)
    if fmt == "chrome":
        from jaxmem.traces.chrome import chrome_to_trace

        try:
            parsed = json.loads(_text(data, source))
        except json.JSONDecodeError as err:
            raise TraceError(f"{source}: corrupt or truncated JSON ({err.msg} at line {err.lineno})") from None
        except RecursionError:
            raise TraceError(f"{source}: JSON nested too deeply to be a Chrome trace") from None
        return chrome_to_trace(parsed, source)
    if fmt == "rmm-csv":
        from jaxmem.traces.rmm_csv import parse_rmm_csv

        return parse_rmm_csv(_text(data, source), source)
    if fmt == "jaxmem":
        from jaxmem.traces.jaxmem_format import parse_jaxmem_trace

        return parse_jaxmem_trace(_text(data, source), source)
    raise TraceError(f"{source}: unknown format {quote(format)}; one of: {', '.join(FORMATS)}")


def load_trace(path: str | Path, format: str | None = None) -> Trace:
    """Read the trace at `path`; TraceError (one line, naming the file) on anything wrong.

    Args:
        path: a snapshot pickle, Chrome trace JSON, RMM CSV or jaxmem trace, maybe gzipped.
        format: one of FORMATS to skip sniffing.
    Returns:
        The Trace.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TraceError(f"{path}: cannot read ({err.strerror or err})") from None
    return parse_trace(data, str(path), format)
