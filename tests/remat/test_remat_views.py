"""Recompute groups rebuild head-split transposes from the value they view (attention steps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.compiler.remat_graph import as_function, trace
from jaxmem.compiler.remat_search import search
from jaxmem.xla.cpu.compile import xla_reference
from remat_helpers import sgd_step


def _attention_step(layers: int = 2, batch: int = 2, seq: int = 32, d: int = 64, heads: int = 4):
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 3 * layers))
    params = [{"qkv": jax.random.normal(next(keys), (d, 3 * d)) / np.sqrt(d),
               "o": jax.random.normal(next(keys), (d, d)) / np.sqrt(d)} for _ in range(layers)]
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq, d))

    def layer(x, p):
        b, t, _ = x.shape
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for a in (q, k, v))
        probs = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads), axis=-1)
        return x + (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, d) @ p["o"]

    def loss(params, x):
        for p in params:
            x = layer(x, p)
        return jnp.mean(x * x)

    return sgd_step(loss), (params, x)


def test_remat_views_rewrite_keeps_values_and_lowers_xla_total():
    step, args = _attention_step()
    snaps = search(trace(step, *args))
    assert len(snaps) > 2
    ref = jax.jit(step)(*args)
    for snap in (snaps[len(snaps) // 2], snaps[-1]):
        got = jax.jit(as_function(snap.graph))(*args)
        for p, q in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
            p, q = np.asarray(p), np.asarray(q)
            assert float(np.max(np.abs(p - q))) <= 1e-5 * max(float(np.max(np.abs(p))), 1e-30)
    before = xla_reference(step, args).total_bytes
    after = xla_reference(as_function(snaps[-1].graph), args).total_bytes
    # XLA is the judge: rebuilding q, k, v inside the groups from the projection they view,
    # instead of reading the held transposes, takes this step's deepest rewrite from 88% of the
    # original's total (measured before the change: 477,380 of 544,812 bytes) to 76% (412,420).
    assert after <= 0.8 * before

