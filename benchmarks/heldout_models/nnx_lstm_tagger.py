"""Flax NNX bidirectional LSTM sequence tagger (nnx.RNN over nnx.OptimizedLSTMCell, forward and reversed, scanned over time) with an embedding and per-token softmax, nnx.Optimizer(rmsprop)."""
import jax, jax.numpy as jnp, optax
from flax import nnx

V, E, HID, T, TAGS = 10000, 128, 256, 128, 20


class Tagger(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, E, rngs=rngs)
        self.fwd = nnx.RNN(nnx.OptimizedLSTMCell(E, HID, rngs=rngs))
        self.bwd = nnx.RNN(nnx.OptimizedLSTMCell(E, HID, rngs=rngs), reverse=True, keep_order=True)
        self.out = nnx.Linear(2 * HID, TAGS, rngs=rngs)

    def __call__(self, tok):
        x = self.emb(tok)
        return self.out(jnp.concatenate([self.fwd(x), self.bwd(x)], -1))


def make(batch: int = 32):
    model = Tagger(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.rmsprop(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    tok = jnp.zeros((batch, T), jnp.int32); tags = jnp.zeros((batch, T), jnp.int32)

    def step(state, tok, tags):
        model, opt = nnx.merge(graphdef, state)
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(tok), tags).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss
    return step, (state, tok, tags)
