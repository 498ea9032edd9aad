"""Snapshot windows with what the two real traces lack: blocks allocated before the window and
freed in it, empty_cache calls (segment_free) inside it, two streams.

The "recording" here is made by the model itself on a logging device, so these tests check
the reader's start-state rebuild and the replay's plumbing (not fidelity to PyTorch, which the
real traces check): replaying a window must repeat the recorder's cudaMallocs and cudaFrees.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest

from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.caching import make_caching_allocator
from jaxmem.traces.readers import load_trace
from jaxmem.traces.replay import replay

MiB = 1 << 20
BASE = 0x7F0000000000


class LoggingDevice(SimulatedBackend):
    """Addresses like a GPU's; every cudaMalloc/cudaFree goes into the recording."""

    def __init__(self, capacity: int, log: list) -> None:
        super().__init__(capacity)
        self.log = log
        self.stream = 0                       # the stream of the malloc in progress
        self.streams: dict[int, int] = {}     # segment address -> its stream

    def reserve(self, size: int, alignment: int = 256):
        addr = super().reserve(size, alignment)
        if addr is not None:
            self.streams[BASE + addr] = self.stream
            self.log.append({"action": "segment_alloc", "addr": BASE + addr, "size": size, "stream": self.stream, "time_us": 0})
            return BASE + addr
        return None

    def release(self, address: int) -> None:
        size = self.allocations[address - BASE]
        self.log.append({"action": "segment_free", "addr": address, "size": size,
                         "stream": self.streams.pop(address), "time_us": 0})
        super().release(address - BASE)


def record(seed: int, n: int, window_from: int) -> dict:
    rng = random.Random(seed)
    log: list = []
    device = LoggingDevice(8 << 30, log)
    alloc = make_caching_allocator(device, limit=8 << 30)
    live = []
    for step in range(n):
        if step == window_from:
            log.clear()
        r = rng.random()
        if r < 0.03:
            alloc.empty_cache()
        elif live and r < 0.5:
            buf = live.pop(rng.randrange(len(live)))
            alloc.free(buf)
            for action in ("free_requested", "free_completed"):
                log.append({"action": action, "addr": buf.address, "size": buf.requested_size, "stream": buf.stream, "time_us": step})
        else:
            size = rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 12 * MiB), rng.randint(12 * MiB, 90 * MiB)])
            stream = device.stream = rng.choice([0, 0, 0, 5])
            buf = alloc.allocate(size, stream=stream)
            live.append(buf)
            log.append({"action": "alloc", "addr": buf.address, "size": size, "stream": stream, "time_us": step})
    segments = []
    for seg in alloc.segments():
        blocks = [{"address": b["addr"], "size": b["size"], "requested_size": b["size"],
                   "state": "active_allocated" if b["allocated"] else "inactive"} for b in seg["blocks"]]
        segments.append({"device": 0, "address": seg["addr"], "total_size": seg["size"], "stream": seg["stream"],
                         "segment_type": seg["pool"], "is_expandable": False, "blocks": blocks})
    return {"segments": segments, "device_traces": [log], "allocator_settings": {"max_split_size": -1}}, alloc


@pytest.mark.parametrize("seed", range(6))
def test_window_replay_repeats_the_recorders_device_traffic(tmp_path: Path, seed: int) -> None:
    snap, recorder = record(seed, 1500, window_from=400)
    path = tmp_path / "w.pickle"
    path.write_bytes(pickle.dumps(snap))
    trace = load_trace(path)
    assert trace.meta["prewindow_frees"] > 0
    log = snap["device_traces"][0]
    seg_allocs = [e for e in log if e["action"] == "segment_alloc"]
    seg_frees = [e for e in log if e["action"] == "segment_free"]
    assert seg_frees, "the window should hold empty_cache calls"
    report = replay(trace, ["caching"], capacity=8 << 30, progress=False)
    run = report.runs["caching"]
    assert (run.device_allocs, run.device_alloc_bytes) == (len(seg_allocs), sum(e["size"] for e in seg_allocs))
    assert run.device_frees == len(seg_frees)
    assert run.address_matches == sum(1 for e in log if e["action"] == "alloc")
    assert run.final_reserved_bytes == recorder.memory_stats()["pool_bytes"]
