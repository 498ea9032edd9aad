import jax, jax.numpy as jnp
from jax import lax

D, H, L, T, V = 256, 4, 6, 256, 1024

def init(key):
    ks = jax.random.split(key, 6)
    n = lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
    return {
        'emb': n(ks[0], (V, D)),
        'layers': {
            'qkv': n(ks[1], (L, D, 3 * D)), 'o': n(ks[2], (L, D, D)),
            'w1': n(ks[3], (L, D, 4 * D)), 'w2': n(ks[4], (L, 4 * D, D)),
            'ln1': jnp.ones((L, D), jnp.bfloat16), 'ln2': jnp.ones((L, D), jnp.bfloat16),
        },
    }

def rms(x, g):
    xf = x.astype(jnp.float32)
    return (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype) * g

def layer(x, p):
    B, T_, _ = x.shape
    h = rms(x, p['ln1'])
    q, k, v = jnp.split(h @ p['qkv'], 3, -1)
    sh = lambda t: t.reshape(B, T_, H, D // H).transpose(0, 2, 1, 3)
    q, k, v = sh(q), sh(k), sh(v)
    s = jnp.einsum('bhqd,bhkd->bhqk', q, k) / jnp.sqrt(D // H).astype(jnp.bfloat16)
    mask = jnp.tril(jnp.ones((T_, T_), bool))
    s = jnp.where(mask, s, jnp.finfo(jnp.bfloat16).min)
    a = jax.nn.softmax(s.astype(jnp.float32), -1).astype(jnp.bfloat16)
    o = jnp.einsum('bhqk,bhkd->bhqd', a, v).transpose(0, 2, 1, 3).reshape(B, T_, D)
    x = x + o @ p['o']
    h = rms(x, p['ln2'])
    return x + jax.nn.gelu(h @ p['w1']) @ p['w2']

def loss(params, tok):
    x = params['emb'][tok[:, :-1]]
    f = jax.checkpoint(lambda c, p: (layer(c, p), None),
                       policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    x, _ = lax.scan(f, x, params['layers'])
    logits = (x @ params['emb'].T).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, 1:, None], -1))

def make(batch: int = 8):
    params = init(jax.random.PRNGKey(0))
    tok = jax.random.randint(jax.random.PRNGKey(1), (batch, T + 1), 0, V)
    def step(params, tok):
        l, g = jax.value_and_grad(loss)(params, tok)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, g), l
    return step, (params, tok)
