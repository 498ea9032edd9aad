"""The pprof profile read back by protobuf itself, with pprof's profile.proto schema.

There is no protoc here, so the schema of google/pprof's proto/profile.proto (package
perftools.profiles) is transcribed below field by field and compiled into a descriptor at test
time; protobuf's own parser then reads the file. The same reader also reads the profile JAX's
`jax.profiler.device_memory_profile()` writes, which checks the transcription.
"""

from __future__ import annotations

import gzip

import jax
import jax.numpy as jnp
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from jaxmem.compiler.planner import plan as jaxmem_plan
from jaxmem.reports.data import from_plan
from jaxmem.reports.pprof import profile_bytes, write_pprof
from reports_fixtures import naive_plan, train_step_example

F = descriptor_pb2.FieldDescriptorProto
I64, U64, STR, BOOL, MSG = F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_STRING, F.TYPE_BOOL, F.TYPE_MESSAGE
REP, OPT = F.LABEL_REPEATED, F.LABEL_OPTIONAL

# pprof's profile.proto, message by message: (field name, number, type, label, message type).
SCHEMA = {
    "Profile": [("sample_type", 1, MSG, REP, "ValueType"), ("sample", 2, MSG, REP, "Sample"),
                ("mapping", 3, MSG, REP, "Mapping"), ("location", 4, MSG, REP, "Location"),
                ("function", 5, MSG, REP, "Function"), ("string_table", 6, STR, REP, None),
                ("drop_frames", 7, I64, OPT, None), ("keep_frames", 8, I64, OPT, None),
                ("time_nanos", 9, I64, OPT, None), ("duration_nanos", 10, I64, OPT, None),
                ("period_type", 11, MSG, OPT, "ValueType"), ("period", 12, I64, OPT, None),
                ("comment", 13, I64, REP, None), ("default_sample_type", 14, I64, OPT, None)],
    "ValueType": [("type", 1, I64, OPT, None), ("unit", 2, I64, OPT, None)],
    "Sample": [("location_id", 1, U64, REP, None), ("value", 2, I64, REP, None), ("label", 3, MSG, REP, "Label")],
    "Label": [("key", 1, I64, OPT, None), ("str", 2, I64, OPT, None), ("num", 3, I64, OPT, None),
              ("num_unit", 4, I64, OPT, None)],
    "Mapping": [("id", 1, U64, OPT, None), ("memory_start", 2, U64, OPT, None), ("memory_limit", 3, U64, OPT, None),
                ("file_offset", 4, U64, OPT, None), ("filename", 5, I64, OPT, None), ("build_id", 6, I64, OPT, None),
                ("has_functions", 7, BOOL, OPT, None), ("has_filenames", 8, BOOL, OPT, None),
                ("has_line_numbers", 9, BOOL, OPT, None), ("has_inline_frames", 10, BOOL, OPT, None)],
    "Location": [("id", 1, U64, OPT, None), ("mapping_id", 2, U64, OPT, None), ("address", 3, U64, OPT, None),
                 ("line", 4, MSG, REP, "Line"), ("is_folded", 5, BOOL, OPT, None)],
    "Line": [("function_id", 1, U64, OPT, None), ("line", 2, I64, OPT, None)],
    "Function": [("id", 1, U64, OPT, None), ("name", 2, I64, OPT, None), ("system_name", 3, I64, OPT, None),
                 ("filename", 4, I64, OPT, None), ("start_line", 5, I64, OPT, None)],
}


@pytest.fixture(scope="module")
def Profile():
    fd = descriptor_pb2.FileDescriptorProto(name="jaxmem_test_profile.proto", package="perftools.profiles", syntax="proto3")
    for name, fields in SCHEMA.items():
        msg = fd.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = f".perftools.profiles.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("perftools.profiles.Profile"))


def read(Profile, blob: bytes):
    prof = Profile()
    prof.ParseFromString(gzip.decompress(blob))
    return prof


def live_bytes(plan, step: int) -> tuple[int, int]:
    """Bytes and count live at `step`, straight from the plan: buffers whose live range holds
    the step, plus the arguments kept in the caller's memory (live throughout)."""
    arena = [b.size for b in plan.buffers if b.start <= step <= b.end]
    caller = [plan.values[v].nbytes for v in plan.invars if plan.values[v].buffer is None]
    return sum(arena) + sum(caller), len(arena) + len(caller)


def test_reader_reads_jax_own_device_memory_profile(Profile):
    x = jnp.ones((256, 256))
    y = (x @ x).block_until_ready()
    prof = read(Profile, jax.profiler.device_memory_profile())
    types = [(prof.string_table[t.type], prof.string_table[t.unit]) for t in prof.sample_type]
    assert types == [("allocations", "count"), ("space", "bytes")]
    assert sum(s.value[1] for s in prof.sample) >= y.nbytes


def check_profile(Profile, blob, plan, step):
    prof = read(Profile, blob)
    strings = prof.string_table
    assert strings[0] == ""
    assert [(strings[t.type], strings[t.unit]) for t in prof.sample_type] == [("allocations", "count"), ("space", "bytes")]
    total, count = live_bytes(plan, step)
    assert sum(s.value[1] for s in prof.sample) == total
    assert sum(s.value[0] for s in prof.sample) == count
    loc_ids = {loc.id for loc in prof.location}
    fn_ids = {f.id for f in prof.function}
    for s in prof.sample:
        assert s.location_id and all(i in loc_ids for i in s.location_id)
        labels = {strings[lab.key]: (strings[lab.str] if lab.str else lab.num) for lab in s.label}
        assert labels["kind"] == "buffer" and labels["bytes"] == s.value[1]
    for loc in prof.location:
        assert all(line.function_id in fn_ids for line in loc.line)
    return prof


@pytest.mark.parametrize("planner", ["naive", "jaxmem"])
def test_pprof_totals_equal_bytes_live_at_the_peak_and_at_other_steps(Profile, planner):
    fn, args = train_step_example()
    plan = naive_plan(fn, *args) if planner == "naive" else jaxmem_plan(fn, *args, xla=False)
    data = from_plan(plan)
    steps = {data.peak_x, -1, 0, len(plan.schedule) // 3, len(plan.schedule) - 1, len(plan.schedule)}
    for step in sorted(steps):
        check_profile(Profile, profile_bytes(data.live_at(step)), plan, step)


def test_pprof_has_user_frames_as_locations(Profile, tmp_path):
    fn, args = train_step_example()
    plan = jaxmem_plan(fn, *args, xla=False)
    data = from_plan(plan)
    path = tmp_path / "profile.pb.gz"
    write_pprof(path, data.live_at(data.peak_x))
    prof = check_profile(Profile, path.read_bytes(), plan, data.peak_x)
    files = {prof.string_table[f.filename] for f in prof.function}
    names = {prof.string_table[f.name] for f in prof.function}
    assert any(name.endswith("reports_fixtures.py") for name in files)
    assert "loss" in names or "step" in names
    # Frames are the user's only: nothing from inside JAX.
    assert not any("/jax/_src/" in name for name in files)


def _trace_live(trace, x):
    live = {b.addr: b.size for b in trace.initial_blocks if b.allocated}
    for e in trace.events[: x + 1]:
        if e.action == "alloc":
            live[e.addr] = e.size
        elif e.action == "free":
            live.pop(e.addr, None)
    return sum(live.values()), len(live)


def _traces():
    from pathlib import Path

    from jaxmem.traces.model import Event, Frame, Trace

    events, addrs = [], []
    for i in range(400):
        if addrs and i % 3 == 0:
            a, s = addrs.pop(len(addrs) // 2)
            events.append(Event("free", a, s))
        else:
            a, s = (1 << 40) + i * (1 << 22), (1 + i % 11) * 512
            addrs.append((a, s))
            events.append(Event("alloc", a, s, frames=(Frame("??", 0, "c10::alloc"), Frame("/w/m.py", 7 + i % 5, "fwd"))))
    found = [Trace(events, source="synthetic", format="jaxmem")]
    shared = Path(__file__).resolve().parents[3] / "shared" / "traces"
    for path in sorted(shared.glob("*.pickle"))[:1]:
        from jaxmem.traces.readers import load_trace

        found.append(load_trace(str(path)))
    return found


def test_replay_pprof_totals_equal_recorded_live_bytes(Profile):
    from jaxmem.reports.data import from_replay
    from jaxmem.traces.replay import replay

    for trace in _traces():
        report = replay(trace, ["platform"], capacity=1 << 42, progress=False)
        data = from_replay(report, trace)
        n = len(trace.events)
        for x in sorted({data.peak_x, 0, n // 2, n - 1}):
            prof = read(Profile, profile_bytes(data.live_at(x)))
            assert (sum(s.value[1] for s in prof.sample), sum(s.value[0] for s in prof.sample)) == _trace_live(trace, x)
        if trace.source == "synthetic":
            names = {prof.string_table[f.name] for f in prof.function}
            # The C++ frame ('??:0') is dropped when Python frames are there.
            assert "fwd" in names and "c10::alloc" not in names


from hypothesis import given, settings, strategies as st

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_frames = st.lists(st.tuples(_text, st.integers(0, 10**6), _text), max_size=5).map(tuple)


def _block(size, frames, category, label):
    from jaxmem.reports.data import Block

    return Block(0, size, 0, 0, category, label, (2, 3), "float32", frames)


_blocks = st.lists(st.builds(_block, st.integers(1, 2**50), _frames, _text, _text), max_size=20)


@settings(max_examples=60, deadline=None)
@given(_blocks)
def test_every_sample_decodes_to_its_block(blocks):
    # Built here, not from the fixture: hypothesis does not mix with function-scoped fixtures.
    fd = descriptor_pb2.FileDescriptorProto(name="jaxmem_test_profile2.proto", package="perftools.profiles", syntax="proto3")
    for name, fields in SCHEMA.items():
        msg = fd.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = f".perftools.profiles.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    prof = read(message_factory.GetMessageClass(pool.FindMessageTypeByName("perftools.profiles.Profile")),
                profile_bytes(blocks, device="dev:0"))
    strings = prof.string_table
    locations = {loc.id: loc for loc in prof.location}
    functions = {f.id: f for f in prof.function}
    assert len(prof.sample) == len(blocks)
    for sample, block in zip(prof.sample, blocks):
        assert list(sample.value) == [1, block.size]
        stack = []
        for lid in sample.location_id:
            (line,) = locations[lid].line
            fn = functions[line.function_id]
            stack.append((strings[fn.filename], line.line, strings[fn.name]))
        assert tuple(stack) == (block.frames or (("<no source>", 0, block.label or "<unknown source>"),))
        # proto3 cannot tell str=0 (the empty string) from no str: read by key.
        labels = {strings[lab.key]: (lab.num if strings[lab.key] == "bytes" else strings[lab.str]) for lab in sample.label}
        assert labels["bytes"] == block.size
        assert labels["category"] == block.category and labels["device"] == "dev:0"
        assert labels.get("op", "") == block.label
