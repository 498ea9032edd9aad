import jax, jax.numpy as jnp
from jax import lax

L, H, Dh, S, V = 4, 8, 64, 1024, 4096
D = H * Dh

def make(batch: int = 16):
    k = jax.random.PRNGKey(0)
    params = {'emb': jax.random.normal(k, (V, D), jnp.bfloat16) * 0.02,
              'wq': jnp.ones((L, D, D), jnp.bfloat16) * 0.01, 'wk': jnp.ones((L, D, D), jnp.bfloat16) * 0.01,
              'wv': jnp.ones((L, D, D), jnp.bfloat16) * 0.01, 'wo': jnp.ones((L, D, D), jnp.bfloat16) * 0.01}
    cache = {'k': jnp.zeros((L, batch, S, H, Dh), jnp.bfloat16), 'v': jnp.zeros((L, batch, S, H, Dh), jnp.bfloat16)}
    tok = jnp.zeros((batch,), jnp.int32)
    pos = jnp.array(5, jnp.int32)
    def decode(params, cache, tok, pos):
        x = params['emb'][tok]
        ks, vs = [], []
        for l in range(L):
            q = (x @ params['wq'][l]).reshape(batch, H, Dh)
            kn = (x @ params['wk'][l]).reshape(batch, 1, H, Dh)
            vn = (x @ params['wv'][l]).reshape(batch, 1, H, Dh)
            kc = lax.dynamic_update_slice(cache['k'][l], kn, (0, pos, 0, 0))
            vc = lax.dynamic_update_slice(cache['v'][l], vn, (0, pos, 0, 0))
            s = jnp.einsum('bhd,bshd->bhs', q, kc).astype(jnp.float32)
            s = jnp.where(jnp.arange(S)[None, None] <= pos, s, -1e30)
            a = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
            x = x + jnp.einsum('bhs,bshd->bhd', a, vc).reshape(batch, D) @ params['wo'][l]
            ks.append(kc); vs.append(vc)
        logits = x @ params['emb'].T
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        return nxt, {'k': jnp.stack(ks), 'v': jnp.stack(vs)}
    return decode, (params, cache, tok, pos)

def make_inplace(batch: int = 16):
    """Same, the cache updated in place with .at[].set per layer."""
    fn, args = make(batch)
    params, cache, tok, pos = args
    def decode(params, cache, tok, pos):
        x = params['emb'][tok]
        kk, vv = cache['k'], cache['v']
        for l in range(L):
            q = (x @ params['wq'][l]).reshape(batch, H, Dh)
            kn = (x @ params['wk'][l]).reshape(batch, 1, H, Dh)
            vn = (x @ params['wv'][l]).reshape(batch, 1, H, Dh)
            kk = lax.dynamic_update_slice(kk, kn[None], (l, 0, pos, 0, 0))
            vv = lax.dynamic_update_slice(vv, vn[None], (l, 0, pos, 0, 0))
            s = jnp.einsum('bhd,bshd->bhs', q, kk[l]).astype(jnp.float32)
            a = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
            x = x + jnp.einsum('bhs,bshd->bhd', a, vv[l]).reshape(batch, D) @ params['wo'][l]
        return jnp.argmax(x @ params['emb'].T, -1).astype(jnp.int32), {'k': kk, 'v': vv}
    return decode, args
