"""Op-by-op runs on a Device: results, the recorded trace, and the per-allocator summaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from execution_oracle import max_rel_error
from jaxmem.examples import control, mlp, rnn
from jaxmem.execution.verify import compare_with_jit, eager_summaries
from jaxmem.traces.model import Trace


def _mlp():
    return mlp.make_train_step(depth=2, width=64, in_dim=32, classes=10, batch=16)


@pytest.mark.parametrize("backend, make", [
    ("host", _mlp), ("simulated", _mlp),
    ("host", lambda: rnn.make_loss_and_grad(batch=4, seq=6, in_dim=8, hidden=16)),
    ("simulated", lambda: control.make_while_cond(n=32, k=4)),
])
def test_eager_results_match_jax(backend, make):
    fn, args = make()
    device = jaxmem.Device("256MiB", backend=backend, allocator="bfc", preallocate=False)
    run = jaxmem.eager(fn, device)(*args)
    assert run.fits and run.oom is None
    reference = jax.jit(fn)(*args)
    assert jax.tree_util.tree_structure(run.outputs) == jax.tree_util.tree_structure(reference)
    assert max_rel_error(run.outputs, reference) < 1e-3  # op by op rounds apart from jit's fusions
    if make is _mlp and backend == "simulated":
        with jax.disable_jit():
            op_by_op = fn(*args)
        assert max_rel_error(run.outputs, op_by_op) < 1e-3
    assert device.memory_stats()["bytes_in_use"] == 0  # everything given back at the end


def test_trace_replays_to_the_recorded_peak():
    fn, args = _mlp()
    device = jaxmem.Device("256MiB", backend="simulated", allocator="platform")
    run = jaxmem.eager(fn, device)(*args)
    trace = run.trace
    assert isinstance(trace, Trace) and trace.format == "jaxmem"
    live, in_use, peak = {}, 0, 0
    for e in trace.events:
        if e.action == "alloc":
            assert e.addr not in live, "an address handed out twice while live"
            live[e.addr] = e.size
            in_use += e.size
            peak = max(peak, in_use)
            assert e.label and e.requested and e.requested <= e.size
        elif e.action == "free":
            assert live.pop(e.addr) == e.size
            in_use -= e.size
    assert not live, "every allocation is freed by the end"
    assert peak == run.peak_bytes_in_use == run.stats["peak_bytes_in_use"]
    assert run.num_allocs == sum(e.action == "alloc" for e in trace.events)
    labels = {e.label for e in trace.events if e.action == "alloc"}
    assert {"argument", "dot_general"} <= labels


def test_peak_equals_brute_force_liveness():
    # Independent truth: the largest sum of live result sizes (rounded as the allocator rounds).
    def f(x):
        a = jnp.sin(x)          # 4 KiB
        b = a @ a               # 4 KiB, a dies here (its last use)
        c = jnp.tanh(b) + 1.0   # tanh then add
        return c.sum()

    x = np.ones((32, 32), np.float32)
    device = jaxmem.Device("64MiB", allocator="platform")
    run = jaxmem.eager(f, device)(x)
    # arg x lives throughout (4096); sin -> a (4096); dot -> b (4096) while a, x live: 12288;
    # then a dies; tanh -> t (4096): x, b, t = 12288; add -> c: x, t, c (b dead) = 12288
    assert run.peak_bytes_in_use == 3 * 4096
    np.testing.assert_allclose(run.outputs, f(x), rtol=1e-5)


def test_out_of_memory_is_reported_not_raised():
    fn, args = _mlp()
    device = jaxmem.Device("64KiB", allocator="bfc")
    run = jaxmem.eager(fn, device)(*args)
    assert not run.fits and run.outputs is None
    assert "op by op" in str(run.oom)
    assert run.trace.events[-1].action in ("oom", "free")


def test_simulating_only_allocations_gives_the_same_sequence():
    fn, args = _mlp()
    runs = [jaxmem.eager(fn, jaxmem.Device("1GiB", allocator="bfc-growth"), compute=c)(*args) for c in (True, False)]
    seq = [[(e.action, e.addr, e.size) for e in r.trace.events] for r in runs]
    assert seq[0] == seq[1]
    assert runs[1].outputs is None


def test_eager_summaries_per_allocator_mode():
    fn, args = _mlp()
    rows = eager_summaries(fn, args, "1GiB")
    assert [r["allocator"] for r in rows] == ["bfc", "bfc-growth", "platform"]
    keys = {"allocator", "peak_bytes_in_use", "peak_pool_bytes", "largest_free_block_bytes",
            "fragmentation_at_peak", "num_allocs", "device_allocs", "fits"}
    for r in rows:
        assert keys <= set(r) and r["fits"]
        assert r["peak_pool_bytes"] >= r["peak_bytes_in_use"] > 0
        assert 0.0 <= r["fragmentation_at_peak"] <= 1.0
    by = {r["allocator"]: r for r in rows}
    assert by["bfc"]["device_allocs"] == 1                        # one preallocated region
    assert by["bfc"]["peak_pool_bytes"] == int(0.75 * (1 << 30))
    assert by["platform"]["device_allocs"] == by["platform"]["num_allocs"]
    assert len({r["num_allocs"] for r in rows}) == 1               # same requests under each
    tight = eager_summaries(fn, args, 64 * 1024)
    assert not any(r["fits"] for r in tight)


def test_compare_with_jit_contract():
    fn, args = mlp.make_forward(depth=2, width=64, in_dim=32, classes=10, batch=16)
    plan = jaxmem.plan(fn, *args, xla=False)
    result = compare_with_jit(fn, args, plan)
    assert {"ok", "max_abs_err", "max_rel_err", "seconds", "jax_jit_seconds"} <= set(result)
    assert result["ok"] is True and result["max_rel_err"] < 1e-5
    assert result["seconds"] > 0 and result["jax_jit_seconds"] > 0


def test_eager_refuses_what_is_not_a_device():
    with pytest.raises(jaxmem.PlanError):
        jaxmem.eager(lambda x: x, "a100-40gb")


def test_loop_scratch_cache_is_bounded_and_keeps_its_equations(monkeypatch):
    from jaxmem.compiler.jaxpr_adapter import inline, trace
    from jaxmem.execution import eager

    monkeypatch.setattr(eager, "_SCRATCH", {})
    monkeypatch.setattr(eager, "_SCRATCH_LIMIT", 2)
    loops = []
    for k in range(3):
        prog = inline(trace(lambda x, k=k: jax.lax.fori_loop(0, k + 2, lambda i, c: jnp.sin(c) * 2, x),
                            (np.ones(8, np.float32),)).closed_jaxpr)
        loops += [op.eqn for op in prog.ops if op.primitive in ("while", "scan")]
    sizes = [eager._scratch_bytes(eqn) for eqn in loops]
    assert len(loops) == 3 and all(s >= 0 for s in sizes)
    assert len(eager._SCRATCH) == 2                      # the oldest went
    assert all(entry[0] is eqn for eqn in loops[1:] for entry in [eager._SCRATCH[id(eqn)]])
