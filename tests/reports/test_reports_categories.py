"""Categories come from the program's structure: checked against what the test built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.compiler.planner import plan as jaxmem_plan
from jaxmem.reports.categories import CATEGORIES, argument_reasons, is_backward, value_categories
from reports_fixtures import naive_plan, train_step_example


def _flat_arg_slices(args):
    out, start = [], 0
    for a in args:
        n = len(jax.tree.leaves(a))
        out.append(range(start, start + n))
        start += n
    return out


def _check_train_step(plan, args):
    cats = value_categories(plan)
    assert set(cats) == set(plan.values) and set(cats.values()) <= set(CATEGORIES)
    params, mu, nu, x, y = _flat_arg_slices(args)
    flat_cat = [cats[v] for v in plan.invars]
    assert all(flat_cat[i] == "parameters" for i in params)
    assert all(flat_cat[i] == "inputs" for i in [*x, *y])      # the batch is only read
    assert all(flat_cat[i] == "optimizer_state" for i in [*mu, *nu])
    # One gradient per parameter, of the parameter's shape: what jax.grad returns.
    param_shapes = sorted(tuple(p.shape) for p in args[0])
    grads = [v for v, c in cats.items() if c == "gradients"]
    grad_shapes = sorted(plan.values[v].shape for v in grads)
    assert grad_shapes == param_shapes
    # Residuals are made in the forward part and exist only because there is a backward part.
    residuals = [v for v, c in cats.items() if c == "residuals"]
    assert residuals
    for v in residuals:
        assert not is_backward(plan.schedule[plan.values[v].producer])
    outs = {v for v in plan.outvars if v is not None}
    assert all(cats[v] in ("outputs", "gradients") for v in outs)
    return cats


def test_train_step_categories_naive_plan():
    fn, args = train_step_example()
    _check_train_step(naive_plan(fn, *args), args)


def test_train_step_categories_jaxmem_plan():
    fn, args = train_step_example()
    _check_train_step(jaxmem_plan(fn, *args, xla=False), args)


def test_inference_has_no_residuals_gradients_or_optimizer_state():
    def forward(w, x):
        return jnp.tanh(x @ w).sum(axis=0)

    plan = naive_plan(forward, jnp.ones((32, 32)), jnp.ones((8, 32)))
    cats = value_categories(plan)
    assert set(cats.values()) <= {"parameters", "temporaries", "outputs"}
    assert [cats[v] for v in plan.invars] == ["parameters", "parameters"]


def test_grad_function_returns_gradients():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    plan = naive_plan(jax.grad(loss), jnp.ones((16, 16)), jnp.ones((4, 16)))
    cats = value_categories(plan)
    assert [cats[v] for v in plan.outvars] == ["gradients"]
    assert any(c == "residuals" for c in cats.values())


def test_pytree_paths_name_optimizer_state():
    def update(p, state):
        return p - 0.1 * state, state * 0.9

    plan = naive_plan(update, jnp.ones(8), jnp.ones(8))
    assert [value_categories(plan)[v] for v in plan.invars] == ["parameters", "parameters"]
    cats = value_categories(plan, arg_paths=["params['w']", "opt_state.mu['w']"])
    assert [cats[v] for v in plan.invars] == ["parameters", "optimizer_state"]


def test_gpt_train_step_categories():
    from jaxmem.examples.gpt import make_train_step

    fn, args = make_train_step(n_layers=2, d_model=64, n_heads=2, seq=16, batch=2, vocab=128)
    plan = jaxmem_plan(fn, *args, xla=False)
    cats = value_categories(plan)
    params, opt_state, batch = _flat_arg_slices(args)
    flat_cat = [cats[v] for v in plan.invars]
    assert all(flat_cat[i] == "parameters" for i in params)
    assert all(flat_cat[i] == "inputs" for i in batch)
    # Adam's moments and its step counter are optimizer state (found from structure alone).
    assert all(flat_cat[i] == "optimizer_state" for i in opt_state)
    param_bytes = sorted(int(np.prod(p.shape)) for p in jax.tree.leaves(args[0]))
    grad_sizes = sorted(int(np.prod(plan.values[v].shape)) for v, c in cats.items() if c == "gradients")
    # Each parameter has a gradient in memory unless the fusion model keeps it out (then none).
    assert set(grad_sizes) <= set(param_bytes) and grad_sizes


def test_a_batch_of_the_parameters_shape_is_still_an_input():
    # A VAE-style step: the batch is float32[256, 64] and so is a weight; position and shape say
    # nothing, data flow does (the weight's update is returned, the batch is only read).
    def step(params, x):
        def loss(p):
            z = jnp.tanh(x @ p["enc"].T)
            return jnp.mean((z @ p["dec"] - x) ** 2)
        g = jax.grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, d: p - 0.01 * d, params, g)

    params = {"dec": jnp.ones((256, 64)) * 0.01, "enc": jnp.ones((256, 64)) * 0.02}
    x = jnp.ones((256, 64))
    plan = naive_plan(step, params, x)
    cats, why = value_categories(plan), argument_reasons(plan)
    assert [cats[v] for v in plan.invars] == ["parameters", "parameters", "inputs"]
    assert [why[v] for v in plan.invars] == ["its updated value is returned"] * 2 + [
        "only read: the step returns no updated value of it"]


def test_state_a_program_updates_in_place_is_a_parameter_and_the_rest_says_why():
    def decode(cache, token, w):                  # no backward part: a KV-cache style update
        return jax.lax.dynamic_update_slice(cache, (token @ w)[None], (3, 0)), (token @ w).sum()

    plan = naive_plan(decode, jnp.zeros((8, 16)), jnp.ones((16,)), jnp.ones((16, 16)))
    why = argument_reasons(plan)
    assert [value_categories(plan)[v] for v in plan.invars] == ["parameters"] * 3
    assert why[plan.invars[0]] == "its updated value is returned"
    assert "without a backward pass" in why[plan.invars[1]] and "without a backward pass" in why[plan.invars[2]]
