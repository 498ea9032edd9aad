"""Plain-JAX CLIP-style dual encoder: a patch-MLP image tower and a causal-free text transformer tower, L2-normalised embeddings, a learned temperature and the symmetric InfoNCE loss over the batch-by-batch similarity matrix, optax AdamW."""
import jax, jax.numpy as jnp, optax

D, E, V, T, P, IMG, L = 384, 256, 16384, 64, 8, 64, 2


def init(key):
    ks = iter(jax.random.split(key, 32))
    n = lambda s: jax.random.normal(next(ks), s) * 0.02
    return {'patch': n((P * P * 3, D)), 'ipos': n(((IMG // P) ** 2, D)),
            'img_blocks': [{'w1': n((D, 4 * D)), 'w2': n((4 * D, D)), 'qkv': n((D, 3 * D)), 'o': n((D, D))} for _ in range(L)],
            'img_proj': n((D, E)),
            'tok': n((V, D)), 'tpos': n((T, D)),
            'txt_blocks': [{'w1': n((D, 4 * D)), 'w2': n((4 * D, D)), 'qkv': n((D, 3 * D)), 'o': n((D, D))} for _ in range(L)],
            'txt_proj': n((D, E)), 'logit_scale': jnp.array(jnp.log(1 / 0.07))}


def ln(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def block(p, x):
    B, S, _ = x.shape
    q, k, v = jnp.split(ln(x) @ p['qkv'], 3, -1)
    sh = lambda t: t.reshape(B, S, 6, D // 6).transpose(0, 2, 1, 3)
    a = jax.nn.softmax(jnp.einsum('bhqd,bhkd->bhqk', sh(q), sh(k)) / 8.0, -1)
    x = x + jnp.einsum('bhqk,bhkd->bqhd', a, sh(v)).reshape(B, S, D) @ p['o']
    return x + jax.nn.gelu(ln(x) @ p['w1']) @ p['w2']


def loss_fn(p, img, txt):
    B = img.shape[0]
    patches = img.reshape(B, IMG // P, P, IMG // P, P, 3).transpose(0, 1, 3, 2, 4, 5).reshape(B, -1, P * P * 3)
    x = patches @ p['patch'] + p['ipos']
    for b in p['img_blocks']:
        x = block(b, x)
    zi = ln(x.mean(1)) @ p['img_proj']
    t = p['tok'][txt] + p['tpos']
    for b in p['txt_blocks']:
        t = block(b, t)
    zt = ln(t[:, -1]) @ p['txt_proj']
    zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
    zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
    logits = jnp.exp(p['logit_scale']) * zi @ zt.T
    labels = jnp.arange(B)
    return 0.5 * (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                  + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean())


def make(batch: int = 128):
    params = init(jax.random.PRNGKey(0))
    tx = optax.adamw(5e-4, b2=0.98, weight_decay=0.2)
    opt_state = tx.init(params)
    img = jnp.ones((batch, IMG, IMG, 3)); txt = jnp.zeros((batch, T), jnp.int32)

    def step(params, opt_state, img, txt):
        loss, g = jax.value_and_grad(loss_fn)(params, img, txt)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, img, txt)
