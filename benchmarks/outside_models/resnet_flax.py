import jax, jax.numpy as jnp, optax
import flax.linen as nn
class Block(nn.Module):
    c: int
    @nn.compact
    def __call__(self, x, train):
        r = x
        x = nn.Conv(self.c, (3, 3))(x); x = nn.BatchNorm(use_running_average=not train)(x); x = nn.relu(x)
        x = nn.Conv(self.c, (3, 3))(x); x = nn.BatchNorm(use_running_average=not train)(x)
        if r.shape[-1] != self.c:
            r = nn.Conv(self.c, (1, 1))(r)
        return nn.relu(x + r)
class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        for c in (32, 64):
            x = Block(c)(x, train); x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.mean((1, 2)))
def make(batch: int = 32):
    net = Net(); x = jnp.ones((batch, 32, 32, 3)); y = jnp.zeros((batch,), jnp.int32)
    v = net.init(jax.random.PRNGKey(0), x)
    opt = optax.sgd(0.1, momentum=0.9); st = opt.init(v['params'])
    def step(params, bs, st, x, y):
        def loss(params):
            logits, upd = net.apply({'params': params, 'batch_stats': bs}, x, mutable=['batch_stats'])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd
        (l, upd), g = jax.value_and_grad(loss, has_aux=True)(params)
        u, st = opt.update(g, st, params)
        return optax.apply_updates(params, u), upd['batch_stats'], st, l
    return step, (v['params'], v['batch_stats'], st, x, y)
