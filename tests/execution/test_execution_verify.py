"""`--execute`'s equality test: a tolerance that follows the dtype and the longest sum, with JAX's
own op-by-op disagreement as the noise floor, checked on real outputs and on planted errors."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.cli.main import main as cli_main
from jaxmem.execution import verify


def _bf16_mlp():
    k = jax.random.split(jax.random.key(0), 3)
    w1 = jax.random.normal(k[0], (512, 1024), jnp.bfloat16) * 0.05
    w2 = jax.random.normal(k[1], (1024, 256), jnp.bfloat16) * 0.05
    x = jax.random.normal(k[2], (128, 512), jnp.bfloat16)

    def f(w1, w2, x):
        h = jax.nn.gelu(x @ w1)
        h = jax.nn.softmax(h @ w2, axis=-1)
        return (h * h).sum(axis=0), h.mean()

    return f, (w1, w2, x)


def _f32_matmuls():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 4096), dtype=np.float32)
    b = rng.standard_normal((4096, 512), dtype=np.float32) / 64

    def g(a, b):
        return jnp.tanh(a @ b) @ b.T, jnp.argmax(a, axis=1)

    return g, (a, b)


def _compare_with_planted(monkeypatch, fn, args, plant):
    """compare_with_jit where the planned run's outputs pass through `plant` (leaves -> leaves)."""
    real_build = verify.build

    class Planted:
        def __init__(self, inner):
            self.inner = inner

        def run(self, call_args):
            out = self.inner.run(call_args)
            leaves, tree = jax.tree_util.tree_flatten(out)
            return jax.tree_util.tree_unflatten(tree, plant([np.asarray(x) for x in leaves]))

    monkeypatch.setattr(verify, "build", lambda *a, **k: Planted(real_build(*a, **k)))
    return verify.compare_with_jit(fn, args, jaxmem.plan(fn, *args, xla=False))


def test_bf16_outputs_are_equal_within_their_dtype():
    fn, args = _bf16_mlp()
    result = verify.compare_with_jit(fn, args, jaxmem.plan(fn, *args, xla=False))
    assert result["ok"] is True
    assert result["reduction"] == 128 * 256          # h.mean() sums every element of h
    # the bar is bf16's (a few of its roundings), not float32's 1e-5 that every bf16 model missed
    assert result["tolerance"] >= 4 * 2.0 ** -7
    assert 1e-5 < result["max_rel_err"] <= result["tolerance"]


def test_float32_rounding_from_long_sums_is_equal(monkeypatch):
    fn, args = _f32_matmuls()
    # the case: a relative error of 1.06e-5 in float32 after 4096-term sums was "DIFFER"
    def nudge(leaves):
        out = leaves[0].copy()
        out.flat[7] += np.float32(1.06e-5) * np.abs(out).max()
        return [out, leaves[1]]
    result = _compare_with_planted(monkeypatch, fn, args, nudge)
    assert result["reduction"] == 4096
    assert result["ok"] is True and 1.0e-5 < result["max_rel_err"] <= result["tolerance"] < 1e-3


def test_a_real_difference_is_reported_with_the_noise_floor(monkeypatch):
    fn, args = _f32_matmuls()
    def corrupt(leaves):
        out = leaves[0].copy()
        out[3, :16] = 0.0                      # what an overlapping buffer leaves behind
        return [out, leaves[1]]
    result = _compare_with_planted(monkeypatch, fn, args, corrupt)
    assert result["ok"] is False and result["worst_leaf"] == 0
    # JAX op by op was run to find the noise floor, and it is far below the planted error
    assert result["noise_rel"] is not None and result["noise_rel"] < 1e-4 < result["max_rel_err"]
    assert result["max_rel_err"] > result["tolerance"]


def test_integer_outputs_must_match_exactly(monkeypatch):
    fn, args = _f32_matmuls()
    def off_by_one(leaves):
        idx = leaves[1].copy()
        idx[0] += 1
        return [leaves[0], idx]
    result = _compare_with_planted(monkeypatch, fn, args, off_by_one)
    assert result["ok"] is False and result["worst_leaf"] == 1 and result["tolerance"] is None


@pytest.mark.parametrize("make, expected", [
    (lambda: jax.make_jaxpr(lambda a, b: a @ b)(np.ones((3, 70)), np.ones((70, 2))), 70),
    (lambda: jax.make_jaxpr(lambda x: jnp.cumsum(x, axis=1))(np.ones((3, 300))), 300),
    (lambda: jax.make_jaxpr(lambda x, k: jax.lax.conv(x, k, (1, 1), "SAME"))(
        np.ones((1, 5, 8, 8), np.float32), np.ones((7, 5, 3, 3), np.float32)), 5 * 3 * 3),
    (lambda: jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, r: (c + r.sum(), None), 0.0, x)[0])(
        np.ones((40, 6), np.float32)), 40),
    (lambda: jax.make_jaxpr(jax.jit(lambda x: x.max(axis=(0, 1))))(np.ones((4, 9, 2))), 36),
])
def test_longest_reduction_counts_the_terms_of_each_kind_of_sum(make, expected):
    assert verify.longest_reduction(make()) == expected


BF16_TARGET = """
import jax, jax.numpy as jnp

def make():
    k = jax.random.split(jax.random.key(1), 2)
    w = jax.random.normal(k[0], (256, 256), jnp.bfloat16) * 0.06
    x = jax.random.normal(k[1], (64, 256), jnp.bfloat16)

    def step(w, x):
        def loss(w):
            return jnp.mean(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value

    return step, (w, x)
"""


def test_analyze_execute_on_a_bf16_step_says_equal(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "bf16_step.py"
    path.write_text(textwrap.dedent(BF16_TARGET))
    assert cli_main(["analyze", f"{path}:make", "--json", "--execute", "--no-xla"]) == 0
    data = json.loads(capsys.readouterr().out)["execute"]
    assert data["ok"] is True and data["max_rel_err"] <= data["tolerance"]
    assert cli_main(["analyze", f"{path}:make", "--execute", "--no-xla"]) == 0
    out = capsys.readouterr().out
    assert "equal" in out and "DIFFER" not in out and "tolerance" in out
