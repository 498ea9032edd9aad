"""Issue 12: the user's own `jax.checkpoint` as a site (kind "own"). A MaxText-style scan body
already under `jax.checkpoint(layer)` keeps its policy whatever fit wraps around it; fit now
also tries that checkpoint with another policy, as the user would write it, and says how many
FLOPs it saves. Checked against the step written by hand with that policy: the same jaxpr, the
same values, the same XLA total."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from bound_programs import scanned_lm
from jaxmem.fitting.policy import search_policies, with_policy
from jaxmem.fitting.sites import own_checkpoints

POLICIES = ["dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable"]


def _small(policy: str | None = "default"):
    return scanned_lm(policy, layers=3, seq=64)


def test_the_users_checkpoint_is_found_with_its_function_and_policy():
    fn, args = _small()
    (site,) = own_checkpoints(jax.make_jaxpr(fn)(*args))
    assert site.kind == "own" and site.function == "layer" and site.written is None
    assert site.call.file.endswith("bound_programs.py") and site.defined.split(":")[0].endswith("bound_programs.py")
    fn, args = _small("dots_saveable")
    (site,) = own_checkpoints(jax.make_jaxpr(fn)(*args))
    assert site.written is jax.checkpoint_policies.dots_saveable
    fn, args = _small(None)
    assert own_checkpoints(jax.make_jaxpr(fn)(*args)) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_replacing_the_users_policy_is_the_step_written_with_it(policy):
    fn, args = _small()
    replaced = with_policy(fn, policy, ("own",))
    by_hand, _ = _small(policy)
    assert str(jax.make_jaxpr(replaced)(*args)) == str(jax.make_jaxpr(by_hand)(*args))
    got, want = jax.jit(replaced)(*args), jax.jit(fn)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Outside the candidate, the user's own policy is back.
    assert str(jax.make_jaxpr(fn)(*args)) != str(jax.make_jaxpr(by_hand)(*args))


def test_fit_offers_a_cheaper_policy_for_the_users_checkpoint_where_memory_allows():
    """XLA:CPU, a budget every candidate meets: the answer is the user's checkpoint with the
    policy that recomputes least, at fewer FLOPs than the step as written."""
    from jaxmem.fitting.judge import Judge

    fn, args = _small()
    judge = Judge(None)
    total = judge.total(fn, args, (0, 1))
    found = search_policies(fn, args, donate=(0, 1), judge=judge, budget=4 * total)
    best = found.best
    assert best.kind == "own" and best.extra_flops < 0, (best.kind, best.policy, best.extra_flops)
    assert best.xla_total_bytes <= 4 * total
    assert f"jax.checkpoint(layer, policy=jax.checkpoint_policies.{best.policy})" in best.code
    # What it prints, written by hand, gives the total it reports.
    by_hand, _ = _small(best.policy)
    assert judge.total(by_hand, args, (0, 1)) == best.xla_total_bytes
    # The default policy saves what nothing_saveable saves: not tried again.
    assert not any(c.kind == "own" and c.policy == "nothing_saveable" for c in found.candidates)


def test_a_flax_remat_under_nn_scan_is_a_site_and_its_policy_is_said_in_flax_terms():
    """Flax linen's nn.remat inside nn.scan: the checkpoint JAX records was made in Flax's own
    code; replacing its policy saves the dots (fewer FLOPs than the step as written, the
    residuals the policy keeps), and the line to write names nn.remat's policy argument."""
    import flax.linen as nn
    import jax.numpy as jnp

    from jaxmem.compiler.costs import jaxpr_flops
    from jaxmem.fitting.policy import PolicyCandidate

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x)))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            return stack()(x, None)[0]

    model = Model()
    x = jnp.ones((4, 16, 32))
    params = model.init(jax.random.key(0), x)

    def step(p, x):
        return jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(p)

    closed = jax.make_jaxpr(step)(params, x)
    (site,) = own_checkpoints(closed)
    replaced = with_policy(step, "dots_saveable", ("own",))
    assert jaxpr_flops(jax.make_jaxpr(replaced)(params, x).jaxpr) < jaxpr_flops(closed.jaxpr)
    for a, b in zip(jax.tree.leaves(jax.jit(replaced)(params, x)), jax.tree.leaves(jax.jit(step)(params, x))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    line = PolicyCandidate("own", "dots_saveable", [site], None, 0, 0).code
    assert "nn.remat(Module, policy=...)" in line and "jax.checkpoint_policies.dots_saveable" in line
