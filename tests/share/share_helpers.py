"""Shared by the share tests: an isolated state directory, the CLI as a subprocess, journal checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jaxmem.share import store

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def isolated_env(state: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess: its own state directory, no real nvidia-smi consulted."""
    env = dict(os.environ)
    env["JAXMEM_STATE_DIR"] = str(state)
    env["JAXMEM_NVIDIA_SMI"] = "none"
    env.pop("XLA_CLIENT_MEM_FRACTION", None)
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    env.update(extra)
    return env


def jaxmem_cmd(*args: str) -> list[str]:
    return [PYTHON, "-c", "from jaxmem.cli.main import entry; entry()", *args]


def run_cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(jaxmem_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout)


def replay_totals(events: list[dict]) -> list[int]:
    """Bytes reserved after each event, recomputed from grants, releases and reclaims alone
    (not from the `reserved` figure the ledger wrote), checking the ids match up."""
    held: dict[int, int] = {}
    totals = []
    for e in events:
        if e["op"] == "snapshot":
            held = {r["id"]: r["bytes"] for r in e["state"]["reservations"]}
        elif e["op"] == "grant":
            assert e["id"] not in held, f"reservation {e['id']} granted twice"
            held[e["id"]] = e["bytes"]
        elif e["op"] in ("release", "reclaim"):
            assert held.pop(e["id"]) == e["bytes"], f"event {e['seq']} frees bytes never granted"
        totals.append(sum(held.values()))
        if "reserved" in e:
            assert e["reserved"] == totals[-1], f"event {e['seq']} says {e['reserved']}, replay says {totals[-1]}"
    return totals


def check_fcfs(events: list[dict]) -> int:
    """Every grant's ticket comes after all lower tickets were granted or given up; returns the
    number of requests that had to wait (so a caller can insist the check was not vacuous)."""
    resolved: set[int] = set()
    waited = 0
    for e in events:
        if e["op"] == "enqueue":
            waited += 1
        elif e["op"] in ("grant", "abandon"):
            if e["op"] == "grant":
                missing = [t for t in range(1, e["ticket"]) if t not in resolved]
                assert not missing, f"ticket {e['ticket']} granted (seq {e['seq']}) before earlier tickets {missing[:5]}"
            resolved.add(e["ticket"])
    return waited


def journal(state: Path, device: int = 0) -> list[dict]:
    return store.read_history(store.paths_for(device, state))


def fast_dir(tmp_path: Path) -> Path:
    """A scratch directory on a memory file system when there is one (/dev/shm), as the
    default state directory is; else under tmp_path. The caller removes it."""
    import tempfile

    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path(tempfile.mkdtemp(prefix="jaxmem-test-", dir="/dev/shm"))
    path = tmp_path / "fast"
    path.mkdir()
    return path
