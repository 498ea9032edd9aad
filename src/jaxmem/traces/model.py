"""The trace schema, where the readers, replay and users import it from.

It lives on the ground floor (`jaxmem.trace_schema`), beside `units` and `errors`, so that the
runtime's recorder and the executor build traces without importing this package.
"""

from jaxmem.trace_schema import ACTIONS, Block, Event, Frame, Segment, Trace

__all__ = ["ACTIONS", "Block", "Event", "Frame", "Segment", "Trace"]
