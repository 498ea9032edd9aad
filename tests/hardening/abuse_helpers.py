"""Shared by the abuse cases: the CLI in process with its time and memory, one-line checks, a
tree fingerprint (so a case can prove nothing outside the state directory changed), hostile
inputs, and a second uid."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
HOSTILE_S = 2.0  # the bound for answering a hostile file


class Outcome(NamedTuple):
    code: int
    out: str
    err: str
    seconds: float
    peak_bytes: int


def cli(capsys, *argv: str, measure_memory: bool = True) -> Outcome:
    """`jaxmem ARGV` in this process: exit code, stdout, stderr, seconds, peak Python memory."""
    from jaxmem.cli.main import main

    capsys.readouterr()
    if measure_memory:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        code = main(list(argv))
    finally:
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if measure_memory else 0
        if measure_memory:
            tracemalloc.stop()
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err, seconds, peak)


def assert_one_line(result: Outcome | subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    """Exit code `code`, exactly one line on stderr, no traceback, and every needle in it."""
    err = result.err if isinstance(result, Outcome) else result.stderr
    rc = result.code if isinstance(result, Outcome) else result.returncode
    lines = err.strip().splitlines()
    assert rc == code, f"exit {rc}, stderr: {err[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in err, f"not one line: {err[-2000:]}"
    assert len(lines[0]) < 600, f"a {len(lines[0])}-character line"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def assert_bounded(result: Outcome, input_bytes: int) -> None:
    """Answered within HOSTILE_S, with Python memory bounded by a small multiple of the input."""
    assert result.seconds < HOSTILE_S, f"took {result.seconds:.2f} s"
    limit = 64 * 2**20 + 8 * input_bytes
    assert result.peak_bytes < limit, f"peak {result.peak_bytes} bytes > {limit}"


def fingerprint(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """Every entry under `root` (not following links) with its kind, size and content hash,
    except the trees in `skip`."""
    found: dict[str, tuple] = {}
    skipped = {os.path.realpath(p) for p in skip}
    for base, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(base, d)) not in skipped]
        for name in dirs + files:
            path = os.path.join(base, name)
            info = os.lstat(path)
            digest = ""
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            elif os.path.islink(path):
                digest = os.readlink(path)
            found[os.path.relpath(path, root)] = (info.st_mode, info.st_size, digest)
    return found


def jaxmem_argv(*args: str, python: str = sys.executable) -> list[str]:
    return [python, "-c", "from jaxmem.cli.main import entry; entry()", *args]


def child_env(state: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"JAXMEM_STATE_DIR": str(state), "JAXMEM_NVIDIA_SMI": "none"})
    env.pop("XLA_CLIENT_MEM_FRACTION", None)
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    env.update(extra)
    return env


# ---- a second uid ----------------------------------------------------------------------------

def other_python() -> str:
    """A Python uid NOBODY can run with jaxmem importable: $JAXMEM_OTHER_UID_PYTHON, else ours."""
    return os.environ.get("JAXMEM_OTHER_UID_PYTHON") or sys.executable


def second_uid_reason(through_shell: bool = False) -> str | None:
    """Why a second uid cannot be used here, or None when it can (`through_shell`: also from a
    shell running as that uid, which must be able to reach the interpreter's directory)."""
    if os.geteuid() != 0:
        return f"running as uid {os.geteuid()}: switching to another uid needs root"
    probe = [other_python(), "-c", "import jaxmem"]
    if through_shell:
        probe = ["sh", "-c", 'exec "$0" -c "import jaxmem"', other_python()]
    try:
        done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *probe],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"setpriv is not usable: {err}"
    if done.returncode != 0:
        return (f"uid {NOBODY} cannot run {other_python()} with jaxmem "
                "(set JAXMEM_OTHER_UID_PYTHON to a Python it can run)")
    return None


def as_uid(uid: int, argv: list[str], env: dict[str, str], groups: str | None = None,
           timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run argv as `uid` (gid `uid`, or the supplementary `groups`)."""
    group_args = [f"--groups={groups}"] if groups else ["--clear-groups"]
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", *group_args, *argv],
                          env=env, capture_output=True, text=True, timeout=timeout, **kw)


# ---- hostile pickles ---------------------------------------------------------------------------

def dag(levels: int = 60) -> list:
    """A list whose every level holds the one below twice: 2**levels elements as a tree, a few
    bytes per level as a pickle (the memo shares each level)."""
    node: list = []
    for _ in range(levels):
        node = [node, node]
    return node


def snapshot(**over) -> dict:
    """A small, valid PyTorch snapshot; keyword arguments replace its parts."""
    segment = {"device": 0, "address": 1 << 20, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
               "blocks": [{"size": 2 << 20, "state": "inactive"}]}
    events = [{"action": "alloc", "addr": 1 << 20, "size": 4096, "stream": 0, "time_us": 1,
               "frames": [{"filename": "train.py", "line": 3, "name": "step"}]},
              {"action": "free_completed", "addr": 1 << 20, "size": 4096, "stream": 0, "time_us": 2}]
    data = {"segments": [segment], "device_traces": [events], "allocator_settings": {}}
    data.update(over)
    return data


def pickled(obj) -> bytes:
    return pickle.dumps(obj, protocol=4)
