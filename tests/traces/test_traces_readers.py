"""Trace readers and writers: round trips, format sniffing, and bad input (one-line errors).

The hostile-pickle tests build pickles that would run a shell command if loaded plainly (the
command writes a marker file) and prove the marker never appears, both through the library
and through the `jaxmem replay` command line.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.errors import TraceError
from jaxmem.traces.chrome import chrome_to_trace
from jaxmem.traces.jaxmem_format import parse_jaxmem_trace, trace_lines, write_jaxmem_trace
from jaxmem.traces.model import Block, Event, Frame, Segment, Trace
from jaxmem.traces.readers import load_trace, sniff_format
from jaxmem.traces.rmm_csv import parse_rmm_csv, rmm_csv_text, write_rmm_csv
from jaxmem.traces.safe_pickle import loads_plain

REAL = Path(__file__).resolve().parents[3] / "shared" / "traces" / "torch-transformer-ctx128-forward.pickle"
JAXMEM = [sys.executable, "-m", "jaxmem.cli.main"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from jaxmem.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


# ---- hostile pickles ---------------------------------------------------------------------------
class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_hostile_pickle_runs_nothing(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 512, "x": _RunsCode(marker)}]]}
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(payload, protocol=protocol))
    # the payload is real: a plain load would run the command
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_RunsCode(probe), protocol=protocol))
    assert probe.exists()

    with pytest.raises(TraceError, match="refuses to load global"):
        load_trace(path)
    assert not marker.exists()

    result = run_cli("replay", str(path))
    assert result.returncode == 2
    assert not marker.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in result.stderr


def test_pickle_of_any_global_is_refused(tmp_path: Path) -> None:
    for obj in (Path("/tmp"), {"k": Frame("a", 1, "b")}, eval):
        with pytest.raises(TraceError):
            loads_plain(pickle.dumps(obj))


def test_truncated_and_corrupt_snapshots(tmp_path: Path) -> None:
    data = REAL.read_bytes()
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="truncated"):
        load_trace(cut)
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"\x80\x04" + bytes(range(256)) * 4)
    with pytest.raises(TraceError, match="junk.pickle"):
        load_trace(junk)
    result = run_cli("replay", str(cut))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "cut.pickle" in result.stderr


def test_snapshot_shapes_that_are_not_snapshots(tmp_path: Path) -> None:
    for obj, match in (([1, 2], "not a PyTorch memory snapshot"),
                       ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": -5}]]}, "event 0.*negative size"),
                       ({"segments": [], "device_traces": [[{"action": "free_completed", "addr": 99, "size": 512}]]},
                        "event 0.*free of unknown address")):
        p = tmp_path / "x.pickle"
        p.write_bytes(pickle.dumps(obj))
        with pytest.raises(TraceError, match=match):
            load_trace(p)


# ---- jaxmem format ---------------------------------------------------------------------------------
FRAMES = st.lists(st.builds(Frame, st.text(max_size=8), st.integers(0, 10_000), st.text(max_size=8)), max_size=3).map(tuple)


@st.composite
def traces(draw) -> Trace:
    n = draw(st.integers(0, 40))
    events, live, t = [], [], 0.0
    for _ in range(n):
        t += draw(st.floats(0, 1000, allow_nan=False))
        t = round(t, 3)
        if live and draw(st.booleans()):
            addr, size = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append(Event("free", addr, size, 0, t, None, draw(FRAMES)))
        else:
            addr = draw(st.integers(0, 1 << 48))
            if any(a == addr for a, _ in live):
                continue
            req = draw(st.integers(1, 1 << 34))
            size = -(-req // 512) * 512
            live.append((addr, size))
            events.append(Event("alloc", addr, size, draw(st.integers(0, 3)), t, req, draw(FRAMES), draw(st.text(max_size=6))))
    segs = [Segment(1 << 40, 4096, 0, "small", [Block(1 << 40, 1024, 1000, 0, True), Block((1 << 40) + 1024, 3072, None, 0, False)])]
    return Trace(events, "gen", "jaxmem", segs, [segs[0].blocks[0]], {"max_split_size": -1}, 1 << 30, {"k": [1, "x"]})


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_jaxmem_format_round_trip(trace: Trace) -> None:
    back = parse_jaxmem_trace("\n".join(trace_lines(trace)), "mem")
    assert back.events == trace.events
    assert back.initial_segments == trace.initial_segments and back.initial_blocks == trace.initial_blocks
    assert (back.allocator_settings, back.device_capacity, back.meta, back.format, back.source) == \
        (trace.allocator_settings, trace.device_capacity, trace.meta, trace.format, trace.source)


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_rmm_csv_round_trip(trace: Trace) -> None:
    back = parse_rmm_csv(rmm_csv_text(trace), "rmm")
    want = [(e.action, e.addr, e.requested if e.requested is not None else e.size, e.stream,
             round(e.time_us) % 86_400_000_000) for e in trace.events]
    got = [(e.action, e.addr, e.size, e.stream, round(e.time_us)) for e in back.events]
    assert got == [(a, addr, (size if a == "alloc" else got_size), s, t)
                   for (a, addr, size, s, t), (_, _, got_size, _, _) in zip(want, got)]
    # a free's size is what the writer wrote for it: the recorded request, else the block size
    assert [e.size for e in back.events if e.action == "free"] == \
        [e.requested if e.requested is not None else e.size for e in trace.events if e.action == "free"]


def test_writers_write_files_load_trace_reads(tmp_path: Path) -> None:
    t = Trace([Event("alloc", 4096, 1024, 0, 5.0, 1000), Event("free", 4096, 1024, 0, 9.0, 1000)], "t", "jaxmem")
    write_jaxmem_trace(t, tmp_path / "a.jsonl")
    write_rmm_csv(t, tmp_path / "a.csv")
    assert load_trace(tmp_path / "a.jsonl").events == t.events
    assert [e.action for e in load_trace(tmp_path / "a.csv").events] == ["alloc", "free"]
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "a.jsonl").read_bytes()))
    assert load_trace(gz).events == t.events
    assert load_trace(tmp_path / "a.csv", format="rmm").format == "rmm-csv"


def test_snapshot_through_jaxmem_format_replays_the_same(tmp_path: Path) -> None:
    from jaxmem.traces.replay import replay

    t = load_trace(REAL)
    write_jaxmem_trace(t, tmp_path / "s.jsonl")
    back = load_trace(tmp_path / "s.jsonl")
    a = replay(t, ["caching", "bfc"], capacity=80 << 30, progress=False)
    b = replay(back, ["caching", "bfc"], capacity=80 << 30, progress=False)
    assert a.to_json()["allocators"] == b.to_json()["allocators"] and a.recorded == b.recorded


def test_jaxmem_format_bad_lines(tmp_path: Path) -> None:
    good = list(trace_lines(Trace([Event("alloc", 1, 512, 0, 0.0, 100), Event("free", 1, 512)], "t")))
    with pytest.raises(TraceError, match=r"event 1 \(line 3\): corrupt or truncated"):
        parse_jaxmem_trace("\n".join(good[:2] + [good[2][:10]]), "t")
    neg = json.dumps({"action": "alloc", "addr": 1, "size": -4})
    with pytest.raises(TraceError, match=r"event 0 .*negative size"):
        parse_jaxmem_trace("\n".join([good[0], neg]), "t")
    with pytest.raises(TraceError, match="unknown action"):
        parse_jaxmem_trace("\n".join([good[0], json.dumps({"action": "boom", "addr": 1, "size": 4})]), "t")
    with pytest.raises(TraceError, match="not a jaxmem trace"):
        parse_jaxmem_trace('{"format": "other"}', "t")


# ---- RMM CSV ---------------------------------------------------------------------------------------
def test_rmm_log_as_rmm_writes_it() -> None:
    text = ("Thread,Time,Action,Pointer,Size,Stream\n"
            "140,08:01:50.505213,allocate,0x7f0000000000,1000,0x0\n"
            "140,08:01:50.505300,allocate failure,0x0,99999999999,0x0\n"
            "140,08:01:50:505400,free,0x7f0000000000,1000,0x0\n")
    t = parse_rmm_csv(text, "log.csv")
    assert [(e.action, e.addr, e.size) for e in t.events] == [("alloc", 0x7F0000000000, 1000), ("oom", 0, 99999999999),
                                                              ("free", 0x7F0000000000, 1000)]
    assert t.events[0].time_us == pytest.approx((8 * 3600 + 60 + 50.505213) * 1e6)
    assert t.events[2].time_us == pytest.approx((8 * 3600 + 60 + 50.5054) * 1e6)
    with pytest.raises(TraceError, match=r"event 0 \(line 2\): free of unknown address"):
        parse_rmm_csv("Thread,Time,Action,Pointer,Size,Stream\n1,0.5,free,0x10,8,0x0\n", "log.csv")
    with pytest.raises(TraceError, match="negative size"):
        parse_rmm_csv("Thread,Time,Action,Pointer,Size,Stream\n1,0.5,allocate,0x10,-8,0x0\n", "log.csv")
    with pytest.raises(TraceError, match="truncated row"):
        parse_rmm_csv("Thread,Time,Action,Pointer,Size,Stream\n1,0.5,allocate\n", "log.csv")


# ---- Chrome traces -------------------------------------------------------------------------------
def _mem(ts: float, addr: int, nbytes: int, reserved: int, dev_type: int = 1) -> dict:
    return {"ph": "i", "name": "[memory]", "ts": ts, "pid": 1, "tid": 1, "s": "t",
            "args": {"Addr": addr, "Bytes": nbytes, "Total Allocated": 0, "Total Reserved": reserved,
                     "Device Type": dev_type, "Device Id": 0}}


def test_chrome_trace_memory_events(tmp_path: Path) -> None:
    events = [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 5},
              _mem(1, 100, 512, 2 << 20), _mem(2, 999, 64, 0, dev_type=0),
              _mem(3, 200, 20 << 20, 22 << 20), _mem(4, 100, -512, 22 << 20),
              _mem(5, 50, -1024, 22 << 20), _mem(6, 200, -(20 << 20), 2 << 20)]
    t = chrome_to_trace({"traceEvents": events}, "trace.json")
    assert [e.action for e in t.events] == ["alloc", "segment_alloc", "alloc", "free", "free", "segment_free", "free"]
    assert [b.addr for b in t.initial_blocks] == [50]            # freed, never allocated: live before
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert sniff_format(path.read_bytes()) == "chrome" and load_trace(path).format == "chrome"
    path.write_text(json.dumps({"traceEvents": events})[:-40])
    with pytest.raises(TraceError, match="corrupt or truncated JSON"):
        load_trace(path)
    with pytest.raises(TraceError, match=r"event 1 \(\[memory\]\): 'Addr'"):
        chrome_to_trace([events[0], {"name": "[memory]", "args": {"Bytes": 4}}], "t.json")


def test_unknown_and_empty_files(tmp_path: Path) -> None:
    (tmp_path / "e").write_bytes(b"")
    (tmp_path / "u").write_bytes(b"hello world")
    for name, match in (("e", "empty file"), ("u", "unknown trace format"), ("missing", "cannot read")):
        with pytest.raises(TraceError, match=match):
            load_trace(tmp_path / name)
