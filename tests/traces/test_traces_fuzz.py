"""Any input gives a Trace or a one-line TraceError: never another exception, never a traceback."""

from __future__ import annotations

import json
import pickle

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmem.errors import TraceError
from jaxmem.traces.model import ACTIONS as ACTION_NAMES
from jaxmem.traces.readers import parse_trace
from jaxmem.traces.torch_snapshot import snapshot_to_trace

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True),
                    st.text(max_size=6))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)
ACTIONS = st.sampled_from(["alloc", "free_requested", "free_completed", "free", "segment_alloc", "segment_free",
                           "segment_map", "segment_unmap", "oom", "snapshot", "bogus"])
EVENT = st.fixed_dictionaries({"action": ACTIONS}, optional={
    "addr": st.one_of(st.integers(0, 1 << 20), VALUES), "size": st.one_of(st.integers(-4, 1 << 24), VALUES),
    "stream": st.one_of(st.integers(0, 3), VALUES), "time_us": st.one_of(st.floats(0, 1e9), VALUES),
    "frames": st.one_of(st.lists(st.fixed_dictionaries({"filename": st.text(max_size=4), "line": st.integers(0, 9),
                                                        "name": st.text(max_size=4)}), max_size=2), VALUES)})
BLOCK = st.fixed_dictionaries({"size": st.one_of(st.integers(0, 1 << 22), VALUES),
                               "state": st.sampled_from(["active_allocated", "inactive", "active_pending_free", "x"])},
                              optional={"address": st.one_of(st.integers(0, 1 << 22), VALUES)})
SEGMENT = st.fixed_dictionaries({"address": st.one_of(st.integers(0, 1 << 22), VALUES),
                                 "total_size": st.one_of(st.integers(-1, 1 << 22), VALUES)},
                                optional={"blocks": st.one_of(st.lists(BLOCK, max_size=3), VALUES),
                                          "segment_type": st.sampled_from(["small", "large"]), "device": st.integers(0, 1)})
SNAPSHOT = st.fixed_dictionaries({"segments": st.one_of(st.lists(SEGMENT, max_size=3), VALUES),
                                  "device_traces": st.one_of(st.lists(st.lists(EVENT, max_size=8), max_size=2), VALUES)},
                                 optional={"allocator_settings": st.one_of(VALUES, st.just({"max_split_size": -1}))})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=SNAPSHOT)
def test_any_snapshot_shape_reads_or_fails_cleanly(snap) -> None:
    try:
        trace = snapshot_to_trace(snap, "fuzz.pickle")
    except TraceError as err:
        assert "\n" not in str(err) and str(err).startswith("fuzz.pickle")
    else:
        assert all(e.size >= 0 and e.action in ACTION_NAMES for e in trace.events)


def test_chrome_infinite_numbers_fail_cleanly() -> None:
    from jaxmem.traces.chrome import chrome_to_trace

    bad = [{"name": "[memory]", "ts": 1, "args": {"Addr": float("inf"), "Bytes": 4}}]
    try:
        chrome_to_trace(bad, "c.json")
    except TraceError as err:
        assert "Addr" in str(err)
    else:
        raise AssertionError("an infinite address was accepted")


@settings(max_examples=200, deadline=None)
@given(data=st.one_of(st.binary(max_size=200), VALUES.map(lambda v: json.dumps(v).encode()),
                      VALUES.map(lambda v: pickle.dumps(v)),
                      st.text(max_size=200).map(lambda t: ("Thread,Time,Action,Pointer,Size,Stream\n" + t).encode())))
def test_any_bytes_read_or_fail_cleanly(data: bytes) -> None:
    try:
        trace = parse_trace(data, "fuzz.bin")
    except TraceError as err:
        assert "\n" not in str(err) and str(err).startswith("fuzz.bin")
    else:
        assert all(e.size >= 0 and e.action in ACTION_NAMES for e in trace.events)
