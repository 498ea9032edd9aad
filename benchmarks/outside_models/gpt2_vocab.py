import jax, jax.numpy as jnp, optax
V, D, L, T, H = 50257, 256, 2, 128, 4
def make(batch: int = 8):
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    p = {'wte': jax.random.normal(k[0], (V, D)) * 0.02, 'wpe': jax.random.normal(k[1], (T, D)) * 0.01,
         'blocks': [{'qkv': jax.random.normal(k[2], (D, 3 * D)) * 0.02, 'proj': jax.random.normal(k[3], (D, D)) * 0.02,
                     'fc': jax.random.normal(k[4], (D, 4 * D)) * 0.02, 'out': jax.random.normal(k[5], (4 * D, D)) * 0.02,
                     'ln1': jnp.ones(D), 'ln2': jnp.ones(D)} for _ in range(L)]}
    opt = optax.adamw(3e-4)
    st = opt.init(p)
    tok = jax.random.randint(k[6], (batch, T + 1), 0, V)
    def ln(x, g):
        m = x.mean(-1, keepdims=True); v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * g
    def loss(p, tok):
        x = p['wte'][tok[:, :-1]] + p['wpe']
        for b in p['blocks']:
            h = ln(x, b['ln1'])
            q, kk, v = jnp.split(h @ b['qkv'], 3, -1)
            sh = lambda t: t.reshape(batch, T, H, D // H)
            o = jax.nn.dot_product_attention(sh(q), sh(kk), sh(v), is_causal=True, implementation='xla')
            x = x + o.reshape(batch, T, D) @ b['proj']
            x = x + jax.nn.gelu(ln(x, b['ln2']) @ b['fc']) @ b['out']
        logits = x @ p['wte'].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()
    def step(p, st, tok):
        l, g = jax.value_and_grad(loss)(p, tok)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st, l
    return step, (p, st, tok)
