"""Plain-JAX Perceiver-style classifier: a learned latent array cross-attends to a long input sequence with jax.nn.dot_product_attention (different query and key lengths, a key padding mask), then latent self-attention blocks; optax SGD with a cosine schedule."""
import jax, jax.numpy as jnp, optax

N, C, M, D, H, L = 2048, 64, 128, 256, 8, 4


def init(key):
    ks = iter(jax.random.split(key, 32))
    n = lambda s, sc=0.02: jax.random.normal(next(ks), s) * sc
    attn = lambda dq, dkv: {'q': n((dq, D)), 'k': n((dkv, D)), 'v': n((dkv, D)), 'o': n((D, D))}
    return {'latents': n((M, D), 1.0), 'inp': n((C, D)),
            'cross': attn(D, D),
            'self': [{'attn': attn(D, D), 'w1': n((D, 4 * D)), 'w2': n((4 * D, D))} for _ in range(L)],
            'head': n((D, 50))}


def mha(p, xq, xkv, mask=None):
    B, Sq, _ = xq.shape
    Skv = xkv.shape[1]
    q = (xq @ p['q']).reshape(B, Sq, H, D // H)
    k = (xkv @ p['k']).reshape(B, Skv, H, D // H)
    v = (xkv @ p['v']).reshape(B, Skv, H, D // H)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation='xla').reshape(B, Sq, D) @ p['o']


def norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def loss_fn(p, x, valid, y):
    B = x.shape[0]
    kv = norm(x @ p['inp'])
    z = jnp.broadcast_to(p['latents'], (B, M, D))
    z = z + mha(p['cross'], norm(z), kv, mask=valid[:, None, None, :])
    for blk in p['self']:
        h = norm(z)
        z = z + mha(blk['attn'], h, h)
        z = z + jax.nn.gelu(norm(z) @ blk['w1']) @ blk['w2']
    logits = z.mean(1) @ p['head']
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make(batch: int = 16):
    params = init(jax.random.PRNGKey(0))
    tx = optax.sgd(optax.cosine_decay_schedule(0.1, 10000), momentum=0.9)
    opt_state = tx.init(params)
    x = jnp.ones((batch, N, C)); valid = jnp.arange(N)[None] < jnp.full((batch, 1), N - 100)
    y = jnp.zeros((batch,), jnp.int32)

    def step(params, opt_state, x, valid, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, valid, y)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, x, valid, y)
