import jax, jax.numpy as jnp, optax
from flax import linen as nn

class Block(nn.Module):
    d: int; h: int
    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.h)(y, y)
        x = x + y
        y = nn.LayerNorm()(x)
        y = nn.Dense(4 * self.d)(y); y = nn.gelu(y); y = nn.Dense(self.d)(y)
        return x + y

class ViT(nn.Module):
    d: int = 192; depth: int = 4; h: int = 3; patch: int = 4; ncls: int = 10
    @nn.compact
    def __call__(self, img):
        x = nn.Conv(self.d, (self.patch, self.patch), strides=self.patch)(img)
        b = x.shape[0]
        x = x.reshape(b, -1, self.d)
        cls = self.param('cls', nn.initializers.zeros, (1, 1, self.d))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.d)), x], axis=1)
        x = x + self.param('pos', nn.initializers.normal(0.02), (1, x.shape[1], self.d))
        for _ in range(self.depth):
            x = Block(self.d, self.h)(x)
        x = nn.LayerNorm()(x[:, 0])
        return nn.Dense(self.ncls)(x)

def make(batch: int = 32):
    model = ViT()
    img = jnp.ones((batch, 32, 32, 3), jnp.float32)
    lab = jnp.zeros((batch,), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), img)
    tx = optax.adamw(1e-3, weight_decay=0.05)
    opt = tx.init(params)
    def step(params, opt, img, lab):
        def loss_fn(p):
            logits = model.apply(p, img)
            return optax.softmax_cross_entropy_with_integer_labels(logits, lab).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss
    return step, (params, opt, img, lab)
