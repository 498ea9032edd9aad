import jax, jax.numpy as jnp

def make(batch: int = 16):
    k = jax.random.PRNGKey(0)
    n = 256
    p = {'wr': jax.random.normal(k, (64, n // 2 + 1)) * 0.1, 'wi': jax.random.normal(k, (64, n // 2 + 1)) * 0.1,
         'proj': jax.random.normal(k, (64, 64)) * 0.1}
    x = jnp.ones((batch, 64, n))
    def loss(p, x):
        X = jnp.fft.rfft(x, axis=-1)
        X = X * (p['wr'] + 1j * p['wi'])
        y = jnp.fft.irfft(X, n=n, axis=-1)
        y = jnp.einsum('bcn,cd->bdn', y, p['proj'])
        Z = jnp.fft.fft2(y.astype(jnp.complex64))
        return jnp.mean(jnp.abs(Z) ** 2) * 1e-6
    def step(p, x):
        l, g = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), l
    return step, (p, x)
