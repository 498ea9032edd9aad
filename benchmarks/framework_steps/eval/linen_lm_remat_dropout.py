"""Flax linen transformer LM: nn.remat'd blocks in a Python loop, dropout with a per-step rng, a TrainState, jax.jit without donation."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

FRAMEWORK = "flax.linen"
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 8192, 384, 6, 4, 256, 16


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.LayerNorm()(x)
        h = nn.SelfAttention(HEADS, dropout_rate=0.1, deterministic=not train)(h, mask=nn.make_causal_mask(x[..., 0]))
        x = x + h
        h = nn.Dense(4 * DIM)(nn.LayerNorm()(x))
        h = nn.Dropout(0.1, deterministic=not train)(nn.gelu(h))
        return x + nn.Dense(DIM)(h)


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(VOCAB, DIM)(tokens)
        for _ in range(LAYERS):
            x = nn.remat(Block, static_argnums=(2,))()(x, train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


@jax.jit
def train_step(state, tokens, rng):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, tokens[:, :-1], rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def build():
    model = LM()
    tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
    params = model.init(jax.random.key(0), tokens[:1, :-1], train=False)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-4))
    return state, tokens, jax.random.key(1)


def make():
    return train_step, build()


def lowered():
    return train_step.lower(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    state, tokens, rng = objects
    for _ in range(steps):
        rng, step_rng = jax.random.split(rng)
        state, loss = train_step(state, tokens, step_rng)
    jax.block_until_ready(state)


def loop(steps):
    run(build(), steps)
