"""One plain-data schema for allocation traces: every reader produces it, every consumer reads it.

A `Trace` is an ordered list of `Event`s plus the allocator state at the start of the recorded
window (blocks and segments that existed before it), plus whatever the recorder said about
itself (its allocator settings, device capacity). Frames are innermost first.

Actions:
  "alloc"          a block handed to the user (addr, size; requested size in `requested`)
  "free"           a block returned by the user (addr, size)
  "segment_alloc"  the recorded allocator took memory from the device (cudaMalloc)
  "segment_free"   it gave memory back (cudaFree)
  "oom"            the recorded allocator ran out of memory (size = request)
Replays drive allocators with "alloc" and "free" only; segment events are the recorded
allocator's own decisions, kept to compare a model against.

The on-disk jaxmem format is JSON lines: a header object {"format": "jaxmem-trace", "version": 1,
...Trace fields but events...} then one object per event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACTIONS = ("alloc", "free", "segment_alloc", "segment_free", "oom")


@dataclass(frozen=True, slots=True)
class Frame:
    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line} ({self.name})"


@dataclass(slots=True)
class Event:
    action: str                    # one of ACTIONS
    addr: int
    size: int                      # bytes as the recorded allocator reserved them (rounded)
    stream: int = 0
    time_us: float = 0.0
    requested: int | None = None   # the user's requested size, when the recorder knows it
    frames: tuple[Frame, ...] = ()
    label: str = ""                # e.g. the producing primitive for jaxmem eager traces


@dataclass(slots=True)
class Block:
    """A block live in the recorded allocator at the start of the window."""

    addr: int
    size: int
    requested: int | None = None
    stream: int = 0
    allocated: bool = True         # False: a cached free block inside a segment


@dataclass(slots=True)
class Segment:
    """A device allocation held by the recorded allocator at the start of the window."""

    addr: int
    size: int
    stream: int = 0
    pool: str = "large"            # "small" | "large" (PyTorch's two pools)
    blocks: list[Block] = field(default_factory=list)
    expandable: bool = False


@dataclass
class Trace:
    events: list[Event]
    source: str = ""               # file it came from
    format: str = ""               # "torch-snapshot" | "chrome" | "rmm-csv" | "jaxmem"
    initial_segments: list[Segment] = field(default_factory=list)
    initial_blocks: list[Block] = field(default_factory=list)  # live blocks allocated before the window
    allocator_settings: dict[str, Any] = field(default_factory=dict)
    device_capacity: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
