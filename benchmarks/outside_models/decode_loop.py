import jax, jax.numpy as jnp
from jax import lax
L, H, Dh, S, V = 2, 8, 64, 512, 8192
D = H * Dh
def make(batch: int = 8):
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    p = {'emb': jax.random.normal(k[0], (V, D), jnp.bfloat16) * 0.02,
         'wqkv': jax.random.normal(k[1], (L, D, 3 * D), jnp.bfloat16) * 0.02,
         'wo': jax.random.normal(k[2], (L, D, D), jnp.bfloat16) * 0.02}
    cache = jnp.zeros((L, 2, batch, S, H, Dh), jnp.bfloat16)
    tok = jnp.zeros((batch,), jnp.int32)
    def generate(p, cache, tok):
        def one(i, carry):
            cache, tok, out = carry
            x = p['emb'][tok]
            for l in range(L):
                q, kn, vn = jnp.split(x @ p['wqkv'][l], 3, -1)
                cache = lax.dynamic_update_slice(cache, kn.reshape(1, 1, batch, 1, H, Dh), (l, 0, 0, i, 0, 0))
                cache = lax.dynamic_update_slice(cache, vn.reshape(1, 1, batch, 1, H, Dh), (l, 1, 0, i, 0, 0))
                s = jnp.einsum('bhd,bshd->bhs', q.reshape(batch, H, Dh), cache[l, 0]).astype(jnp.float32)
                s = jnp.where(jnp.arange(S) <= i, s, -1e30)
                a = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
                x = x + jnp.einsum('bhs,bshd->bhd', a, cache[l, 1]).reshape(batch, D) @ p['wo'][l]
            tok = jnp.argmax(x @ p['emb'].T, -1).astype(jnp.int32)
            return cache, tok, out.at[:, i].set(tok)
        cache, tok, out = lax.fori_loop(0, 32, one, (cache, tok, jnp.zeros((batch, 32), jnp.int32)))
        return out, cache
    return generate, (p, cache, tok)
