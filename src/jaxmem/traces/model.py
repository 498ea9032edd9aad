"""The trace schema, where the readers, replay and users import it from, and the one way the
text readers read a file.

It lives on the ground floor (`jaxmem.trace_schema`), beside `units` and `errors`, so that the
runtime's recorder and the executor build traces without importing this package.
"""

from __future__ import annotations

from pathlib import Path

from jaxmem.errors import TraceError
from jaxmem.trace_schema import ACTIONS, Block, Event, Frame, Segment, Trace

__all__ = ["ACTIONS", "Block", "Event", "Frame", "Segment", "Trace", "read_trace_text"]


def read_trace_text(path: str | Path) -> str:
    """A trace file's text (UTF-8); one `TraceError` line where it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot read ({err})") from None
