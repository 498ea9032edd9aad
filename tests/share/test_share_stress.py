"""Many processes race for one simulated 16 GiB device through the ledger.

Truths checked: the journal's own events (replayed here, not its running totals) never show more
than the capacity reserved; the workers' own clocks agree (the sum of what they held at any
instant never exceeds it); every request was granted (nothing deadlocked: all finished within
the timeout with no give-ups); and grants came in ticket order (first come, first served).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from share_helpers import PYTHON, check_fcfs, fast_dir, isolated_env, journal, replay_totals

from jaxmem.units import GiB

WORKER = Path(__file__).with_name("share_worker.py")
CAPACITY = 16 * GiB


def _race(tmp_path: Path, workers: int, total: int, timeout: float, state: Path) -> dict:
    env = isolated_env(state)
    start_at = time.time() + 2.0 + 0.05 * workers  # after every interpreter has started
    counts = [total // workers + (1 if i < total % workers else 0) for i in range(workers)]
    outs = [tmp_path / f"worker-{i}.jsonl" for i in range(workers)]
    procs = [subprocess.Popen([PYTHON, str(WORKER), str(i), str(counts[i]), str(1000 + i), str(start_at),
                               str(outs[i]), "16GiB", str(timeout)], env=env, stderr=subprocess.PIPE, text=True)
             for i in range(workers)]
    deadline = time.monotonic() + timeout + 30
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(i, p.returncode, p.stderr.read()[-500:]) for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"workers failed or hung: {failed[:3]}"
    held = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    events = journal(state)
    return {"held": held, "events": events, "elapsed": time.time() - start_at}


def _check(result: dict, total: int) -> None:
    held, events = result["held"], result["events"]
    assert len(held) == total

    # 1. The journal is one serial history: seq numbers 1..n, no gap, no repeat.
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    # 2. Replayed from grants and releases alone, never more than the capacity.
    totals = replay_totals(events)
    assert max(totals) <= CAPACITY
    assert totals[-1] == 0
    grants = [e for e in events if e["op"] == "grant"]
    assert len(grants) == total and len([e for e in events if e["op"] == "release"]) == total
    assert not [e for e in events if e["op"] in ("abandon", "reclaim")]  # no timeouts, no deaths
    # The workers' view: ids they were given match the journal's grants, with the same bytes.
    assert sorted((h["id"], h["bytes"]) for h in held) == sorted((g["id"], g["bytes"]) for g in grants)
    # 3. Independent of the journal: what the workers held at once, by their own clocks.
    edges = sorted([(h["t0"], h["bytes"]) for h in held] + [(h["t1"], -h["bytes"]) for h in held],
                   key=lambda edge: (edge[0], edge[1]))  # at a tie, releases first
    level = peak = 0
    for _, delta in edges:
        level += delta
        peak = max(peak, level)
    assert peak <= CAPACITY
    # 4. First come, first served, and it was not vacuous: many requests had to wait (the
    #    device was really contended).
    waited = check_fcfs(events)
    assert waited > total // 4
    print(f"\n{total} reservations: {result['elapsed']:.1f} s from the start signal, {len(events)} journal "
          f"events, {waited} waited, peak held {peak / GiB:.2f} GiB of {CAPACITY / GiB:.0f} GiB")


@pytest.fixture
def state(tmp_path: Path):
    # The default state directory is a memory file system (/dev/shm or $XDG_RUNTIME_DIR); race there.
    path = fast_dir(tmp_path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_share_stress_32_processes_1000_reservations(tmp_path: Path, state: Path) -> None:
    # Bounded: each request may wait at most 60 s, and the whole race is killed after 90 s. On
    # a quiet 2-core machine it takes about 10 s.
    result = _race(tmp_path, workers=32, total=1000, timeout=60, state=state)
    _check(result, 1000)


@pytest.mark.slow
def test_share_stress_64_processes_5000_reservations(tmp_path: Path, state: Path) -> None:
    result = _race(tmp_path, workers=64, total=5000, timeout=900, state=state)
    _check(result, 5000)


@pytest.mark.slow
def test_share_stress_on_disk(tmp_path: Path) -> None:
    # A state directory on disk (JAXMEM_STATE_DIR pointed at one): every change pays an fsync.
    result = _race(tmp_path, workers=32, total=1000, timeout=600, state=tmp_path / "state")
    _check(result, 1000)
