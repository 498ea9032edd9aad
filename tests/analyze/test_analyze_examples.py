"""The example models compute what they claim: checked against numpy and against JAX itself."""

from __future__ import annotations

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.examples import adam, cnn, control, gpt, layers, mlp, rnn

MODULES = ["adam", "layers", "gpt", "mlp", "cnn", "rnn", "control", "suite"]


@pytest.mark.slow   # the examples run op by op (no jit): seconds each on a shared CPU
@pytest.mark.parametrize("name", MODULES)
def test_analyze_examples_docstrings_run(name):
    module = importlib.import_module(f"jaxmem.examples.{name}")
    if name == "gpt":   # default_example's doctest builds the full model; covered by the CLI tests
        return
    failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0 and tried > 0


def test_analyze_adam_matches_a_numpy_reference():
    rng = np.random.default_rng(3)
    p = rng.standard_normal(5).astype(np.float32)
    params, state = {"w": jnp.asarray(p)}, adam.adam_init({"w": jnp.asarray(p)})
    m = v = np.zeros(5, np.float32)
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    for t in range(1, 4):
        g = rng.standard_normal(5).astype(np.float32)
        params, state = adam.adam_update(params, {"w": jnp.asarray(g)}, state, lr=lr)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    np.testing.assert_allclose(np.asarray(params["w"]), p, rtol=1e-5, atol=1e-6)
    assert int(state["step"]) == 3


def test_analyze_layernorm_and_attention_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(layers.layernorm(jnp.asarray(x), jnp.ones(8), jnp.zeros(8)),
                               (x - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)
    w_qkv, w_o = rng.standard_normal((8, 24)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
    got = np.asarray(layers.causal_attention(jnp.asarray(x), jnp.asarray(w_qkv), jnp.zeros(24),
                                             jnp.asarray(w_o), jnp.zeros(8), n_heads=2))
    # Reference: loop over batch, head and query position, attending to positions <= query.
    q, k, v = np.split(x @ w_qkv, 3, axis=-1)
    out = np.zeros_like(x)
    for b in range(2):
        for h in range(2):
            sl = slice(4 * h, 4 * h + 4)
            for i in range(5):
                s = q[b, i, sl] @ k[b, : i + 1, sl].T / 2.0
                p = np.exp(s - s.max())
                out[b, i, sl] = (p / p.sum()) @ v[b, : i + 1, sl]
    np.testing.assert_allclose(got, out @ w_o, rtol=1e-4, atol=1e-4)


def test_analyze_gpt_is_causal_and_starts_near_uniform():
    params = gpt.init_params(n_layers=2, d_model=32, n_heads=4, seq=8, vocab=64)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8), dtype=np.int32))
    changed = tokens.at[:, 5:].set((tokens[:, 5:] + 1) % 64)
    forward = jax.jit(gpt.forward, static_argnames="n_heads")
    a, b = forward(params, tokens, n_heads=4), forward(params, changed, n_heads=4)
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 5:], b[:, 5:])
    loss = jax.jit(gpt.loss_fn, static_argnames="n_heads")(params, {"tokens": tokens, "targets": tokens}, n_heads=4)
    assert abs(float(loss) - np.log(64)) < 0.5


@pytest.mark.parametrize("make", [
    lambda: gpt.make_train_step(n_layers=1, d_model=32, n_heads=2, seq=8, batch=4, vocab=32, lr=1e-2),
    pytest.param(lambda: gpt.make_train_step(n_layers=1, d_model=32, n_heads=4, seq=8, batch=4, vocab=32, lr=1e-2,
                                             tied=False, norm="rmsnorm", exact_gelu=True), marks=pytest.mark.slow),
    lambda: mlp.make_train_step(depth=2, width=32, in_dim=16, classes=4, batch=32, lr=1e-2),
    lambda: cnn.make_train_step(batch=4, size=8, channels=(4, 8), classes=3, lr=1e-2),
], ids=["gpt", "gpt_untied_rms", "mlp", "cnn"])
def test_analyze_training_steps_lower_the_loss(make):
    fn, (params, state, data) = make()
    step = jax.jit(fn)
    start = int(state["step"])
    losses = []
    for _ in range(8):
        params, state, loss = step(params, state, data)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert int(state["step"]) == start + 8


def test_analyze_rnn_gradient_matches_finite_differences():
    fn, (params, xs, ys) = rnn.make_loss_and_grad(batch=2, seq=4, in_dim=3, hidden=5)
    fn = jax.jit(fn)
    f64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), (params, xs, ys))
    loss, grads = fn(*args_f32(f64))
    eps, (p, x, y) = 1e-3, f64
    bumped = {**p, "w_h": p["w_h"].copy()}
    bumped["w_h"][1, 2] += eps
    lower = {**p, "w_h": p["w_h"].copy()}
    lower["w_h"][1, 2] -= eps
    numeric = (float(fn(*args_f32((bumped, x, y)))[0]) - float(fn(*args_f32((lower, x, y)))[0])) / (2 * eps)
    assert abs(float(grads["w_h"][1, 2]) - numeric) < 1e-2 * max(1.0, abs(numeric))


def args_f32(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)


def test_analyze_pooling_matches_numpy():
    x = np.random.default_rng(1).standard_normal((2, 6, 6, 3)).astype(np.float32)
    blocks = x.reshape(2, 3, 2, 3, 2, 3)
    np.testing.assert_allclose(cnn.max_pool(jnp.asarray(x)), blocks.max(axis=(2, 4)), rtol=1e-6)
    np.testing.assert_allclose(cnn.avg_pool(jnp.asarray(x)), blocks.mean(axis=(2, 4)), rtol=1e-5, atol=1e-6)


def test_analyze_power_iteration_finds_the_top_eigenvalue():
    fn, (a, v0) = control.make_while_cond(n=32, k=1, max_iters=500, tol=1e-6)
    projected, iters = fn(a, v0)
    eig = np.linalg.eigvalsh(np.asarray(a, np.float64))
    top = eig[np.argmax(np.abs(eig))]
    vec = np.linalg.eigh(np.asarray(a, np.float64))[1][:, np.argmax(np.abs(eig))]
    # Converged: the cond took the first branch, tanh(a v) v^T with v = +-vec.
    expected = np.tanh(np.outer(top * vec, 1.0)) @ vec[None, :]
    assert 0 < int(iters) <= 500
    np.testing.assert_allclose(np.abs(np.asarray(projected)), np.abs(expected), atol=2e-3)


def test_analyze_parallel_branches_equal_a_sequential_numpy_loop():
    fn, (params, x) = control.make_parallel_branches(batch=3, in_dim=4, width=6, branches=3, depth=2)
    silu = lambda z: z / (1 + np.exp(-z))
    xs = np.asarray(x)
    outs = []
    for tower in params["towers"]:
        h = silu(xs @ np.asarray(tower[0]["w"]) + np.asarray(tower[0]["b"]))
        outs.append(h @ np.asarray(tower[1]["w"]) + np.asarray(tower[1]["b"]))
    mixed = np.concatenate(outs, -1) @ np.asarray(params["mix"]) + xs
    ref = (mixed - mixed.mean(-1, keepdims=True)) / np.sqrt(mixed.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(fn(params, x), ref, rtol=1e-4, atol=1e-4)
