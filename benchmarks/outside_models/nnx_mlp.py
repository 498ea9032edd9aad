import jax, jax.numpy as jnp, optax
from flax import nnx

class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(256, 512, rngs=rngs); self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.bn = nnx.BatchNorm(512, rngs=rngs); self.l2 = nnx.Linear(512, 10, rngs=rngs)
    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

def make(batch: int = 64):
    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.PRNGKey(3), (batch, 256)); y = jnp.zeros((batch,), jnp.int32)
    def step(state, x, y):
        m = nnx.merge(graphdef, state)
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        l, g = nnx.value_and_grad(loss)(m)
        _, st = nnx.split(m)
        gs = g
        newst = jax.tree.map(lambda a, b: a - 0.01 * b if hasattr(b, 'shape') else a, nnx.state(m, nnx.Param), gs)
        nnx.update(m, newst)
        return nnx.state(m), l
    return step, (state, x, y)
