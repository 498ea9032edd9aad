"""Plain-JAX linear recurrent unit (LRU/S5-style) stack: complex diagonal recurrence over time with lax.associative_scan, layers run by lax.scan over stacked weights, GLU mixing, optax AdamW."""
import jax, jax.numpy as jnp, optax
from jax import lax

D, N, L, T, IN = 256, 256, 4, 1024, 16


def init(key):
    ks = jax.random.split(key, 8)
    n = lambda k, s, sc: jax.random.normal(k, s) * sc
    return {'enc': n(ks[0], (IN, D), 0.1),
            'layers': {'nu': jnp.full((L, N), -1.0), 'theta': n(ks[1], (L, N), 1.0),
                       'B_re': n(ks[2], (L, D, N), D ** -0.5), 'B_im': n(ks[3], (L, D, N), D ** -0.5),
                       'C_re': n(ks[4], (L, N, D), N ** -0.5), 'C_im': n(ks[5], (L, N, D), N ** -0.5),
                       'glu': n(ks[6], (L, D, 2 * D), D ** -0.5), 'g': jnp.ones((L, D))},
            'dec': n(ks[7], (D, 10), 0.1)}


def lru_layer(x, p):
    h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p['g']
    lam = jnp.exp(-jnp.exp(p['nu']) + 1j * p['theta'])                  # (N,)
    bu = h @ (p['B_re'] + 1j * p['B_im'])                                # (B, T, N)
    lam_t = jnp.broadcast_to(lam, bu.shape)
    def combine(a, b):
        return a[0] * b[0], b[0] * a[1] + b[1]
    _, states = lax.associative_scan(combine, (lam_t, bu), axis=1)
    y = (states @ (p['C_re'] + 1j * p['C_im'])).real
    a, b = jnp.split(jax.nn.gelu(y) @ p['glu'], 2, -1)
    return x + a * jax.nn.sigmoid(b), None


def loss_fn(p, x, y):
    h = x @ p['enc']
    h, _ = lax.scan(lru_layer, h, p['layers'])
    logits = h.mean(1) @ p['dec']
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make(batch: int = 16):
    params = init(jax.random.PRNGKey(0))
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    x = jnp.ones((batch, T, IN)); y = jnp.zeros((batch,), jnp.int32)

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, x, y)
