"""ViT-B/16 on 224x224 images in Flax linen, f32, TrainState + AdamW with clipping and cosine schedule, batch near TPU v5e HBM."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state

DONATE = (0,)

NUM_CLASSES, PATCH, WIDTH, DEPTH, HEADS, MLP = 1000, 16, 768, 12, 12, 3072


class MlpBlock(nn.Module):
    mlp_dim: int
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.mlp_dim)(x)
        y = nn.gelu(y)
        return nn.Dense(x.shape[-1])(y)


class Encoder1DBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS)(y, y)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(MLP)(y)


class ViT(nn.Module):
    @nn.compact
    def __call__(self, images):
        x = nn.Conv(WIDTH, (PATCH, PATCH), strides=(PATCH, PATCH), padding="VALID", name="embedding")(images)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)), x], axis=1)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, x.shape[1], c))
        x = x + pos
        for i in range(DEPTH):
            x = Encoder1DBlock(name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(NUM_CLASSES, name="head")(x[:, 0])


def train_step(state, images, labels):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, NUM_CLASSES)).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make(batch: int = 152):
    model = ViT()
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10_000, 300_000)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.05))

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3), jnp.float32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    state = jax.eval_shape(init)
    return train_step, (state, jax.ShapeDtypeStruct((batch, 224, 224, 3), jnp.float32),
                        jax.ShapeDtypeStruct((batch,), jnp.int32))
