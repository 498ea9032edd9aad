"""Issue 12: runs of consecutive loop iterations under one jax.checkpoint. Each grouped candidate
is checked against the loop written by hand as fit prints it (JAX's FLOPs and values, XLA's own
memory_analysis()), and on XLA:GPU a group keeps less than any checkpoint per iteration at the
same FLOPs (a slow case)."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.compiler.costs import jaxpr_flops
from jaxmem.examples import mlp
from jaxmem.examples.adam import adam_update
from jaxmem.examples.layers import one_hot_cross_entropy
from jaxmem.fitting.policy import PolicyCandidate, find_sites, policy_expression, with_policy
from jaxmem.xla.cpu.compile import xla_reference
from test_fit_policy import _close

STRONG, CHEAP = "nothing_saveable", "dots_with_no_batch_dims_saveable"
SMALL = dict(depth=6, width=64, in_dim=32, classes=8, batch=32, activation="silu")


def _flops(fn, args) -> int:
    return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def grouped_by_hand(strong: str, k: int, cheap: str, **sizes):
    """examples/mlp.py's training step with its layer loop rewritten as fit prints a grouped
    answer: the loop in `layers(x, items)`, the first k items under one jax.checkpoint with
    `strong`, the others under one with `cheap` (k = 0: every item under one, with `strong`)."""
    fn, args = mlp.make_train_step(**sizes)
    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu}[sizes.get("activation", "relu")]
    a = eval(policy_expression(strong), {"jax": jax})
    b = eval(policy_expression(cheap), {"jax": jax})

    def forward(params, x):
        def layers(x, items):
            for layer in items:
                x = act(x @ layer["w"] + layer["b"])
            return x
        items = list(params[:-1])
        if k:
            x = jax.checkpoint(lambda x: layers(x, items[:k]), policy=a)(x)
            x = jax.checkpoint(lambda x: layers(x, items[k:]), policy=b)(x)
        else:
            x = jax.checkpoint(lambda x: layers(x, items), policy=a)(x)
        return x @ params[-1]["w"] + params[-1]["b"]

    def loss_fn(params, data):
        return one_hot_cross_entropy(forward(params, data["x"]), data["y"])

    def step(params, opt_state, data):
        loss, grads = jax.value_and_grad(loss_fn)(params, data)
        params, opt_state = adam_update(params, grads, opt_state)
        return params, opt_state, loss

    return step, args


@pytest.mark.parametrize("policy, k, rest", [(CHEAP, 0, "none"), (STRONG, 2, CHEAP)])
def test_grouped_candidate_is_the_loop_written_by_hand_as_printed(policy, k, rest):
    fn, args = mlp.make_train_step(**SMALL)
    (site,) = [s for s in find_sites(fn, args) if s.kind == "loop"]
    assert site.calls == SMALL["depth"]
    cand = PolicyCandidate("loop", policy, [site], None, 0, 0, keys=[site.key], first=k, rest=rest, grouped=True)
    code = cand.code
    assert "items = list(params[:-1])" in code and "for layer in items:" in code
    if k:
        assert f"x = jax.checkpoint(lambda x: layers(x, items[:{k}]), policy={policy_expression(policy)})(x)" in code
        assert f"x = jax.checkpoint(lambda x: layers(x, items[{k}:]), policy={policy_expression(rest)})(x)" in code
    else:
        assert f"x = jax.checkpoint(lambda x: layers(x, items), policy={policy_expression(policy)})(x)" in code
    grouped = cand.apply(fn)
    step, a = grouped_by_hand(policy, k, CHEAP if not k else rest, **SMALL)
    assert _flops(grouped, args) == _flops(step, a)
    assert xla_reference(grouped, args).total_bytes == xla_reference(step, a).total_bytes
    _close(jax.jit(fn)(*args), jax.jit(grouped)(*args))
    _close(jax.jit(fn)(*args), jax.jit(step)(*a))
    # Recompute grows with the group taken by nothing_saveable, one layer's forward dots per iteration.
    per_iteration = _flops(with_policy(fn, STRONG, ("loop",)), args)
    assert _flops(fn, args) <= _flops(grouped, args) < per_iteration


def test_two_groups_recompute_the_first_k_iterations_only():
    fn, args = mlp.make_train_step(**SMALL)
    (site,) = [s for s in find_sites(fn, args) if s.kind == "loop"]
    extra = []
    for k in (1, 2, 3):
        cand = PolicyCandidate("loop", STRONG, [site], None, 0, 0, keys=[site.key], first=k, rest=CHEAP, grouped=True)
        extra.append(_flops(cand.apply(fn), args) - _flops(fn, args))
    # Each iteration more in the recomputed group costs the same: one hidden layer's forward
    # product (its elementwise steps were recomputed in the cheap group already).
    layer = 2 * SMALL["batch"] * SMALL["width"] * SMALL["width"]
    step = extra[1] - extra[0]
    assert step == extra[2] - extra[1] and abs(step - layer) < layer / 50, (extra, layer)


GPU_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax
    from test_fit_groups import grouped_by_hand
    from jaxmem.compiler.costs import jaxpr_flops
    from jaxmem.examples import mlp
    from jaxmem.fitting.judge import Judge
    from jaxmem.fitting.policy import POLICIES, search_policies, with_policy
    from jaxmem.xla.gpu.compile import compile_for_gpu
    sizes = dict(depth=12, width=256, in_dim=256, classes=16, batch=512, activation="silu")
    fn, args = mlp.make_train_step(**sizes)
    judge = Judge("h100-80gb")
    base = jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)
    per_iteration = []
    for policy in POLICIES:   # a checkpoint on every iteration, or on all but the last
        for but_last in (False, True):
            cand = with_policy(fn, policy, ("loop",), None, but_last)
            per_iteration.append([judge.total(cand, args, ()),
                                  jaxpr_flops(jax.make_jaxpr(cand)(*args).jaxpr) - base])
    # Below every checkpoint per iteration that recomputes at most 15% of the FLOPs.
    budget = min(t for t, f in per_iteration if f <= 0.15 * base) - 1
    rows = []
    while len(rows) < 2:
        found = search_policies(fn, args, donate=(), judge=judge, budget=budget, reorder=False)
        best = found.best
        step, a = grouped_by_hand(best.policy, best.first, best.rest if best.first else best.policy, **sizes)
        d = compile_for_gpu(step, a, spec="h100_sxm", device="h100-80gb", use_cache=False)
        rows.append({{"budget": budget, "grouped": best.grouped, "first": best.first, "reported": best.xla_total_bytes,
                     "by_hand": d["argument_bytes"] + d["output_bytes"] + d["temp_bytes"] - d["alias_bytes"],
                     "flops": best.extra_flops / base, "code": best.code}})
        budget = best.xla_total_bytes - 2**20   # then 1 MiB below that group: the first iterations recomputed
    print(json.dumps({{"rows": rows, "per_iteration": per_iteration}}))
""")


@pytest.mark.slow  # XLA:GPU compiles of a 12-layer MLP step, about a minute here
def test_groups_meet_budgets_no_checkpoint_per_iteration_meets_and_pasted_give_their_totals(run_gpu_script):
    data = run_gpu_script(GPU_SCRIPT)
    whole, split = data["rows"]
    for row in (whole, split):
        assert row["grouped"] and row["reported"] == row["by_hand"] <= row["budget"], row["code"]
        assert row["flops"] <= 0.15, row
    # Below every checkpoint per iteration at up to +15% FLOPs: one group under a dots policy
    # (next to no recompute), then the first iterations recomputed as a group of their own.
    assert whole["first"] == 0 and whole["flops"] < 0.01, whole
    assert split["first"] >= 1 and split["reported"] < whole["reported"], split



REORDER_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax
    import numpy as np
    from test_fit_groups import grouped_by_hand
    from jaxmem.examples import suite
    from jaxmem.fitting.judge import Judge
    from jaxmem.fitting.policy import search_policies
    from jaxmem.fitting.reorder import reordered
    fn, args = suite.mlp_train()
    judge = Judge("h100-80gb")
    figures = judge.figures(fn, args, ())
    found = search_policies(fn, args, donate=(), judge=judge, budget=figures.half_temp, original_total=figures.total)
    best = found.best
    sizes = dict(depth=4, width=1024, in_dim=784, classes=10, batch=1024, activation="relu")
    step, a = grouped_by_hand(best.policy, best.first, best.rest if best.first else best.policy, **sizes)
    pasted = reordered(step, *a, order=best.order, device="h100-80gb")   # as the printed line says
    unordered = [c.xla_total_bytes for c in found.candidates if c.grouped and c.policy == best.policy
                 and c.first == best.first and not c.order]
    same = all(np.allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)
               for x, y in zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(jax.jit(pasted)(*a))))
    print(json.dumps({{"budget": figures.half_temp, "original": figures.total, "grouped": best.grouped,
                      "order": best.order, "reported": best.xla_total_bytes,
                      "pasted": judge.total(pasted, a, ()), "unordered": unordered, "same_values": same,
                      "flops": best.extra_flops_ratio, "code": best.code}}))
""")


@pytest.mark.slow  # XLA:GPU compiles and plans of mlp_train, about 40 s here
def test_a_group_run_in_the_plan_order_meets_mlp_trains_budget_and_pasted_gives_its_total(run_gpu_script):
    data = run_gpu_script(REORDER_SCRIPT)
    # XLA's own order of the group holds what the original holds; the plan's order meets the
    # budget, at next to no extra FLOPs, as the printed code pasted by hand.
    assert data["grouped"] and data["order"], data["code"]
    assert data["unordered"] and min(data["unordered"]) > data["budget"], data
    assert data["pasted"] == data["reported"] <= data["budget"] < data["original"], data
    assert data["flops"] < 0.01 and data["same_values"], data


def _two_carry_loss(params, x):
    """A loop with a tuple target and two carried values, as users write residual stacks."""
    h = jnp.zeros_like(x)
    for i, layer in enumerate(params):
        h = h + jnp.tanh(x @ layer["w"]) * (1.0 + i)
        x = jax.nn.silu(h @ layer["v"])
    return jnp.sum(x * h)


def _two_carry_by_hand(k: int):
    a = eval(policy_expression(STRONG), {"jax": jax})
    b = eval(policy_expression(CHEAP), {"jax": jax})

    def loss(params, x):   # as printed: the loop in layers(h, x, items), two runs of items
        h = jnp.zeros_like(x)

        def layers(h, x, items):
            for i, layer in items:
                h = h + jnp.tanh(x @ layer["w"]) * (1.0 + i)
                x = jax.nn.silu(h @ layer["v"])
            return (h, x)
        items = list(enumerate(params))
        (h, x) = jax.checkpoint(lambda h, x: layers(h, x, items[:k]), policy=a)(h, x)
        (h, x) = jax.checkpoint(lambda h, x: layers(h, x, items[k:]), policy=b)(h, x)
        return jnp.sum(x * h)

    return loss


def test_grouped_code_for_a_tuple_target_and_two_carried_values_runs_as_printed():
    rng = np.random.default_rng(0)
    params = [{"w": jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32),
               "v": jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32)} for _ in range(4)]
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    step = jax.grad(_two_carry_loss)
    (site,) = [s for s in find_sites(step, (params, x)) if s.kind == "loop"]
    cand = PolicyCandidate("loop", STRONG, [site], None, 0, 0, keys=[site.key], first=2, rest=CHEAP, grouped=True)
    code = cand.code
    # The carried names in the order the body reads them: h first.
    assert "def layers(h, x, items):" in code and "for i, layer in items:" in code and "return (h, x)" in code
    assert "items = list(enumerate(params))" in code
    assert f"(h, x) = jax.checkpoint(lambda h, x: layers(h, x, items[:2]), policy={policy_expression(STRONG)})(h, x)" in code
    by_hand = jax.grad(_two_carry_by_hand(2))
    grouped = cand.apply(step)
    assert _flops(grouped, (params, x)) == _flops(by_hand, (params, x)) > _flops(step, (params, x))
    _close(jax.jit(step)(params, x), jax.jit(grouped)(params, x))
    _close(jax.jit(step)(params, x), jax.jit(by_hand)(params, x))
