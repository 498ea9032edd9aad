"""Out-of-memory texts read into figures: the TPU runtime's, XLA's and the BFC allocator's.

    >>> oom = parse_oom("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
    ...                 "for HLO temporaries (16.54G) exceeds available HBM (15.75G).")
    >>> oom.kind, oom.requested.bytes, oom.limit.text, oom.limit.exact
    ('tpu_compile_hbm', 17759689769, '15.75G', False)

The forms read (`OomText.kind`):

- `tpu_buffer`: the TPU runtime's E0100, a buffer it could not allocate ("Attempting to allocate
  4.00G. That was not possible. There are 3.75G free.; (0x0x0_HBM0)").
- `tpu_program_load`: E0101, a program whose temporaries could not be reserved at the bottom of
  memory when it loaded ("There are 3.75G free, 0B reserved, and 3.75G reservable.").
- `tpu_compile_hbm`: XLA:TPU refusing to compile: the short line ("HLO temporaries (16.54G)
  exceeds available HBM (15.75G)"), the long report ("Used 41.74G of 16.00G hbm", "Program hbm
  requirement", "Largest program allocations in hbm:") and the early abort ("Requires 3.47E").
- `gpu_xla_oom`: XLA:GPU's "Out of memory while trying to allocate N bytes" with its buffer
  assignment's statistics and peak buffers.
- `cpu_alloc`: JAX's CPU backend refusing an allocation ("Out of memory allocating N bytes").
- `gpu_bfc`: the BFC allocator's log: "Allocator (GPU_0_bfc) ran out of memory trying to allocate
  1.50GiB (rounded to 1610612736)", its bins, "Sum Total of in-use chunks" and `Stats:` block.

Sizes are kept as `Size`: bytes as an int, the text as printed, and whether the text gave the
bytes exactly ("6291456 bytes") or rounded them ("4.00G" is about 4 GiB). A figure printed both
ways takes the bytes. Reading is bounded: a log is read a chunk at a time (`relevant_lines` keeps
only lines near an error marker, each line cut at `LINE_CAP` characters, at most `KEPT_CAP` characters
in all) and every pattern is matched on one line, with no nested repetition.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import BinaryIO, Iterable, Iterator

KINDS = ("tpu_buffer", "tpu_program_load", "tpu_compile_hbm", "gpu_xla_oom", "gpu_bfc", "cpu_alloc")
LINE_CAP = 64 * 1024          # characters kept of one line
KEPT_CAP = 16 * 1024 * 1024   # characters kept of a whole log
WINDOW = 400                  # lines kept after an error marker
MAX_ROWS = 200                # allocations or bins kept per error

_SCALES = {"": 1, "b": 1, "bytes": 1}
for _i, _p in enumerate("KMGTPE", start=1):
    _SCALES[_p.lower()] = _SCALES[_p.lower() + "ib"] = 1 << (10 * _i)   # XLA's "G" is binary
    _SCALES[_p.lower() + "b"] = 1000 ** _i

SIZE = r"[0-9]+(?:\.[0-9]+)?(?: ?(?:[KMGTPE]iB|[KMGTPE]B|[KMGTPE]|B|bytes)(?![A-Za-z]))?"
_TOKEN = re.compile(r"([0-9]+(?:\.[0-9]+)?) ?([A-Za-z]*)")


@dataclass(frozen=True)
class Size:
    """A size as an error text gave it: `bytes`, the `text` printed, and whether it was `exact`."""

    bytes: int
    text: str
    exact: bool

    def describe(self) -> str:
        """'6291456 bytes' when exact, 'about 4.00 GiB (4.00G)' when the text rounded it."""
        from jaxmem.units import format_size

        if self.exact:
            return f"{self.bytes:,} bytes ({format_size(self.bytes)})"
        return f"about {format_size(self.bytes)} ({self.text})"

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "text": self.text, "exact": self.exact}


def parse_size_text(text: str) -> Size:
    """A printed size: "16.00G", "1.50GiB", "123456789 bytes", "4.0KiB", "512B", "2.31M".

    >>> parse_size_text("1.50GiB"), parse_size_text("512B")
    (Size(bytes=1610612736, text='1.50GiB', exact=False), Size(bytes=512, text='512B', exact=True))
    """
    match = _TOKEN.fullmatch(text.strip())
    if match is None or match.group(2).lower() not in _SCALES:
        raise ValueError(f"not a size: {text[:40]!r}")
    number, unit = match.group(1), match.group(2).lower()
    scale = _SCALES[unit]
    exact = scale == 1 and "." not in number
    return Size(round(Fraction(number) * scale), text.strip(), exact)


def _exact(count: str, text: str | None = None) -> Size:
    """A size given in bytes; `text` the rounded form printed beside it, if any."""
    return Size(int(count), text or count, True)


@dataclass(frozen=True)
class Allocation:
    """One of XLA's largest program allocations (TPU) or peak buffers (GPU)."""

    rank: int
    size: Size | None = None
    shape: str | None = None
    op_name: str | None = None
    op_type: str | None = None
    source: str | None = None          # "file.py:123"
    label: str | None = None           # XLA's label (the HLO instruction)
    allocation_type: str | None = None  # "HLO temp", "parameter", ...
    unpadded: Size | None = None

    def to_dict(self) -> dict:
        return {k: (v.to_dict() if isinstance(v, Size) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Bin:
    """One `Bin (N):` line of a BFC allocator's out-of-memory log."""

    bin_size: int
    total_chunks: int
    chunks_in_use: int
    allocated: Size
    in_use: Size
    requested_in_use: Size | None

    def to_dict(self) -> dict:
        return {k: (v.to_dict() if isinstance(v, Size) else v) for k, v in self.__dict__.items()}


_SIZE_FIELDS = ("requested", "free", "reserved", "reservable", "largest_free_block", "limit", "in_use")


@dataclass(frozen=True)
class OomText:
    """One out-of-memory error read from a text: its `kind` (see `KINDS`), figures and rows.

    `requested`: what could not be had (a buffer, a reservation, the compiled program's total);
    `limit`: what the device offers (XLA's "available HBM", BFC's `Limit`); `device`: the memory
    space or allocator named ("0x0x0_HBM0", "hbm", "GPU_0_bfc"); `breakdown`: the report's named
    sizes (XLA:TPU's "program.HLO temp", XLA:GPU's "preallocated temp allocation"); `stats`: a BFC
    `Stats:` block; `line`: the line the error was recognised by.
    """

    kind: str
    line: str
    requested: Size | None = None
    free: Size | None = None
    reserved: Size | None = None
    reservable: Size | None = None
    largest_free_block: Size | None = None
    limit: Size | None = None
    in_use: Size | None = None
    program: str | None = None
    device: str | None = None
    op: str | None = None
    allocations: tuple[Allocation, ...] = ()
    bins: tuple[Bin, ...] = ()
    stats: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, Size] = field(default_factory=dict)

    @property
    def available(self) -> Size | None:
        """The same figure as `limit`: what the device offered."""
        return self.limit

    def score(self) -> int:
        """How much the text said: figures, rows and names found (picks the most specific)."""
        figures = sum(getattr(self, f) is not None for f in _SIZE_FIELDS)
        return figures + sum(map(bool, (self.allocations, self.bins, self.stats, self.breakdown, self.program)))

    def to_dict(self) -> dict:
        out: dict = {"kind": self.kind, "line": self.line}
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            out[name] = value.to_dict() if value is not None else None
        out.update(program=self.program, device=self.device, op=self.op,
                   allocations=[a.to_dict() for a in self.allocations], bins=[b.to_dict() for b in self.bins],
                   stats=dict(self.stats), breakdown={k: v.to_dict() for k, v in self.breakdown.items()})
        return out


# ---------------------------------------------------------------- reading a log, bounded

_MARKER = re.compile(
    r"RESOURCE_EXHAUSTED|E010[01]: |Attempting to (?:allocate|reserve)|[Rr]an out of memory"
    r"|Out of memory while trying|Out of memory allocating|Failed to allocate request|BufferAssignment|Peak buffers"
    r"|Largest program allocations|Aborting compilation early|Bin \(\d|Stats:|Sum Total of in-use")
# A BFC log lists every chunk between its bins and its statistics: thousands of lines kept by no one.
_NOISE = re.compile(r"(?:InUse|Free) +at [0-9a-fx]+ of size|Chunks of size \d|Next region of size")


# Cheap substring checks first: a chunk of a log holding none of these is skipped whole.
_KEYWORDS = ("RESOURCE_EXHAUSTED", "E010", "Attempting to", "an out of memory", "Out of memory while", "Out of memory allocating",
             "Failed to allocate request", "BufferAssignment", "Peak buffers", "Largest program", "Aborting compilation",
             "Bin (", "Stats:", "Sum Total")


def iter_chunks(stream: BinaryIO, chunk_size: int = 1 << 20) -> Iterator[str]:
    """A binary stream as text chunks of whole lines, read `chunk_size` bytes at a time. A line
    longer than `LINE_CAP` is cut (its rest skipped); bytes that are not UTF-8 are replaced."""
    carry, cut = bytearray(), False
    while data := stream.read(chunk_size):
        first = data.find(b"\n")
        if not cut:
            carry += data[: first if first >= 0 else len(data)][: LINE_CAP + 1 - len(carry)]
            cut = len(carry) > LINE_CAP
        if first < 0:
            continue
        last = data.rfind(b"\n")
        yield (bytes(carry[:LINE_CAP]) + data[first:last]).decode("utf-8", "replace")
        carry = bytearray(data[last + 1:][: LINE_CAP + 1])
        cut = len(carry) > LINE_CAP
    if carry:
        yield carry[:LINE_CAP].decode("utf-8", "replace")


def text_chunks(text: str, chunk_size: int = 1 << 20) -> Iterator[str]:
    """A text as chunks of whole lines of about `chunk_size` characters."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + chunk_size)
        end = len(text) if end < 0 else end
        yield text[start:end]
        start = end + 1


def _unescaped(line: str) -> list[str]:
    """A marker line that holds an escaped message (a JSON string, a repr) as its own lines."""
    if "\\n" not in line:
        return [line]
    return line.replace('\\"', '"').replace("\\t", "\t").split("\\n")


def relevant_lines(chunks: Iterable[str]) -> list[str]:
    """The lines of a log (given as chunks of whole lines) near an error marker: each marker line
    and the `WINDOW` lines after it (a BFC log's chunk listing left out), each cut at `LINE_CAP`
    characters, at most `KEPT_CAP` characters in all. A chunk with no marker keyword is skipped
    without splitting it into lines."""
    kept: list[str] = []
    total, left = 0, 0
    for chunk in chunks:
        if not left and not any(k in chunk for k in _KEYWORDS):
            continue
        for line in chunk.split("\n"):
            line = line[:LINE_CAP]
            if _MARKER.search(line):
                left, parts = WINDOW, _unescaped(line)
            elif left and not _NOISE.search(line):
                left, parts = left - 1, [line]
            else:
                continue
            total += sum(len(p) for p in parts)
            if total > KEPT_CAP:
                return kept
            kept.extend(parts)
    return kept


# ---------------------------------------------------------------- the error lines

def _m(pattern: str) -> re.Pattern:
    return re.compile(pattern.replace("SIZE", f"({SIZE})"))


_TPU_BUFFER = _m(r"Attempting to allocate SIZE\. That was not possible\. There are SIZE free\.(?:; \(([^)\s]{1,200})\))?")
_TPU_PROGRAM = _m(r"Error loading program '([^']{0,500})': Attempting to reserve SIZE at the bottom of memory\. "
                  r"That was not possible\.(?: There are SIZE free, SIZE reserved, and SIZE reservable\.)?")
_TPU_TEMPS = _m(r"total memory required for HLO temporaries \(SIZE\) exceeds available (\w+) \(SIZE\)")
_TPU_REPORT = _m(r"Ran out of memory in memory space (\w+)\. Used SIZE of SIZE \w+\.(?: Exceeded \w+ capacity by SIZE)?")
_TPU_EARLY = _m(r"Aborting compilation early because it's unlikely to have enough memory\. Requires SIZE, has SIZE available")
_GPU_XLA = re.compile(r"Out of memory while trying to allocate (\d+) bytes")
_GPU_REQUEST = _m(r"Failed to allocate request for SIZE \((\d+)B\) on device ordinal (\d+)")
_BFC = _m(r"Allocator \(([^)]{0,100})\) ran out of memory trying to allocate SIZE(?: \(rounded to (\d+)\))?"
          r"(?:\s*requested by op ?(\S{1,500}))?")
_BFC_OLD = _m(r"Ran out of memory trying to allocate SIZE\. +See logs")


def _size(text: str | None) -> Size | None:
    return parse_size_text(text) if text else None


_CPU_ALLOC = re.compile(r"Out of memory allocating ([0-9]+) bytes")


def _hard_header(line: str) -> tuple[str, dict] | None:
    """The error a line states with its figures, if it states one: (kind, fields)."""
    if m := _TPU_BUFFER.search(line):
        return "tpu_buffer", {"requested": _size(m[1]), "free": _size(m[2]), "device": m[3]}
    if m := _TPU_PROGRAM.search(line):
        return "tpu_program_load", {"program": m[1], "requested": _size(m[2]), "free": _size(m[3]),
                                    "reserved": _size(m[4]), "reservable": _size(m[5])}
    if m := _TPU_TEMPS.search(line):
        return "tpu_compile_hbm", {"requested": _size(m[1]), "device": m[2], "limit": _size(m[3])}
    if m := _TPU_REPORT.search(line):
        extra = {"exceeded": _size(m[4])} if m[4] else {}
        return "tpu_compile_hbm", {"device": m[1], "requested": _size(m[2]), "limit": _size(m[3]), "breakdown": extra}
    if m := _TPU_EARLY.search(line):
        return "tpu_compile_hbm", {"requested": _size(m[1]), "limit": _size(m[2])}
    if m := _CPU_ALLOC.search(line):
        return "cpu_alloc", {"requested": _exact(m[1], f"{m[1]} bytes")}
    if m := _GPU_XLA.search(line):
        return "gpu_xla_oom", {"requested": _exact(m[1], f"{m[1]} bytes")}
    if m := _GPU_REQUEST.search(line):
        return "gpu_xla_oom", {"requested": _exact(m[2], m[1]), "device": f"device ordinal {m[3]}"}
    if "not a failure" not in line and (m := _BFC.search(line)):
        requested = _exact(m[3], m[2]) if m[3] else _size(m[2])
        return "gpu_bfc", {"device": m[1], "requested": requested, "op": m[4] or None}
    if m := _BFC_OLD.search(line):
        return "gpu_bfc", {"requested": _size(m[1])}
    return None


_SOFT = (("tpu_buffer", re.compile(r"E0100: |RuntimeBufferAllocationFailure")),
         ("tpu_program_load", re.compile(r"E0101: |RuntimeProgramAllocationFailure")),
         ("tpu_compile_hbm", re.compile(r"Largest program allocations in|Program hbm requirement")),
         ("gpu_xla_oom", re.compile(r"BufferAssignment (?:OOM Debugging|stats:)|Peak buffers:")),
         ("gpu_bfc", re.compile(r"Bin \(\d+\):|Sum Total of in-use chunks|^\s*Stats:\s*$|\] Stats:\s*$")))


def _soft_header(line: str) -> str | None:
    """The kind of error a line belongs to without stating its figures (E0100, "Bin (256):")."""
    for kind, pattern in _SOFT:
        if pattern.search(line):
            return kind
    return None


# ---------------------------------------------------------------- the lines after an error

_BREAKDOWN_TPU = _m(r"(?:^|\s)(reserved|program|arguments|global|scoped|HLO temp) {2,}SIZE(?:\s|$)")
_SECTION_TPU = _m(r"(Total \w+ usage|Program \w+ requirement) >?=? ?SIZE:")
_BREAKDOWN_GPU = _m(r"((?:[a-z_]+ ){0,3}(?:allocation|fragmentation)): +SIZE")
_ENTRY_TPU = _m(r"(?:^|\s)(\d+)\. +Size: SIZE")
_ENTRY_GPU = re.compile(r"\bBuffer (\d+):\s*$")
_FIELDS = (("size", _m(r"\bSize: SIZE")), ("shape", re.compile(r"\bShape: (\S{1,500})")),
           ("param", re.compile(r"Entry Parameter Subshape: (\S{1,500})")),
           ("label", re.compile(r"XLA [Ll]abel: (.{1,300})")), ("allocation_type", re.compile(r"Allocation type: (.{1,100})")),
           ("unpadded", _m(r"Unpadded size: SIZE")), ("operator", re.compile(r"Operator: (.*)")))
_OP = {key: re.compile(key + r'="([^"]{0,2000})"') for key in ("op_name", "op_type", "source_file")}
_OP_LINE = re.compile(r"source_line=(\d+)")
_BIN = _m(r"Bin \((\d+)\):\s*Total Chunks: (\d+), Chunks in use: (\d+)\.? SIZE allocated for chunks\."
          r"(?: SIZE client-requested for chunks\.)? SIZE in use in bin\.(?: SIZE client-requested in use in bin)?")
_SUM = _m(r"Sum Total of in-use chunks: SIZE")
_STAT = re.compile(r"\b(Limit|InUse|MaxInUse|NumAllocs|MaxAllocSize|Reserved|PeakReserved|LargestFreeBlock): +(\d+)\s*$")
_STAT_FIELDS = {"Limit": "limit", "InUse": "in_use", "Reserved": "reserved", "LargestFreeBlock": "largest_free_block"}


def _operator(text: str) -> dict:
    """op_name, op_type and source ("file:line") of an `Operator:` line."""
    found = {key: (m[1] if (m := pattern.search(text)) else None) for key, pattern in _OP.items()}
    line = _OP_LINE.search(text)
    source = found.pop("source_file")
    found["source"] = f"{source}:{line[1]}" if source and line else source
    return found


def _allocation_line(rec: dict, line: str) -> bool:
    """A line of a largest-allocations or peak-buffers entry: a new entry or one of its fields."""
    rows = rec["allocations"]
    if (m := _ENTRY_TPU.search(line)) or (m := _ENTRY_GPU.search(line)):
        if len(rows) < MAX_ROWS:
            rows.append({"rank": int(m[1]), "size": _size(m[2]) if m.re is _ENTRY_TPU else None})
        return True
    if not rows:
        return False
    row = rows[-1]
    for key, pattern in _FIELDS:
        if (m := pattern.search(line)) is None:
            continue
        if key == "operator":
            row.update({k: v for k, v in _operator(m[1]).items() if v})
        elif key == "param":
            row.update(shape=m[1], allocation_type="parameter")
        elif key in ("size", "unpadded"):
            row.setdefault(key, None)
            row[key] = row[key] or _size(m[1])
        else:
            row[key] = m[1].strip()
        return True
    return False


def _tpu_line(rec: dict, line: str) -> None:
    if m := _SECTION_TPU.search(line):
        rec["section"] = "usage" if m[1].startswith("Total") else "program"
        rec["breakdown"][rec["section"] + ".total"] = _size(m[2])
    elif not _allocation_line(rec, line) and (m := _BREAKDOWN_TPU.search(line)):
        rec["breakdown"][f"{rec.get('section', 'usage')}.{m[1]}"] = _size(m[2])


def _gpu_line(rec: dict, line: str) -> None:
    if not _allocation_line(rec, line) and (m := _BREAKDOWN_GPU.search(line)):
        rec["breakdown"][m[1].strip()] = _size(m[2])


def _bfc_line(rec: dict, line: str) -> None:
    if m := _BIN.search(line):
        if len(rec["bins"]) < MAX_ROWS:
            rec["bins"].append(Bin(int(m[1]), int(m[2]), int(m[3]), _size(m[4]), _size(m[6]), _size(m[7])))
    elif m := _SUM.search(line):
        rec["sum_in_use"] = _size(m[1])
    elif m := _STAT.search(line):
        rec["stats"][m[1]] = int(m[2])
        if m[1] in _STAT_FIELDS:
            rec[_STAT_FIELDS[m[1]]] = _exact(m[2])


_DETAIL = {"tpu_compile_hbm": _tpu_line, "gpu_xla_oom": _gpu_line, "gpu_bfc": _bfc_line}


# ---------------------------------------------------------------- records

def _new(kind: str, line: str, fields: dict) -> dict:
    rec: dict = {"kind": kind, "line": line.strip()[:2000], "allocations": [], "bins": [], "stats": {},
                 "breakdown": {}, "hard": False}
    _merge(rec, fields)
    return rec


def _merge(rec: dict, fields: dict) -> None:
    for key, value in fields.items():
        if key == "breakdown":
            rec["breakdown"].update(value)
        elif value is not None:
            rec[key] = value


def _freeze(rec: dict) -> OomText:
    """The record as an `OomText`; BFC's in-use sum stands in where no `Stats:` block gave it."""
    if rec.get("in_use") is None and rec.get("sum_in_use") is not None:
        rec["in_use"] = rec["sum_in_use"]
    rows = tuple(Allocation(**row) for row in rec["allocations"])
    program = rec.get("program") or _program_of(rows)
    names = set(OomText.__dataclass_fields__) - {"allocations", "bins", "program"}
    return OomText(**{k: rec[k] for k in names if k in rec}, allocations=rows, bins=tuple(rec["bins"]),
                   program=program)


_PROGRAM = re.compile(r"^((?:jit|pmap|pjit|xmap|parallelize)\([^()/]{1,200}\))")


def _program_of(rows: tuple[Allocation, ...]) -> str | None:
    """The jitted function an XLA op name starts with ('jit(train_step)'), if any row names one."""
    for row in rows:
        if row.op_name and (m := _PROGRAM.match(row.op_name)):
            return m[1]
    return None


def _step(found: list[OomText], rec: dict | None, line: str) -> dict | None:
    """Read one line: it starts an error, adds its figures to the one open, or is a detail of it."""
    if (hard := _hard_header(line)) is not None:
        kind, fields = hard
        if rec is not None and rec["kind"] == kind and not rec["hard"]:
            _merge(rec, fields)      # E0100's first line, then its figures
            rec["line"] = line.strip()[:2000]
        else:
            if rec is not None:
                found.append(_freeze(rec))
            rec = _new(kind, line, fields)
        rec["hard"] = True
        return rec
    soft = _soft_header(line)
    if soft is not None and (rec is None or rec["kind"] != soft):
        if rec is not None:
            found.append(_freeze(rec))
        rec = _new(soft, line, {})
    if rec is not None and rec["kind"] in _DETAIL:
        _DETAIL[rec["kind"]](rec, line)
    return rec


def parse_lines(lines: Iterable[str]) -> list[OomText]:
    """Every out-of-memory error in a log's relevant lines, in order."""
    found: list[OomText] = []
    rec = None
    for line in lines:
        rec = _step(found, rec, line)
    if rec is not None:
        found.append(_freeze(rec))
    return found


def parse_all(text: str) -> list[OomText]:
    """Every out-of-memory error in a text, in the order they appear (a traceback often repeats
    one: each repetition is one entry).

    >>> [o.kind for o in parse_all("Out of memory while trying to allocate 512 bytes.\\nno error here")]
    ['gpu_xla_oom']
    """
    return parse_lines(relevant_lines(text_chunks(text)))


def pick(found: list[OomText]) -> OomText | None:
    """The most specific error of several (most figures and rows); the first among equals."""
    best = None
    for oom in found:
        if best is None or oom.score() > best.score():
            best = oom
    return best


def parse_oom(text: str) -> OomText | None:
    """The most specific out-of-memory error in a text (see `pick`), or None if it holds none."""
    return pick(parse_all(text))


def parse_stream(stream: BinaryIO) -> list[OomText]:
    """Every out-of-memory error in a binary stream (a log file, stdin), read a chunk at a time
    with bounded memory."""
    return parse_lines(relevant_lines(iter_chunks(stream)))
