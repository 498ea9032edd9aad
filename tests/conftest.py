"""Suite-wide settings.

`JAXMEM_TEST_DEADLINE` (seconds since the epoch): cases that start after it are skipped, saying
so. CI sets it for its pass over the slow cases, so they run only while its time allows (the
project keeps a whole CI run well under 20 minutes on 2 cores); unset, everything runs.

The tests run in pytest-xdist workers (`-n auto` in pyproject.toml), one per CPU this process
may use, at most `MAX_WORKERS`; `-n 0` runs them in this process, `-n N` in N workers.

The deviceless compilers jaxmem installs in its own folder are on this process's path and on
its children's PYTHONPATH (`xla.compilers`)."""

from __future__ import annotations

import os
import time

import pytest

from jaxmem.xla import compilers

# The deviceless compilers (`jaxmem compilers install`) for every test: this process compiles
# with them in itself (fit's judges, the GPU tests' own compiles), and the scripts the tests
# start read them from PYTHONPATH, as jaxmem's compile processes do. tests/install checks that
# a process given neither never sees them.
compilers.activate()
os.environ.update(compilers.child_env(dict(os.environ)))

# Each worker imports JAX and compiles with XLA (up to about 2 GB at once): a large machine
# gains little past this, and a container must not start a worker per host CPU.
MAX_WORKERS = 4


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, less a cgroup v2 CPU quota where one is
    set. psutil's count (what xdist's `auto` uses) is the host's, which a container may be
    allowed only a part of."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return min(usable_cpus(), MAX_WORKERS)


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = os.environ.get("JAXMEM_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("CI's time for slow cases is spent (JAXMEM_TEST_DEADLINE)")
