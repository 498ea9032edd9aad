"""Brute force on tiny programs: no schedule or placement beats a proven lower bound, and the
planner reaches the optimum where enumerating everything proves it."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler_helpers import independent_peak
from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.placement import place
from jaxmem.compiler.planner import plan_jaxpr

K = 1024  # elements per unit vector: 4 KiB


def diamond(x):
    a = jnp.sin(x)
    b = jnp.cos(x)
    return a @ b


def branches(x):
    # Two chains whose best interleaving is not the written one: finish one chain first.
    big1 = jnp.outer(x, x)
    s1 = big1.sum(axis=0)
    big2 = jnp.outer(x + 1, x)
    s2 = big2.sum(axis=0)
    return s1 + s2


def fan(x):
    y = jnp.concatenate([x, x])
    z = jnp.exp(y) @ jnp.ones((2 * K, 8))
    w = jnp.tanh(x).sum()
    return z * w


def reduce_late(x):
    a = jnp.outer(x, x)           # big
    b = jnp.sin(x).sum()          # small, independent
    c = a.sum(axis=1)
    d = jnp.cos(x) * b
    return c + d


TINY = {"diamond": diamond, "branches": branches, "fan": fan, "reduce_late": reduce_late}


def _all_orders(steps, producer):
    """Every order of the steps that respects data dependencies, grown one ready step at a time."""
    n = len(steps)
    needs = [{producer[v] for v in ins if v in producer} for ins, _ in steps]

    def grow(order, done):
        if len(order) == n:
            yield list(order)
            return
        for k in range(n):
            if k not in done and needs[k] <= done:
                order.append(k)
                done.add(k)
                yield from grow(order, done)
                done.discard(k)
                order.pop()

    yield from grow([], set())


@pytest.mark.parametrize("name", sorted(TINY))
def test_planner_schedule_is_the_brute_force_optimum(name):
    x = jnp.linspace(0, 1, K)
    # Without fusion or in-place sharing, every value has its own buffer: a model simple enough
    # to recompute here from nothing but the schedule.
    closed = jax.make_jaxpr(TINY[name])(x)
    p = plan_jaxpr(closed, fusion=False, inplace=False)
    assert check_plan(p) == [] and p.valid
    steps_by_pos = [(s.inputs, [v for v in s.outputs if v is not None]) for s in p.schedule]
    producer = {v: k for k, (_, outs) in enumerate(steps_by_pos) for v in outs}
    sizes = {v: info.nbytes for v, info in p.values.items()}
    outputs = {v for v in p.outvars if v is not None}
    external = set(p.invars)
    peaks = [independent_peak(steps_by_pos, sizes, order, outputs, external)
             for order in _all_orders(steps_by_pos, producer)]
    assert len(steps_by_pos) <= 10 and peaks
    args = sum(sizes[v] for v in p.invars)
    # The planner's own schedule, scored independently, is its reported lower bound ...
    mine = independent_peak(steps_by_pos, sizes, list(range(len(steps_by_pos))), outputs, external)
    assert p.lower_bound_bytes == args + mine
    # ... no order beats it, and the placement sits on it (no fragmentation possible here).
    assert mine == min(peaks)
    assert p.peak_bytes >= p.lower_bound_bytes
    assert p.program_order_lower_bound_bytes >= p.lower_bound_bytes


@pytest.mark.parametrize("name", sorted(TINY))
def test_fusion_and_sharing_never_raise_the_peak(name):
    x = jnp.linspace(0, 1, K)
    closed = jax.make_jaxpr(TINY[name])(x)
    plain = plan_jaxpr(closed, fusion=False, inplace=False)
    full = plan_jaxpr(closed)
    assert full.valid and plain.valid
    assert full.lower_bound_bytes <= plain.lower_bound_bytes
    assert full.peak_bytes <= plain.peak_bytes


def _optimal_arena(buffers):
    """Smallest arena for (start, end, size) buffers, by trying every order of placing them
    with each one pushed down onto 0 or onto a buffer it overlaps in time (any packing can be
    normalized that way, so this is exact)."""
    best = sum(b[2] for b in buffers)
    for perm in itertools.permutations(range(len(buffers))):
        stack = [([], 0)]
        while stack:
            placed, top = stack.pop()
            if top >= best:
                continue
            if len(placed) == len(buffers):
                best = top
                continue
            i = perm[len(placed)]
            s, e, z = buffers[i]
            cands = {0}
            for j, off in placed:
                sj, ej, zj = buffers[j]
                if sj <= e and ej >= s:
                    cands.add(off + zj)
            for off in cands:
                clash = False
                for j, oj in placed:
                    sj, ej, zj = buffers[j]
                    if sj <= e and ej >= s and off < oj + zj and oj < off + z:
                        clash = True
                        break
                if not clash:
                    stack.append((placed + [(i, off)], max(top, off + z)))
    return best


def _max_live(buffers):
    if not buffers:
        return 0
    horizon = max(b[1] for b in buffers) + 2
    return max(sum(z for s, e, z in buffers if s <= t <= e) for t in range(-1, horizon))


interval = st.tuples(st.integers(-1, 6), st.integers(0, 6), st.integers(1, 6)).map(
    lambda t: (min(t[0], t[1]), max(t[0], t[1]), t[2] * 256))


@settings(max_examples=60, deadline=None)
@given(st.lists(interval, min_size=1, max_size=5))
def test_placement_never_beats_the_optimum_and_is_valid(buffers):
    offsets, arena, _ = place(buffers)
    for i, (s, e, z) in enumerate(buffers):
        assert offsets[i] % 256 == 0 and offsets[i] + z <= arena
        for j in range(i):
            sj, ej, zj = buffers[j]
            if sj <= e and ej >= s:
                assert offsets[i] + z <= offsets[j] or offsets[j] + zj <= offsets[i]
    optimum = _optimal_arena(buffers)
    assert _max_live(buffers) <= optimum <= arena
    # Best fit over several orderings is within one buffer of the optimum on these.
    assert arena <= optimum + max(z for _, _, z in buffers)


@settings(max_examples=40, deadline=None)
@given(st.lists(interval, min_size=1, max_size=40))
def test_placement_is_valid_on_larger_random_sets(buffers):
    offsets, arena, _ = place(buffers)
    for i, (s, e, z) in enumerate(buffers):
        for j in range(i):
            sj, ej, zj = buffers[j]
            if sj <= e and ej >= s:
                assert offsets[i] + z <= offsets[j] or offsets[j] + zj <= offsets[i]
    assert arena >= _max_live(buffers)


@settings(max_examples=40, deadline=None)
@given(st.lists(interval, min_size=1, max_size=40))
def test_placement_stops_only_where_nothing_is_better(buffers):
    # By default the search stops once the arena is the most bytes live at once: the same arena
    # as the whole search (stop_at=-1 is never reached), since nothing beats that bound.
    stopped, full = place(buffers), place(buffers, stop_at=-1)
    assert stopped.arena == full.arena
    if stopped.arena > _max_live(buffers):
        assert stopped == full   # not at the bound: every ordering and restart was tried
