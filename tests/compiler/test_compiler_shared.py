"""The pieces the planner and rematerialization share: the sink move, fusibility, the program."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp

from jaxmem.compiler.program import RECOMPUTED
from jaxmem.compiler.remat_graph import trace
from jaxmem.compiler.remat_search import profile, search
from jaxmem.compiler.rules import fusible_producer
from jaxmem.compiler.schedule import sink


def _random_dag(rng: random.Random, n: int) -> list[list[int]]:
    return [sorted(rng.sample(range(k), min(k, rng.randint(0, 3)))) for k in range(n)]


def test_sink_delays_flagged_ops_to_their_first_consumer_and_keeps_dependencies():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        producers = _random_dag(rng, n)
        sunk = [rng.random() < 0.5 for _ in range(n)]
        order = sink(list(range(n)), producers, sunk)
        pos = {oi: p for p, oi in enumerate(order)}
        assert sorted(order) == list(range(n))
        assert all(pos[p] < pos[oi] for oi in range(n) for p in producers[oi])
        readers = [[c for c in range(n) if oi in producers[c]] for oi in range(n)]
        for oi in range(n):
            if sunk[oi] and readers[oi]:
                # right before its first reader: only other delayed ops in between
                first = min(pos[c] for c in readers[oi])
                assert all(sunk[order[q]] for q in range(pos[oi], first))
        # the ops that stay keep their order
        stay = [oi for oi in range(n) if not sunk[oi] or not readers[oi]]
        assert [oi for oi in order if oi in stay] == stay


def test_remat_fuses_every_cheap_op_the_planner_only_the_tables_producers():
    assert fusible_producer("add") and fusible_producer("add", every_cheap_op=True)
    assert not fusible_producer("slice") and fusible_producer("slice", every_cheap_op=True)
    assert not fusible_producer("dot_general", every_cheap_op=True)
    assert not fusible_producer("reshape", {"dimensions": (1, 0)})
    assert not fusible_producer("remat[cond]", every_cheap_op=True)  # a recompute group


def test_remat_rewrites_share_the_programs_value_tables():
    def loss(ws, x):
        for w in ws:
            x = x + jnp.tanh(x @ w)
        return jnp.sum(x * x)

    ws = [jnp.ones((64, 64)) for _ in range(4)]
    graph = trace(jax.grad(loss), ws, jnp.ones((256, 64)))
    before = graph.program.num_values
    snaps = search(graph)
    assert len(snaps) > 1 and snaps[-1].peak < snaps[0].peak
    p = graph.program
    assert p.num_values > before  # recomputed copies are values of the one program
    assert all(p.producer[v] == RECOMPUTED for v in range(before, p.num_values))
    assert all(op.recompute for op in snaps[-1].graph.ops if op.body)
    assert profile(snaps[-1].graph).peak == snaps[-1].peak
