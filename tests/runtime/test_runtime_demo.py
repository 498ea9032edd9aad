"""`jaxmem demo` and the built-in workload it replays."""

from __future__ import annotations


from jaxmem.cli.main import main
from jaxmem.runtime.device import Device
from jaxmem.runtime.workload import interleaved_events, run_events, training_events


def test_training_events_are_well_formed():
    events = training_events(1 << 30, layers=6, steps=2, seed=3)
    live = set()
    for op, buf, size in events:
        if op == "alloc":
            assert buf not in live and size > 0
            live.add(buf)
        else:
            live.remove(buf)                  # only live buffers are freed
    assert len(live) == 3 * 6                 # parameters and two moments per layer stay


def test_run_events_matches_a_recount():
    device = Device("8GiB")
    events = training_events(device.allocator.limit, layers=8, steps=2)
    result = run_events(device.allocator, events)
    sizes = {buf: size for op, buf, size in events if op == "alloc"}
    live = [buf for op, buf, _ in events if op == "alloc"]
    freed = {buf for op, buf, _ in events if op == "free"}
    in_use = sum(-(-sizes[b] // 256) * 256 for b in live if b not in freed)
    assert not result.failures
    assert result.stats["bytes_in_use"] >= in_use      # BFC may hand out whole chunks
    assert result.peak_in_use == result.stats["peak_bytes_in_use"]


def test_interleaved_events_leave_half_the_pool_in_holes():
    device = Device("1GiB", mem_fraction=1.0)
    events, request = interleaved_events(1 << 30, block=16 << 20)
    run_events(device.allocator, events)
    stats = device.memory_stats()
    assert stats["largest_free_block_bytes"] < request <= stats["pool_bytes"] - stats["bytes_in_use"]


def test_demo_runs_and_shows_a_fragmentation_oom(capsys):
    assert main(["demo", "--capacity", "16GiB", "--steps", "2", "--layers", "8"]) == 0
    out = capsys.readouterr().out
    for text in ("memory_stats()", "peak bytes in use", "bfc-growth", "platform", "OutOfMemory",
                 "cause: fragmentation", "occupancy |_*_*"):
        assert text in out, text


def test_demo_bad_options_are_one_line_errors(capsys):
    assert main(["demo", "--allocator", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown allocator 'nope'" in err
    assert main(["demo", "--capacity", "lots"]) == 2
    assert "cannot read size" in capsys.readouterr().err


def test_demo_from_env(capsys, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert main(["demo", "--from-env", "--capacity", "8GiB", "--steps", "1", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "bfc-growth (env)" in out and "4.00 GiB" in out       # 0.5 x 8 GiB
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    assert main(["demo", "--from-env"]) == 2
    assert "cuda_async" in capsys.readouterr().err
