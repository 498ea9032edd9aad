"""Read the pprof profile `jax.profiler.device_memory_profile()` returns: one sample per live
buffer or loaded executable, with the Python stack that made it.

JAX writes pprof's `perftools.profiles.Profile`, gzipped: samples with values
(allocations/count, space/bytes), labels `kind` ("buffer", "executable") and `device`, and
locations leaf first. This is a small decoder of the few fields that carry those (protobuf's
wire format: varints and length-delimited fields), so the recorder needs no generated code and
no protobuf inside the user's process.

    samples = read_profile(jax.profiler.device_memory_profile())
    by_line = group_by_line(samples)        # {"train.py:42 (step)": LineTotal(bytes, count)}
"""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from jaxmem.errors import TraceError

# Files whose frames are not the user's own line: JAX, its libraries, Python itself, jaxmem.
LIBRARY_PARTS = (f"{os.sep}jax{os.sep}", f"{os.sep}jaxlib{os.sep}", f"{os.sep}flax{os.sep}", f"{os.sep}optax{os.sep}",
                 f"{os.sep}equinox{os.sep}", f"{os.sep}jaxmem{os.sep}", f"{os.sep}site-packages{os.sep}",
                 f"{os.sep}dist-packages{os.sep}", f"{os.sep}lib{os.sep}python3", "<frozen ", "<string>")


@dataclass(frozen=True)
class Frame:
    function: str
    filename: str
    line: int

    def where(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.line} ({self.function})"


@dataclass(frozen=True)
class Sample:
    """One live buffer (or executable) of a profile: its kind, device, bytes and stack (leaf first)."""
    kind: str
    device: str
    bytes: int
    count: int
    frames: tuple[Frame, ...] = field(default=())


@dataclass
class LineTotal:
    """What one line of the user's code holds: bytes and number of buffers."""
    bytes: int = 0
    count: int = 0


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise TraceError("device memory profile: truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 70:
            raise TraceError("device memory profile: bad varint")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of a protobuf message's fields; values of length-delimited
    fields are their bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise TraceError("device memory profile: truncated field")
            yield number, wire, data[pos:pos + size]
            pos += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, wire, int.from_bytes(data[pos:pos + width], "little")
            pos += width
        else:
            raise TraceError(f"device memory profile: unknown wire type {wire}")


def _ints(wire: int, value: int | bytes) -> list[int]:
    """A repeated integer field: packed (bytes of varints) or one value."""
    if wire == 0:
        return [int(value)]  # type: ignore[arg-type]
    out, pos, data = [], 0, bytes(value)  # type: ignore[arg-type]
    while pos < len(data):
        v, pos = _varint(data, pos)
        out.append(v)
    return out


def _sample(data: bytes) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    locations, values, labels = [], [], []
    for number, wire, value in fields(data):
        if number == 1:
            locations += _ints(wire, value)
        elif number == 2:
            values += [v - (1 << 64) if v >= 1 << 63 else v for v in _ints(wire, value)]
        elif number == 3:
            label = {n: v for n, _, v in fields(bytes(value))}  # type: ignore[arg-type]
            labels.append((int(label.get(1, 0)), int(label.get(2, 0)), int(label.get(3, 0))))  # type: ignore[arg-type]
    return locations, values, labels


def _location(data: bytes) -> tuple[int, list[tuple[int, int]]]:
    loc_id, lines = 0, []
    for number, _, value in fields(data):
        if number == 1:
            loc_id = int(value)  # type: ignore[arg-type]
        elif number == 4:
            line = {n: v for n, _, v in fields(bytes(value))}  # type: ignore[arg-type]
            lines.append((int(line.get(1, 0)), int(line.get(2, 0))))  # type: ignore[arg-type]
    return loc_id, lines


def _function(data: bytes) -> tuple[int, int, int]:
    f = {n: v for n, _, v in fields(data)}
    return int(f.get(1, 0)), int(f.get(2, 0)), int(f.get(4, 0))  # type: ignore[arg-type]


def read_profile(blob: bytes) -> list[Sample]:
    """The samples of a (gzipped or plain) pprof profile of device memory.

    Raises:
        TraceError: the bytes are not such a profile.
    """
    try:
        data = gzip.decompress(blob) if blob[:2] == b"\x1f\x8b" else bytes(blob)
    except (OSError, EOFError, zlib.error) as err:
        raise TraceError(f"device memory profile: not gzip ({err})") from None
    raw_samples, locations, functions, strings = [], {}, {}, []
    for number, wire, value in fields(data):
        if number == 2 and wire == 2:
            raw_samples.append(_sample(bytes(value)))  # type: ignore[arg-type]
        elif number == 4 and wire == 2:
            loc_id, lines = _location(bytes(value))  # type: ignore[arg-type]
            locations[loc_id] = lines
        elif number == 5 and wire == 2:
            fid, name, filename = _function(bytes(value))  # type: ignore[arg-type]
            functions[fid] = (name, filename)
        elif number == 6 and wire == 2:
            strings.append(bytes(value).decode("utf-8", "replace"))  # type: ignore[arg-type]
    return [_to_sample(s, locations, functions, strings) for s in raw_samples]


def _string(strings: list[str], index: int) -> str:
    return strings[index] if 0 <= index < len(strings) else ""


def _to_sample(raw: tuple[list[int], list[int], list[tuple[int, int, int]]], locations: dict, functions: dict,
               strings: list[str]) -> Sample:
    loc_ids, values, labels = raw
    named = {_string(strings, k): (_string(strings, s) if s else n) for k, s, n in labels}
    frames = []
    for loc in loc_ids:
        for fid, line in locations.get(loc, []):
            name, filename = functions.get(fid, (0, 0))
            frames.append(Frame(_string(strings, name), _string(strings, filename), line))
    count = values[0] if values else 0
    size = values[1] if len(values) > 1 else 0
    return Sample(kind=str(named.get("kind", "")), device=str(named.get("device", "")), bytes=size,
                  count=count, frames=tuple(frames))


def is_library(filename: str) -> bool:
    """Whether a frame's file is JAX's, a library's, Python's or jaxmem's rather than the user's.

    >>> is_library("/usr/lib/python3.11/site-packages/jax/_src/pjit.py"), is_library("/home/me/train.py")
    (True, False)
    """
    return any(part in filename for part in LIBRARY_PARTS)


def user_line(frames: tuple[Frame, ...]) -> str:
    """The innermost frame of the user's own code, as "file.py:42 (function)"; else the innermost
    frame at all, else "<no stack>"."""
    for frame in frames:
        if not is_library(frame.filename):
            return frame.where()
    return frames[0].where() if frames else "<no stack>"


def group_by_line(samples: list[Sample], kind: str = "buffer") -> dict[str, LineTotal]:
    """Bytes and buffers of one kind of sample, by the innermost line of the user's code that made
    them, largest first."""
    totals: dict[str, LineTotal] = {}
    for s in samples:
        if s.kind != kind:
            continue
        total = totals.setdefault(user_line(s.frames), LineTotal())
        total.bytes += s.bytes
        total.count += s.count
    return dict(sorted(totals.items(), key=lambda kv: -kv[1].bytes))


def group_by_line_and_size(samples: list[Sample], kind: str = "buffer") -> dict[tuple[str, int], int]:
    """Buffers of one kind by (the user's line that made them, their size in bytes): the count of
    each. A leak is one such group whose count grows; its size makes its bytes per step exact."""
    counts: dict[tuple[str, int], int] = {}
    for s in samples:
        if s.kind == kind and s.count:
            key = (user_line(s.frames), s.bytes // s.count)
            counts[key] = counts.get(key, 0) + s.count
    return counts
