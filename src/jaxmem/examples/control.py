"""Programs with control flow (`lax.while_loop`, `lax.cond`) and with parallel independent branches.

    >>> fn, args = make_while_cond(n=8, k=2)
    >>> out, iterations = fn(*args)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.examples.layers import dense_init, layernorm


def make_while_cond(*, n: int = 1024, k: int = 256, max_iters: int = 30, tol: float = 1e-4,
                    seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Block power iteration in a `while_loop` until converged, then a `cond` between two branches
    of different memory needs (one builds a (n, k) temporary, the other does not).

    >>> fn, (a, v) = make_while_cond(n=8, k=2)
    >>> fn(a, v)[0].shape
    (8, 8)

    Args:
        n: the symmetric matrix's size (n, n).
        k: number of vectors iterated together (n, k).
        max_iters, tol: the loop stops at `max_iters` or once no entry moves more than `tol`.
        seed: numpy seed.

    Returns:
        `(fn, (a, v0))` where `fn(a, v0) -> ((n, n) float32, int32 iteration count)`.
    """
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)
    a = jnp.asarray((m + m.T) / 2)
    v0 = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32))

    def power_iteration(a, v0):
        def keep_going(state):
            i, _, err = state
            return (i < max_iters) & (err > tol)

        def body(state):
            i, v, _ = state
            w = a @ v
            w = w / jnp.linalg.norm(w, axis=0, keepdims=True)
            return i + 1, w, jnp.max(jnp.abs(jnp.abs(w) - jnp.abs(v)))

        start = v0 / jnp.linalg.norm(v0, axis=0, keepdims=True)
        iters, v, err = jax.lax.while_loop(keep_going, body, (jnp.int32(0), start, jnp.float32(jnp.inf)))
        projected = jax.lax.cond(
            err < 1e-2,
            lambda v: jnp.tanh(a @ v) @ v.T,   # converged: a smoothed projection, (n, k) temporary
            lambda v: v @ v.T + a,             # not converged: the raw projection plus a
            v,
        )
        return projected, iters

    return power_iteration, (a, v0)


def make_parallel_branches(*, batch: int = 512, in_dim: int = 512, width: int = 2048, branches: int = 8,
                           depth: int = 3, seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`branches` independent MLP towers on one input, concatenated and mixed: a scheduler that runs
    the towers one after another holds one tower's temporaries at a time; one that interleaves
    them holds them all.

    >>> fn, (params, x) = make_parallel_branches(batch=2, in_dim=4, width=8, branches=3, depth=2)
    >>> fn(params, x).shape
    (2, 4)

    Returns:
        `(fn, (params, x))` where `fn(params, x) -> (batch, in_dim)`.
    """
    rng = np.random.default_rng(seed)
    towers = []
    for _ in range(branches):
        dims = [in_dim] + [width] * (depth - 1) + [in_dim]
        towers.append([{"w": dense_init(rng, a, b), "b": jnp.zeros((b,), jnp.float32)} for a, b in zip(dims[:-1], dims[1:])])
    params = {
        "towers": towers,
        "mix": dense_init(rng, branches * in_dim, in_dim),
        "g": jnp.ones((in_dim,), jnp.float32),
        "b": jnp.zeros((in_dim,), jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((batch, in_dim), dtype=np.float32))

    def parallel_towers(params, x):
        outs = []
        for tower in params["towers"]:
            h = x
            for layer in tower[:-1]:
                h = jax.nn.silu(h @ layer["w"] + layer["b"])
            outs.append(h @ tower[-1]["w"] + tower[-1]["b"])
        mixed = jnp.concatenate(outs, axis=-1) @ params["mix"]
        return layernorm(mixed + x, params["g"], params["b"])

    return parallel_towers, (params, x)
