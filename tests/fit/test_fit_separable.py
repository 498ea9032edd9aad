"""Which losses gradient accumulation keeps: the jaxpr reading (`fitting.separable`) against brute
force, the mean of the micro-batches' loss and gradient computed by JAX and compared with the
whole batch's. A loss read as separable must give equal values; each one read as mixing its
examples here does give different ones (so the refusal is not a false alarm on these)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.fitting.separable import why_not_separable

B, D = 16, 6


def mse(p, x):
    return jnp.mean((jnp.tanh(x @ p["w"]) - 1.0) ** 2)


def mse_plus_l2(p, x):
    return jnp.mean(jnp.sum((x @ p["w"]) ** 2, axis=1)) + 1e-2 * jnp.sum(p["w"] ** 2)


def two_means(p, x):   # a loss and an auxiliary loss, each a mean
    h = x @ p["w"]
    return jnp.mean(h ** 2) + 0.5 * jnp.mean(jnp.abs(h))


def scanned_layers(p, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, jnp.stack([p["w"][:, :D]] * 3))
    return jnp.mean(h ** 2)


def embedding_attention(p, x):
    ids = (jnp.abs(x[:, :4]) * 10).astype(jnp.int32) % D
    e = p["w"][:, :D][ids]                                   # (B, 4, D): a lookup per example
    scores = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", e, e), axis=-1)
    return jnp.mean(jnp.einsum("bqk,bkd->bqd", scores, e) ** 2)


def conv(p, x):
    img = x.reshape(x.shape[0], 1, 2, 3)
    y = jax.lax.conv_general_dilated(img, p["w"][:2, :2].reshape(2, 1, 1, 2), (1, 1), "SAME")
    return jnp.mean(jnp.tanh(y) ** 2)


def tokens_merged(p, x):   # (B, S, D) -> (B*S, D) and back, as a model over tokens does
    n = x.shape[0]
    t = jnp.stack([x, -x], axis=1).reshape(n * 2, D)
    return jnp.mean((t @ p["w"]).reshape(n, 2, -1) ** 2)


def batch_norm(p, x):
    h = x @ p["w"]
    return jnp.mean(((h - h.mean(0)) / (h.std(0) + 1e-3)) ** 2)


def in_batch_negatives(p, x):
    z = x @ p["w"]
    logits = z @ z.T
    return -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=1)))


def summed(p, x):
    return jnp.sum((x @ p["w"]) ** 2)


def masked_mean(p, x):
    mask = (x[:, 0] > 0).astype(jnp.float32)
    per = jnp.sum((x @ p["w"]) ** 2, axis=1)
    return jnp.sum(per * mask) / jnp.sum(mask)


def rms(p, x):
    return jnp.sqrt(jnp.mean((x @ p["w"]) ** 2))


def all_but_first(p, x):
    return jnp.mean((x[1:] @ p["w"]) ** 2)


def max_over_batch(p, x):
    return jnp.max(jnp.sum((x @ p["w"]) ** 2, axis=1))


SEPARABLE = [mse, mse_plus_l2, two_means, scanned_layers, embedding_attention, conv, tokens_merged]
MIXING = [batch_norm, in_batch_negatives, summed, masked_mean, rms, all_but_first, max_over_batch]


def _brute_force_equal(loss, p, x, steps=4) -> bool:
    """Whether the mean of the micro-batches' loss and gradient is the batch's (every steps-th
    row in one, as fit splits)."""
    whole = jax.value_and_grad(loss)(p, x)
    micro = x.reshape(B // steps, steps, D).swapaxes(0, 1)
    mean = jax.tree.map(lambda *v: sum(v) / steps, *[jax.value_and_grad(loss)(p, m) for m in micro])
    return all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(mean)))


@pytest.mark.parametrize("loss", SEPARABLE + MIXING, ids=lambda f: f.__name__)
def test_the_reading_agrees_with_brute_force(loss):
    p = {"w": jax.random.normal(jax.random.key(0), (D, D)) / 3}
    x = jax.random.normal(jax.random.key(1), (B, D))
    why = why_not_separable(jax.make_jaxpr(loss)(p, x), [False, True], B)
    equal = _brute_force_equal(loss, p, x)
    assert (why is None) == (loss in SEPARABLE), why
    assert equal == (loss in SEPARABLE), (loss.__name__, why)


def test_a_loss_that_mixes_its_examples_is_not_offered_accumulation():
    import jaxmem

    def step(p, x):
        return jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(batch_norm)(p, x))

    p = {"w": jnp.ones((D, 512))}
    x = jnp.ones((4096, D))
    result = jaxmem.fit(step, p, x, budget="half-temp", rewrite=False)
    said = [c for c in result.policies.candidates if c.policy == "accumulate_gradients"]
    assert said and all(c.xla_total_bytes is None for c in said)
    assert "statistics of the batch" in said[0].error
