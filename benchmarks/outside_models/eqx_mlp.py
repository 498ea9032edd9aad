import jax, jax.numpy as jnp, equinox as eqx, optax

class Net(eqx.Module):
    l1: eqx.nn.Linear; l2: eqx.nn.Linear; ln: eqx.nn.LayerNorm
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(512, 1024, key=k1); self.l2 = eqx.nn.Linear(1024, 10, key=k2)
        self.ln = eqx.nn.LayerNorm(1024)
    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.ln(self.l1(x))))

def make(batch: int = 128):
    model = Net(jax.random.PRNGKey(0))
    tx = optax.adam(1e-3)
    opt = tx.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((batch, 512)); y = jnp.zeros((batch,), jnp.int32)
    def step(model, opt, x, y):
        def loss(m):
            lg = jax.vmap(m)(x)
            return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()
        l, g = eqx.filter_value_and_grad(loss)(model)
        u, opt = tx.update(g, opt, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, u), opt, l
    return step, (model, opt, x, y)
