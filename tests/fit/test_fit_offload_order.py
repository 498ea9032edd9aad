"""Issue 12: reordering with values held in pinned host memory (`fitting.reorder`, the
"offloaded" orders). `offloaded_gaps` picks, at the plan's peak, values idle across it; the
ordered function copies each out after its last use before that stretch and back before the
step that ends it, both copies tied into the plan's order. Checked against the schedule
itself (no reader inside a stretch), JAX's own values (run on this CPU, whose pinned host
memory is real), and XLA:GPU's totals (deviceless)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.planner import plan_jaxpr
from jaxmem.fitting.judge import values_equal
from jaxmem.fitting.reorder import OFFLOAD_MIN_SHARE, offloaded_gaps, ordered_function, readers_first


def mlp_step(depth: int = 4, width: int = 128, batch: int = 256):
    """A relu MLP's loss, gradient and SGD update, the weights donated: its activations wait
    between the forward and the backward pass."""
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width))
          for _ in range(depth)]
    x = jnp.asarray(rng.standard_normal((batch, width), dtype=np.float32))

    def loss(ws, x):
        for w in ws:
            x = jax.nn.relu(x @ w)
        return jnp.mean(x ** 2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return [w - 0.1 * g for w, g in zip(ws, grads)], value

    return step, (ws, x), (0,)


def _planned(step, args, donate):
    traced = ja.trace(step, args, donate_argnums=donate)
    donated = [k in traced.donated for k in range(len(traced.in_avals))]
    return traced, plan_jaxpr(traced.closed_jaxpr, donated=donated, check=False)


def _live(plan, schedule, gaps):
    """Bytes of stored values live at each position of `schedule`, counted from the schedule's
    own reads, with each value in `gaps` absent strictly inside its stretch."""
    n = len(schedule)
    live = np.zeros(n, dtype=np.int64)
    made = {o: pos for pos, st in enumerate(schedule) for o in st.outputs if o is not None}
    for v, pos in made.items():
        info = plan.values[v]
        if info.buffer is None:
            continue
        reads = [p for p, st in enumerate(schedule) if v in st.inputs]
        end = max(reads, default=pos)
        live[pos:end + 1] += info.nbytes
        if v in gaps:
            a, b = gaps[v]
            live[a + 1:b] -= info.nbytes
    return live


def test_offloaded_values_are_idle_in_their_stretch_and_the_peak_falls():
    step, args, donate = mlp_step()
    _, plan = _planned(step, args, donate)
    schedule, _ = readers_first(plan)
    gaps = offloaded_gaps(plan, schedule, plan.outvars)
    assert gaps, "the activations wait across the backward pass's peak"
    outputs = {v for v in plan.outvars if v is not None}
    for v, (a, b) in gaps.items():
        assert v not in outputs and plan.values[v].producer is not None
        assert plan.values[v].nbytes >= plan.peak_bytes * OFFLOAD_MIN_SHARE
        uses = [p for p, st in enumerate(schedule) if v in st.inputs or v in st.outputs]
        assert a in uses and b in uses and not [p for p in uses if a < p < b], (v, a, b, uses)
        assert b - a >= 2
    before, after = _live(plan, schedule, {}), _live(plan, schedule, gaps)
    assert after.max() < before.max()
    assert (before - after).max() >= max(plan.values[v].nbytes for v in gaps)


def test_the_offloaded_order_keeps_values_and_every_tie():
    """Run on this CPU: the copies to pinned host memory and back return the same values, and
    every barrier's results are read later (XLA drops a barrier's unused result, and the tie
    with it), except a scalar constant's, whose tie keeps it apart on purpose
    (`ordered_function`'s `tie_constants`)."""
    step, args, donate = mlp_step()
    traced, plan = _planned(step, args, donate)
    ordered = ordered_function(plan, traced, offload=True)
    assert values_equal(jax.jit(step)(*args), jax.jit(ordered)(*args))
    gaps = offloaded_gaps(plan, readers_first(plan)[0], plan.outvars)
    assert ordered.offloaded_bytes == sum(plan.values[v].nbytes for v in gaps) > 0
    jaxpr = jax.make_jaxpr(ordered)(*args).jaxpr
    puts = [e for e in jaxpr.eqns if e.primitive.name == "device_put"]
    assert len(puts) == 2 * len(gaps)
    read = {str(v) for e in jaxpr.eqns for v in e.invars} | {str(v) for v in jaxpr.outvars}
    for e in jaxpr.eqns:
        if e.primitive.name == "optimization_barrier" and not isinstance(e.invars[0], jax.extend.core.Literal):
            assert all(str(v) in read for v in e.outvars), e


def test_no_offload_where_nothing_waits_across_the_peak():
    """A forward pass alone: every value dies at its next step, so no order holds one in host
    memory and the offloaded candidate is not offered."""
    from jaxmem.fitting.reorder import candidates

    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((128, 128), dtype=np.float32))

    def forward(w, x):
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return x

    _, plan = _planned(forward, (w, jnp.ones((256, 128), jnp.float32)), ())
    assert offloaded_gaps(plan, readers_first(plan)[0], plan.outvars) == {}
    assert [c[0] for c in candidates({"cpu plan": plan}, offload=True)] == ["cpu plan order", "constants only"]


def test_mlp_train_donated_offloaded_in_order_on_xla_gpu(run_gpu_script):
    """mlp_train_donated on H100: the plan's order with its activations and relu masks held in
    host memory is kept, far below the step as written and its order without offload; it is
    rebuilt by `reordered` to the same total, keeps the values, and stays at or above the
    bound with offload (a variant that bound was not written against)."""
    got = run_gpu_script(r'''
import json
import jax
from jaxmem.examples.suite import ALL_PROGRAMS
from jaxmem.fitting.bound import lower_bound
from jaxmem.fitting.judge import Judge, values_equal
from jaxmem.fitting.reorder import reorder, reordered
program = ALL_PROGRAMS["mlp_train_donated"]
fn, args = program.factory()
donate = program.donate_argnums
judge = Judge("h100-80gb")
figures = judge.figures(fn, args, donate)
found = reorder(fn, *args, donate_argnums=donate, device="h100-80gb", before=figures.total)
again = judge.total(reordered(fn, *args, order=found.order, donate_argnums=donate, device="h100-80gb"), args, donate)
bound = lower_bound(fn, args, donate, figures.floor, host_offload=True)
print(json.dumps({{"order": found.order, "after": found.xla_total_bytes_after, "candidates": found.candidates,
                  "original": figures.total, "again": again, "bound": bound.bytes,
                  "offloaded": found.offloaded_bytes,
                  "equal": values_equal(jax.jit(fn)(*args), jax.jit(found.fn)(*args))}}))
''')
    assert got["order"] == "cpu plan order, offloaded", got
    mib = 2 ** 20
    assert got["after"] <= got["candidates"]["cpu plan order"] - 8 * mib, got
    assert got["after"] <= got["original"] - 8 * mib, got
    assert got["again"] == got["after"] and got["equal"], got
    assert got["bound"] <= got["after"], got
    assert got["offloaded"] >= 12 * mib, got
