"""What NNX adds to a step written like google/flax#5116's over the same step written pure, by
source line, and the change that removes it: checked against the program JAX itself compiles for
that change, and against the step written pure by hand."""

from __future__ import annotations

import inspect

import jax
import pytest

import jaxmem
from flax import nnx

import flax_5116_like as case


@pytest.fixture(scope="module")
def analysed():
    model, optimizer, x, y = case.build()
    result = jaxmem.analyze(nnx.jit(case.nnx_train_step), model, optimizer, x, y, device="8GiB", quiet=True)
    return result, (model, optimizer, x, y)


def _bytes(tree):
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def _line_of(marker):
    source, _ = inspect.getsourcelines(case)   # a module's lines, from its first
    return next(i + 1 for i, text in enumerate(source) if marker in text)


def test_the_state_not_donated_is_the_models_and_optimizers_by_the_update_line(analysed):
    result, (model, optimizer, _, _) = analysed
    found = result.framework
    assert found["name"] == "Flax NNX" and found["step"] == "nnx_train_step"
    state = next(item for item in found["adds"] if item["what"] == "state not donated")
    assert state["bytes"] == _bytes(nnx.state(model, nnx.Param)) + _bytes(nnx.state(optimizer))
    assert [line["source"].rsplit(":", 1)[0].endswith("flax_5116_like.py") for line in state["lines"]] == [True]
    assert state["lines"][0]["source"].endswith(f":{_line_of('# UPDATE LINE')} (nnx_train_step)")


def test_the_donation_change_is_the_program_jax_compiles_for_it_with_the_same_results(analysed):
    result, (model, optimizer, x, y) = analysed
    change = next(c for c in result.framework["changes"] if "donate" in c["code"])
    assert change["code"] == "nnx.jit(nnx_train_step, donate_argnames=('model', 'optimizer'))"
    changed = nnx.jit(case.nnx_train_step, donate_argnames=("model", "optimizer"))
    analysis = changed.lower(model, optimizer, x, y).compile().memory_analysis()
    total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
             + analysis.temp_size_in_bytes)
    assert change["xla"]["total_bytes"] == total
    assert change["same_results"] is True and change["lowers_peak"]
    assert change["saved_bytes"] == result.pool["peak_bytes"] - change["pool_peak_bytes"] > 0


def test_the_step_written_pure_by_hand_needs_what_jaxmem_says(analysed):
    result, (model, optimizer, x, y) = analysed
    step, state = case.pure_step(model, optimizer)
    by_hand = jaxmem.analyze(step, state, x, y, device="8GiB", quiet=True)
    pure = result.framework["pure_pool_peak_bytes"]
    assert abs(pure / by_hand.pool["peak_bytes"] - 1) < 0.001
    assert result.framework["added_bytes"] == result.pool["peak_bytes"] - pure > 0


def test_the_users_model_is_as_it_was(analysed):
    _, (model, optimizer, x, y) = analysed
    fresh, fresh_optimizer, _, _ = case.build()
    same = jax.tree.map(lambda a, b: bool((a == b).all()), nnx.state(model), nnx.state(fresh))
    assert all(jax.tree.leaves(same))


def test_the_report_shows_it(analysed):
    result, _ = analysed
    text = result.text(width=200)
    assert "What Flax NNX adds to nnx_train_step over the same step written pure" in text
    assert "state not donated" in text and "nnx.jit(nnx_train_step, donate_argnames=('model', 'optimizer'))" in text
    assert "same: 81 arrays equal" in text
    assert "What Flax NNX adds to nnx_train_step" in result.html() and "donate_argnames" in result.html()


def test_a_plain_jit_step_with_its_state_not_donated_gets_the_donation_to_paste():
    import jax.numpy as jnp

    def sgd(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    w, x = jnp.ones((512, 512)), jnp.ones((64, 512))
    quiet = jaxmem.analyze(jax.jit(sgd), w, x, device="8GiB", quiet=True)
    assert quiet.framework is None   # plain JAX: weighed only where asked
    result = jaxmem.analyze(jax.jit(sgd), w, x, device="8GiB", quiet=True, costs=True)
    change = result.framework["changes"][0]
    assert change["code"] == "jax.jit(sgd, donate_argnums=(0,))" and change["same_results"] is True
    donated = jax.jit(sgd, donate_argnums=0).lower(w, x).compile().memory_analysis()
    assert change["xla"]["alias_bytes"] == donated.alias_size_in_bytes == 512 * 512 * 4


def test_an_equinox_step_gets_filter_jits_donation():
    import equinox as eqx
    import jax.numpy as jnp
    import optax

    mlp = eqx.nn.MLP(256, 10, 512, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    adam = optax.adam(1e-3)

    @eqx.filter_jit
    def step(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = adam.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    opt_state = adam.init(eqx.filter(mlp, eqx.is_array))
    result = jaxmem.analyze(step, mlp, opt_state, jnp.ones((128, 256)), device="8GiB", quiet=True)
    found = result.framework
    assert found["name"] == "Equinox"
    state = next(item for item in found["adds"] if item["what"] == "state not donated")
    assert state["bytes"] == _bytes(eqx.filter(mlp, eqx.is_array)) + _bytes(opt_state)
    change = found["changes"][0]
    assert change["code"] == 'eqx.filter_jit(step, donate="all")' and change["same_results"] is True
    assert change["lowers_peak"] and change["xla"]["alias_bytes"] > 0
