"""Inference prefill: a 4-layer bfloat16 decoder run over a 1024-token prompt, returning the
last position's logits and the per-layer key/value caches (forward only, no gradient)."""
import jax, jax.numpy as jnp

D, H, DH, T, F, V, L = 768, 12, 64, 1024, 3072, 32000, 4


def make(batch: int = 2):
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    n = lambda kk, s: (jax.random.normal(kk, s) * 0.02).astype(jnp.bfloat16)
    p = {'emb': n(k[0], (V, D)), 'qkv': n(k[1], (L, D, 3 * D)), 'o': n(k[2], (L, D, D)),
         'up': n(k[3], (L, D, F)), 'down': n(k[4], (L, F, D))}
    tok = jax.random.randint(k[5], (batch, T), 0, V)

    def ln(x):
        xf = x.astype(jnp.float32)
        m = xf.mean(-1, keepdims=True)
        return ((xf - m) * jax.lax.rsqrt(((xf - m) ** 2).mean(-1, keepdims=True) + 1e-5)).astype(x.dtype)

    def prefill(p, tok):
        x = p['emb'][tok]
        caches = []
        for l in range(L):
            q, kk, v = jnp.split(ln(x) @ p['qkv'][l], 3, -1)
            sh = lambda t: t.reshape(batch, T, H, DH)
            caches.append((sh(kk), sh(v)))
            o = jax.nn.dot_product_attention(sh(q), sh(kk), sh(v), is_causal=True, implementation='xla')
            x = x + o.reshape(batch, T, D) @ p['o'][l]
            x = x + jax.nn.gelu(ln(x) @ p['up'][l]) @ p['down'][l]
        return (ln(x[:, -1]) @ p['emb'].T).astype(jnp.float32), caches
    return prefill, (p, tok)
