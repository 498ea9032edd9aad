"""The caching-allocator model against the real allocator: two PyTorch snapshots recorded on a GPU.

Independent truth: the recorded segment_alloc events (what cudaMalloc calls PyTorch made in the
window) and the segments PyTorch dumped at the end of the window. Replaying the recorded
alloc/free stream from the rebuilt start state must give the same cudaMallocs, and must end in
the same segments with the same block layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxmem.runtime.caching import make_caching_allocator
from jaxmem.traces.readers import load_trace
from jaxmem.traces.recorded_device import RecordedDevice
from jaxmem.traces.replay import replay, replay_one
from jaxmem.traces.safe_pickle import load_plain_pickle

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
FILES = [TRACES / "torch-transformer-ctx128-forward.pickle", TRACES / "torch-transformer-ctx128-fullstep.pickle"]


def _recorded_segment_allocs(raw: dict) -> tuple[int, int]:
    events = [e for e in raw["device_traces"][0] if e["action"] == "segment_alloc"]
    return len(events), sum(e["size"] for e in events)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_caching_model_reproduces_recorded_cudamallocs(path: Path) -> None:
    raw = load_plain_pickle(path)
    count, total = _recorded_segment_allocs(raw)
    assert count > 0
    run = replay(load_trace(path), ["caching"], capacity=80 << 30, progress=False).runs["caching"]
    assert run.oom is None
    assert (run.device_allocs, run.device_alloc_bytes) == (count, total)
    assert run.device_frees == sum(1 for e in raw["device_traces"][0] if e["action"] == "segment_free")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_caching_model_places_every_block_where_pytorch_did(path: Path) -> None:
    """Given the recorded cudaMalloc addresses, every allocation lands at its recorded address."""
    trace = load_trace(path)
    run = replay(trace, ["caching"], capacity=80 << 30, progress=False).runs["caching"]
    assert run.address_matches == sum(1 for e in trace.events if e.action == "alloc")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_cudamalloc_count_does_not_depend_on_device_addresses(path: Path) -> None:
    """On a plain simulated device (addresses unlike the GPU's) the counts still match."""
    raw = load_plain_pickle(path)
    trace = load_trace(path)
    trace.format = "jaxmem"          # not a snapshot: the replay uses a SimulatedBackend
    run = replay_one(trace, "caching", capacity=80 << 30, options={"settings": trace.allocator_settings})
    assert (run.device_allocs, run.device_alloc_bytes) == _recorded_segment_allocs(raw)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_caching_model_ends_in_the_dumped_segments(path: Path) -> None:
    """The model's segments after the window are the segments PyTorch dumped: same addresses,
    pools, sizes, and every block's address, size and state. Driven through the public
    allocate/free pair, independently of the replay loop."""
    raw = load_plain_pickle(path)
    dumped = []
    for seg in raw["segments"]:
        blocks, offset = [], 0
        for b in seg["blocks"]:
            allocated = b["state"] in ("active_allocated", "active_pending_free")
            if blocks and not allocated and not blocks[-1][2]:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + b["size"], False)
            else:
                blocks.append((seg["address"] + offset, b["size"], allocated))
            offset += b["size"]
        dumped.append((seg["segment_type"], seg["address"], seg["total_size"], tuple(blocks)))

    trace = load_trace(path)
    model = make_caching_allocator(RecordedDevice(trace, 80 << 30), limit=80 << 30, settings=trace.allocator_settings)
    live = {}
    for seg in sorted(trace.initial_segments, key=lambda s: s.addr):
        placed = model.adopt_segment(seg.size, seg.pool == "small", seg.stream,
                                     [(b.addr - seg.addr, b.size, b.allocated) for b in seg.blocks])
        live.update({seg.addr + off: blk for off, blk in placed.items()})
    for e in trace.events:
        if e.action == "alloc":
            live[e.addr] = model.allocate(e.requested, stream=e.stream)
        elif e.action == "free":
            buf = live.pop(e.addr)
            model.free(buf) if hasattr(buf, "live") else model.free_block(buf)
    ours = [(s["pool"], s["addr"], s["size"], tuple((b["addr"], b["size"], b["allocated"]) for b in s["blocks"]))
            for s in model.segments()]
    assert sorted(ours) == sorted(dumped)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_rebuilt_start_state_matches_the_dump_minus_the_window(path: Path) -> None:
    raw = load_plain_pickle(path)
    trace = load_trace(path)
    new = {e["addr"] for e in raw["device_traces"][0] if e["action"] == "segment_alloc"}
    dumped = {s["address"]: s["total_size"] for s in raw["segments"]}
    assert {s.addr: s.size for s in trace.initial_segments} == {a: n for a, n in dumped.items() if a not in new}
    for seg in trace.initial_segments:
        assert sum(b.size for b in seg.blocks) == seg.size
        assert seg.blocks[0].addr == seg.addr


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_other_allocators_replay_the_real_traces(path: Path) -> None:
    trace = load_trace(path)
    report = replay(trace, ["caching-expandable", "bfc", "bfc-growth", "platform"], capacity=80 << 30, progress=False)
    platform = report.runs["platform"]
    # the platform allocator holds exactly what is live: its peak reserved is its peak in use
    assert platform.peak_reserved_bytes == platform.peak_in_use_bytes
    for run in report.runs.values():
        assert run.oom is None
        assert run.peak_reserved_bytes >= run.peak_in_use_bytes > 0
    assert report.runs["bfc"].peak_reserved_bytes == int(0.75 * (80 << 30)) // 256 * 256 or report.runs["bfc"].peak_reserved_bytes <= 60 << 30
    run = replay_one(trace, "caching", capacity=80 << 30)
    assert run.events_replayed == report.events
