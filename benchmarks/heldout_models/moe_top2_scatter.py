"""Plain-JAX top-2 mixture-of-experts transformer FFN (Switch/GShard style without capacity): router softmax, lax.top_k, per-expert token gathers, expert GEMMs, weighted scatter-add combine (.at[].add), load-balancing auxiliary loss, optax Adam."""
import jax, jax.numpy as jnp, optax
from jax import lax

D, F, E, K = 512, 1024, 8, 2


def init(key):
    ks = jax.random.split(key, 5)
    return {'router': jax.random.normal(ks[0], (D, E)) * 0.02,
            'w_in': jax.random.normal(ks[1], (E, D, F)) * D ** -0.5,
            'w_out': jax.random.normal(ks[2], (E, F, D)) * F ** -0.5,
            'ln': jnp.ones((D,)), 'head': jax.random.normal(ks[3], (D, D)) * 0.02}


def moe(p, x):
    n = x.shape[0]
    probs = jax.nn.softmax(x @ p['router'], -1)
    gate, expert = lax.top_k(probs, K)                         # (n, K)
    gate = gate / gate.sum(-1, keepdims=True)
    tok = jnp.repeat(jnp.arange(n), K)                         # (n*K,)
    exp_flat, gate_flat = expert.reshape(-1), gate.reshape(-1)
    order = jnp.argsort(exp_flat)
    tok_s, exp_s, gate_s = tok[order], exp_flat[order], gate_flat[order]
    xs = x[tok_s]                                              # gather tokens, grouped by expert
    h = jax.nn.gelu(jnp.einsum('td,tdf->tf', xs, p['w_in'][exp_s]))
    y = jnp.einsum('tf,tfd->td', h, p['w_out'][exp_s]) * gate_s[:, None]
    out = jnp.zeros_like(x).at[tok_s].add(y)                   # scatter-add combine
    frac = jnp.zeros((E,)).at[exp_flat].add(1.0) / (n * K)
    aux = E * jnp.sum(frac * probs.mean(0))
    return out, aux


def make(tokens: int = 1024):
    params = init(jax.random.PRNGKey(0))
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, D)); y = jnp.zeros((tokens, D))

    def step(params, opt_state, x, y):
        def loss_fn(p):
            h = x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p['ln']
            o, aux = moe(p, h)
            return jnp.mean(((x + o) @ p['head'] - y) ** 2) + 0.01 * aux
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, x, y)
