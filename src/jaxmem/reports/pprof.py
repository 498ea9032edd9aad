"""Gzipped pprof profiles of the blocks live at one moment, as `jax.profiler` writes them.

`jax.profiler.save_device_memory_profile` writes a `perftools.profiles.Profile` (pprof's
profile.proto) with two sample types, allocations/count and space/bytes, one sample per live
buffer whose locations are its Python stack (leaf first), and a `kind` label. This module
writes the same shape with a small protobuf encoder of its own (the message is a handful of
varint and length-delimited fields; no generated code is needed):

    blob = profile_bytes(data.live_at(data.peak_x))
    Path("profile.pb.gz").write_bytes(blob)      # then: pprof -top profile.pb.gz

Field numbers follow profile.proto: Profile{sample_type=1, sample=2, location=4, function=5,
string_table=6, default_sample_type=14}, ValueType{type=1, unit=2},
Sample{location_id=1, value=2, label=3}, Label{key=1, str=2, num=3, num_unit=4},
Location{id=1, line=4}, Line{function_id=1, line=2},
Function{id=1, name=2, system_name=3, filename=4, start_line=5}.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Sequence

from jaxmem.reports.data import Block



def fallback_frame(block: Block) -> tuple[str, int, str]:
    """The one frame of a block with no known source (an argument, a loop's scratch), named
    after its label so that pprof still tells such blocks apart ("argument 3", "params['w']")."""
    return ("<no source>", 0, block.label or "<unknown source>")


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 negatives are ten-byte two's complement varints
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, value: int) -> bytes:
    return _key(field, 0) + _varint(value) if value else b""


def _bytes(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _packed(field: int, values: Sequence[int]) -> bytes:
    return _bytes(field, b"".join(_varint(v) for v in values)) if values else b""


class _Strings:
    """pprof's string table: index 0 is always the empty string."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}
        self.table: list[str] = [""]

    def __call__(self, text: str) -> int:
        found = self.index.get(text)
        if found is None:
            found = self.index[text] = len(self.table)
            self.table.append(text)
        return found


def profile_bytes(blocks: Sequence[Block], *, device: str = "jaxmem", gzipped: bool = True) -> bytes:
    """A pprof profile with one sample per block: its stack, one allocation, its bytes.

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> from jaxmem.reports.data import from_plan
    >>> data = from_plan(plan)
    >>> raw = profile_bytes(data.live_at(data.peak_x), gzipped=False)
    >>> gzip.decompress(profile_bytes(data.live_at(data.peak_x))) == raw
    True

    Args:
        blocks: the blocks to profile (typically those live at one step).
        device: the value of each sample's `device` label.
        gzipped: gzip the message, as pprof expects on disk.

    Returns:
        the serialized (and by default gzipped) `perftools.profiles.Profile`.
    """
    strings = _Strings()
    functions: dict[tuple[str, str], int] = {}
    function_lines: dict[int, int] = {}
    locations: dict[tuple[int, int], int] = {}
    body = bytearray()
    for type_, unit in (("allocations", "count"), ("space", "bytes")):
        body += _bytes(1, _int(1, strings(type_)) + _int(2, strings(unit)))

    k_kind, k_device, k_category, k_shape, k_op = (strings(s) for s in ("kind", "device", "category", "shape", "op"))
    k_bytes, v_buffer, v_device, u_bytes = strings("bytes"), strings("buffer"), strings(device), strings("bytes")
    samples = bytearray()
    for block in blocks:
        ids = []
        for file, line, function in (block.frames or (fallback_frame(block),)):
            fkey = (function, file)
            fid = functions.get(fkey)
            if fid is None:
                fid = functions[fkey] = len(functions) + 1
                function_lines[fid] = line
            function_lines[fid] = min(function_lines[fid], line) if line else function_lines[fid]
            lkey = (fid, line)
            lid = locations.get(lkey)
            if lid is None:
                lid = locations[lkey] = len(locations) + 1
            ids.append(lid)
        labels = [
            _int(1, k_kind) + _int(2, v_buffer),
            _int(1, k_device) + _int(2, v_device),
            _int(1, k_category) + _int(2, strings(block.category)),
            _int(1, k_bytes) + _int(3, block.size) + _int(4, u_bytes),
        ]
        if block.shape or block.dtype:
            shape = f"{block.dtype}[{','.join(map(str, block.shape))}]"
            labels.append(_int(1, k_shape) + _int(2, strings(shape)))
        if block.label:
            labels.append(_int(1, k_op) + _int(2, strings(block.label)))
        sample = _packed(1, ids) + _packed(2, [1, block.size]) + b"".join(_bytes(3, lab) for lab in labels)
        samples += _bytes(2, sample)
    body += samples
    for (fid, line), lid in locations.items():
        body += _bytes(4, _int(1, lid) + _bytes(4, _int(1, fid) + _int(2, line)))
    for (function, file), fid in functions.items():
        name = strings(function)
        body += _bytes(5, _int(1, fid) + _int(2, name) + _int(3, name) + _int(4, strings(file))
                       + _int(5, function_lines[fid]))
    default = strings("space")
    for text in strings.table:
        body += _bytes(6, text.encode("utf-8"))
    body += _int(14, default)
    raw = bytes(body)
    return gzip.compress(raw, mtime=0) if gzipped else raw


def write_pprof(path: str | Path, blocks: Sequence[Block], *, device: str = "jaxmem") -> int:
    """Write `profile_bytes(blocks)` to `path`; returns the bytes written."""
    blob = profile_bytes(blocks, device=device)
    Path(path).write_bytes(blob)
    return len(blob)
