"""Hypothesis drives random allocate/free/empty_cache sequences through every allocator and
checks all pool invariants after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from runtime_checks import FACTORIES, check_invariants, check_regions

from jaxmem.errors import OutOfMemory
from jaxmem.units import MiB

SIZES = st.one_of(
    st.integers(1, 2048),                 # bin 0-3 and rounding edges
    st.integers(1, 4 * MiB),
    st.integers(4 * MiB, 40 * MiB),       # near the pool size: forces OOM and growth
    st.sampled_from([255, 256, 257, 511, 512, 2 * MiB, 2 * MiB + 1]),
)


class PoolMachine(RuleBasedStateMachine):
    name = ""

    @initialize(limit_mib=st.sampled_from([16, 48, 100]))
    def make(self, limit_mib):
        self.alloc = FACTORIES[self.name](128 * MiB, limit=limit_mib * MiB)
        self.live = []

    @rule(size=SIZES, alignment=st.sampled_from([256, 256, 256, 1, 1024, 65536]))
    def allocate(self, size, alignment):
        before = (list(self.alloc.chunks()), self.alloc.memory_stats())
        try:
            buf = self.alloc.allocate(size, alignment=alignment)
        except OutOfMemory as err:
            # A failed allocation changes no state, and the error describes the pool as it is.
            assert (list(self.alloc.chunks()), self.alloc.memory_stats()) == before
            assert err.in_use == before[1]["bytes_in_use"]
            assert err.fragmentation == (before[1]["pool_bytes"] - before[1]["bytes_in_use"] >= err.rounded)
            return
        assert buf.address % max(alignment, 256) == 0
        self.live.append(buf)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10_000))
    def free(self, index):
        self.alloc.free(self.live.pop(index % len(self.live)))

    @rule()
    def empty_cache(self):
        self.alloc.empty_cache()

    @rule()
    def free_everything(self):
        for buf in self.live:
            self.alloc.free(buf)
        self.live = []
        chunks = list(self.alloc.chunks())
        if self.alloc.name == "bfc":  # preallocated: one free chunk again
            assert len(chunks) == 1 and not chunks[0].in_use
        assert all(not c.in_use for c in chunks)

    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "alloc"):
            check_invariants(self.alloc, self.live)
            check_regions(self.alloc)


def _machine(name):
    machine = type(f"Pool_{name.replace('-', '_')}", (PoolMachine,), {"name": name})
    test = machine.TestCase
    test.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return test


TestBFC = _machine("bfc")
TestBFCGrowth = _machine("bfc-growth")
TestPlatform = _machine("platform")
TestBFCLimited = _machine("bfc+limit")
TestBFCGrowthTracked = _machine("bfc-growth+tracking")
