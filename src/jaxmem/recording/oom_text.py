"""TEMPORARY minimal parser (replaced by the full one)."""
from __future__ import annotations
import re
from dataclasses import dataclass

@dataclass(frozen=True)
class OomText:
    kind: str
    requested: int | None = None
    free: int | None = None
    reserved: int | None = None
    reservable: int | None = None
    program: str | None = None

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40}

def _size(text: str) -> int:
    m = re.match(r"([\d.]+)\s*([A-Za-z]*)", text)
    return int(round(float(m.group(1)) * _UNITS.get(m.group(2).upper().replace("BYTES", ""), 1)))

def parse_oom(text: str) -> OomText | None:
    m = re.search(r"Error loading program '([^']+)': Attempting to reserve (\S+) at the bottom of memory\. That was not possible\. There are (\S+) free, (\S+) reserved, and (\S+) reservable", text)
    if m:
        return OomText("tpu_program_load", _size(m[2]), _size(m[3]), _size(m[4]), _size(m[5]), m[1])
    m = re.search(r"Attempting to allocate (\S+)\. That was not possible\. There are (\S+) free", text)
    if m:
        return OomText("tpu_buffer", _size(m[1]), _size(m[2]))
    m = re.search(r"Out of memory allocating (\d+) bytes", text)
    if m:
        return OomText("cpu", int(m[1]))
    return None
