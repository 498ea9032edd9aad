"""Flax NNX decoder: blocks stacked by nnx.vmap, run by nnx.scan under nnx.remat, RMSNorm, SwiGLU; nnx.jit with the model and optimizer donated."""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

FRAMEWORK = "flax.nnx"
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 4096, 512, 8, 6, 256, 16


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(DIM, rngs=rngs)
        self.gate = nnx.Linear(DIM, 4 * DIM, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, use_bias=False, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.norm1(x), mask=mask)
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return Block(rngs)

        self.blocks = stack(rngs)
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def run(x, block):
            return block(x)

        x = run(x, self.blocks)
        return self.embed.attend(self.norm(x))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit(donate_argnames=("model", "optimizer"))
def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def build():
    model = Decoder(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
    return model, optimizer, tokens


def make():
    return train_step, build()


def lowered():
    return train_step.lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    model, optimizer, tokens = objects
    for _ in range(steps):
        jax.block_until_ready(train_step(model, optimizer, tokens))


def loop(steps):
    run(build(), steps)
