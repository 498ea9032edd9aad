"""Grouped-query attention (8 query heads sharing 2 key/value heads) through
`jax.nn.dot_product_attention` with a causal mask, rotary embeddings, RMSNorm and a SwiGLU MLP,
in bfloat16: a Llama-style block's training step (loss and gradients)."""
import jax, jax.numpy as jnp

D, HQ, HKV, DH, T, F, V, L = 512, 8, 2, 64, 512, 1408, 4096, 2


def rope(x):
    t = jnp.arange(x.shape[1])[:, None] / (10000 ** (jnp.arange(0, DH, 2) / DH))[None]
    c, s = jnp.cos(t)[None, :, None].astype(x.dtype), jnp.sin(t)[None, :, None].astype(x.dtype)
    a, b = x[..., ::2], x[..., 1::2]
    return jnp.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)


def make(batch: int = 4):
    k = jax.random.split(jax.random.PRNGKey(0), 8)
    n = lambda kk, s: (jax.random.normal(kk, s) * 0.02).astype(jnp.bfloat16)
    p = {'emb': n(k[0], (V, D)),
         'layers': [{'wq': n(k[1], (D, HQ * DH)), 'wkv': n(k[2], (D, 2 * HKV * DH)), 'wo': n(k[3], (HQ * DH, D)),
                     'wg': n(k[4], (D, F)), 'wu': n(k[5], (D, F)), 'wd': n(k[6], (F, D)),
                     'n1': jnp.ones(D, jnp.bfloat16), 'n2': jnp.ones(D, jnp.bfloat16)} for _ in range(L)]}
    tok = jax.random.randint(k[7], (batch, T + 1), 0, V)

    def rms(x, g):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)).astype(x.dtype) * g

    def loss(p, tok):
        x = p['emb'][tok[:, :-1]]
        for lp in p['layers']:
            h = rms(x, lp['n1'])
            q = rope((h @ lp['wq']).reshape(batch, T, HQ, DH))
            kv = (h @ lp['wkv']).reshape(batch, T, 2, HKV, DH)
            o = jax.nn.dot_product_attention(q, rope(kv[:, :, 0]), kv[:, :, 1], is_causal=True, implementation='xla')
            x = x + o.reshape(batch, T, HQ * DH) @ lp['wo']
            h = rms(x, lp['n2'])
            x = x + (jax.nn.silu(h @ lp['wg']) * (h @ lp['wu'])) @ lp['wd']
        logits = (x @ p['emb'].T).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, 1:, None], -1))

    return jax.value_and_grad(loss), (p, tok)
