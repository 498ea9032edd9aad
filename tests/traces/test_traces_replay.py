"""Replay engine and `jaxmem replay`: figures checked against brute force over the event stream."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmem.errors import ConfigError, TraceError
from jaxmem.traces.jaxmem_format import write_jaxmem_trace
from jaxmem.traces.model import Block, Event, Trace
from jaxmem.traces.replay import ALLOCATORS, TIMELINE_POINTS, replay, replay_one

REAL = Path(__file__).resolve().parents[3] / "shared" / "traces" / "torch-transformer-ctx128-fullstep.pickle"
MiB, GiB = 1 << 20, 1 << 30


def random_trace(n: int, seed: int, max_size: int = 64 * MiB) -> Trace:
    """Recorded addresses are random and reused after a free, unlike any allocator's."""
    rng = random.Random(seed)
    events, live = [], {}
    for i in range(n):
        if live and rng.random() < 0.45:
            addr = rng.choice(sorted(live))
            events.append(Event("free", addr, live.pop(addr), 0, float(i)))
        else:
            addr = rng.randrange(1, 64) * 4096
            while addr in live:
                addr = rng.randrange(1, 1 << 20) * 4096
            size = rng.randint(1, max_size)
            live[addr] = size
            events.append(Event("alloc", addr, size, 0, float(i), size))
    return Trace(events, f"random-{seed}", "jaxmem")


def brute_force_live(trace: Trace) -> list[int]:
    live, out = {}, []
    for e in trace.events:
        if e.action == "alloc":
            live[e.addr] = e.requested
        elif e.action == "free":
            del live[e.addr]
        out.append(sum(live.values()))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_platform_in_use_is_the_live_sum(seed: int) -> None:
    trace = random_trace(3000, seed)
    run = replay(trace, ["platform"], capacity=80 * GiB, progress=False).runs["platform"]
    curve = brute_force_live(trace)
    assert run.peak_in_use_bytes == max(curve) == run.peak_reserved_bytes
    assert run.device_allocs == sum(e.action == "alloc" for e in trace.events)
    assert [p[2] for p in run.timeline] == [curve[p[0]] for p in run.timeline]


@pytest.mark.parametrize("name", ALLOCATORS)
def test_every_allocator_replays_and_timeline_keeps_extremes(name: str) -> None:
    trace = random_trace(12000, 7)
    run = replay_one(trace, name, capacity=80 * GiB)
    assert run.oom is None and run.events_replayed == len(trace.events)
    assert len(run.timeline) <= TIMELINE_POINTS + 2
    assert max(p[2] for p in run.timeline) == run.peak_in_use_bytes
    assert max(p[3] for p in run.timeline) == run.peak_reserved_bytes
    assert run.peak_in_use_bytes >= max(brute_force_live(trace))   # blocks are at least the request
    assert run.peak_reserved_bytes >= run.peak_in_use_bytes
    assert 0.0 <= run.xla_fragmentation <= 1.0 and run.reserved_over_in_use >= 1.0


def test_first_oom_matches_brute_force_and_names_what_was_live() -> None:
    trace = random_trace(4000, 3)
    capacity = 2 * GiB
    curve = brute_force_live(trace)
    first = next(i for i, v in enumerate(curve) if v > capacity)
    oom = replay(trace, ["platform"], capacity=capacity, progress=False).runs["platform"].oom
    assert oom is not None and oom["event_index"] == first
    assert oom["request"] == trace.events[first].requested
    assert oom["live_bytes"] == curve[first - 1] and oom["live_blocks"] == sum(1 for _ in oom["largest_live"]) or oom["live_blocks"] > 10
    assert all("event_index" in row for row in oom["largest_live"])


def test_unknown_free_and_double_alloc_are_errors_naming_the_event() -> None:
    bad = Trace([Event("alloc", 8, 512, 0, 0, 512), Event("free", 16, 512)], "bad.jsonl")
    for name in ("caching", "bfc"):
        with pytest.raises(TraceError, match=r"bad.jsonl: event 1 \(free\): free of unknown address 0x10"):
            replay_one(bad, name, capacity=GiB)
    twice = Trace([Event("alloc", 8, 512, 0, 0, 512), Event("alloc", 8, 512, 0, 0, 512)], "t")
    with pytest.raises(TraceError, match="event 1 .*allocated twice"):
        replay_one(twice, "platform", capacity=GiB)
    with pytest.raises(ConfigError):
        replay(bad, ["nope"], capacity=GiB)


def test_start_blocks_are_live_for_every_allocator() -> None:
    t = Trace([Event("free", 1 << 30, 4 * MiB, 0, 0.0, 4 * MiB)], "t", "chrome",
              initial_blocks=[Block(1 << 30, 4 * MiB, 4 * MiB)])
    for name in ALLOCATORS:
        run = replay_one(t, name, capacity=GiB)
        assert run.oom is None and run.peak_in_use_bytes >= 4 * MiB


def run_cli(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from jaxmem.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_cli_json_and_table_on_a_real_snapshot() -> None:
    out = run_cli("replay", str(REAL), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data["allocators"]) == set(ALLOCATORS)
    for run in data["allocators"].values():
        assert {"peak_in_use_bytes", "peak_reserved_bytes", "device_allocs", "device_alloc_bytes", "oom"} <= set(run)
    assert data["recorded"]["device_allocs"] == data["allocators"]["caching"]["device_allocs"] == 783
    table = run_cli("replay", str(REAL), "--allocator", "caching,bfc", "--capacity", "40GiB")
    assert table.returncode == 0 and "recorded" in table.stdout and "out of memory at event" in table.stdout


def test_cli_bad_input_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    write_jaxmem_trace(Trace([Event("alloc", 8, 512, 0, 0, 512), Event("free", 16, 512)], "bad"), bad)
    for args, needle in (((str(bad),), "event 1 (free): free of unknown address"),
                         ((str(bad), "--allocator", "foo"), "unknown allocator 'foo'"),
                         ((str(bad), "--capacity", "lots"), "cannot read size"),
                         ((str(tmp_path / "none.pickle"),), "cannot read")):
        r = run_cli("replay", *args)
        assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_recorded_device_hands_out_recorded_addresses_then_fresh_ones() -> None:
    from jaxmem.errors import AllocationError
    from jaxmem.traces.model import Segment
    from jaxmem.traces.recorded_device import RecordedDevice

    base = 0x7F0000000000
    t = Trace([Event("segment_alloc", base + 64 * MiB, 20 * MiB), Event("segment_alloc", base + 100 * MiB, 2 * MiB)],
              "t", "torch-snapshot", initial_segments=[Segment(base, 2 * MiB)])
    dev = RecordedDevice(t, capacity=40 * MiB)
    assert dev.reserve(2 * MiB) == base                       # the start state first
    assert dev.reserve(2 * MiB) == base + 100 * MiB           # size looked up ahead in the queue
    assert dev.reserve(20 * MiB) == base + 64 * MiB
    fresh = dev.reserve(4 * MiB)                              # never recorded: above everything recorded
    assert fresh >= base + 102 * MiB and dev.fresh == 1 and dev.recorded_hits == 3
    assert dev.reserve(20 * MiB) is None                      # 28 + 20 > 40 MiB
    dev.release(base + 64 * MiB)
    assert dev.reserved == 8 * MiB
    with pytest.raises(AllocationError):
        dev.release(12345)


def test_snapshot_replay_with_other_settings_diverges_without_error() -> None:
    from jaxmem.runtime.caching_config import parse_alloc_conf
    from jaxmem.traces.readers import load_trace

    trace = load_trace(REAL)
    cfg = parse_alloc_conf("max_split_size_mb:64,roundup_power2_divisions:4")
    run = replay_one(trace, "caching", capacity=80 * GiB, options={"config": cfg})
    assert run.oom is None and run.events_replayed > 0
    assert run.device_allocs != 783 and run.address_matches < sum(e.action == "alloc" for e in trace.events)
    assert max(p[3] for p in run.timeline) == run.peak_reserved_bytes


def test_replay_advances_the_bar_it_is_given_and_layers_import_downward():
    import contextlib

    calls: list = []

    @contextlib.contextmanager
    def bar(description, total):
        done: list[int] = []
        calls.append((description, total))
        yield done.append
        calls.append(sum(done))

    trace = Trace([Event("alloc", 1, 1024, requested=1000), Event("free", 1, 1024)])
    replay(trace, ["platform", "bfc"], capacity=GiB, progress=bar)
    assert calls == [("replaying", 4), 4]
    # The runtime's recorder needs no traces package, and a replay no reports package.
    code = ("import sys, jaxmem.runtime.adaptors as a; assert not [m for m in sys.modules if m.startswith('jaxmem.traces')]; "
            "from jaxmem.traces.replay import replay; from jaxmem.trace_schema import Event, Trace; "
            "replay(Trace([Event('alloc', 1, 1024), Event('free', 1, 1024)]), ['bfc'], capacity=1 << 30); "
            "assert not [m for m in sys.modules if m.startswith('jaxmem.reports')]")
    subprocess.run([sys.executable, "-c", code], check=True)
