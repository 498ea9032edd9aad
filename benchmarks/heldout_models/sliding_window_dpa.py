"""Plain-JAX local-attention LM (Mistral-style sliding window of 128 through jax.nn.dot_product_attention(local_window_size=..., is_causal=True)), arguments given as jax.ShapeDtypeStruct, optax Adafactor."""
import jax, jax.numpy as jnp, optax

V, D, H, DH, L, T, W = 8192, 512, 8, 64, 4, 1024, 128


def init(key):
    ks = jax.random.split(key, 6)
    n = lambda k, s: jax.random.normal(k, s) * 0.02
    return {'emb': n(ks[0], (V, D)),
            'layers': [{'qkv': n(ks[1], (D, 3 * D)), 'o': n(ks[2], (D, D)), 'up': n(ks[3], (D, 4 * D)),
                        'down': n(ks[4], (4 * D, D)), 'g1': jnp.ones(D), 'g2': jnp.ones(D)} for _ in range(L)]}


def rms(x, g):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g


def loss_fn(p, tok):
    x = p['emb'][tok[:, :-1]]
    B = x.shape[0]
    for lp in p['layers']:
        q, k, v = jnp.split(rms(x, lp['g1']) @ lp['qkv'], 3, -1)
        sh = lambda t: t.reshape(B, T, H, DH)
        a = jax.nn.dot_product_attention(sh(q), sh(k), sh(v), is_causal=True, local_window_size=(W, 0),
                                         implementation='xla')
        x = x + a.reshape(B, T, D) @ lp['o']
        x = x + jax.nn.silu(rms(x, lp['g2']) @ lp['up']) @ lp['down']
    logits = x @ p['emb'].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()


def make(batch: int = 4):
    tx = optax.adafactor(1e-3)
    params = jax.eval_shape(init, jax.random.PRNGKey(0))
    opt_state = jax.eval_shape(tx.init, params)
    tok = jax.ShapeDtypeStruct((batch, T + 1), jnp.int32)

    def step(params, opt_state, tok):
        loss, g = jax.value_and_grad(loss_fn)(params, tok)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, tok)
