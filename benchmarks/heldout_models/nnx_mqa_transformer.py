"""Flax NNX decoder with hand-written multi-query attention (many query heads, one shared key/value head), RMSNorm, SwiGLU MLP and nnx.Optimizer(adam) on a next-token loss."""
import jax, jax.numpy as jnp, optax
from flax import nnx

V, D, H, DH, L, T = 4096, 512, 8, 64, 4, 256


class MQA(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Linear(D, H * DH, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(D, 2 * DH, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(H * DH, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        B, S, _ = x.shape
        q = self.q(x).reshape(B, S, H, DH)
        k, v = jnp.split(self.kv(x), 2, -1)
        s = jnp.einsum('bqhd,bkd->bhqk', q, k) / jnp.sqrt(DH)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e9)
        a = jax.nn.softmax(s, -1)
        return self.o(jnp.einsum('bhqk,bkd->bqhd', a, v).reshape(B, S, H * DH))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.n1 = nnx.RMSNorm(D, rngs=rngs); self.attn = MQA(rngs)
        self.n2 = nnx.RMSNorm(D, rngs=rngs)
        self.gate = nnx.Linear(D, 1536, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, 1536, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(1536, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(L)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tok):
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def make(batch: int = 8):
    model = Decoder(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(3e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))
    tok = jnp.zeros((batch, T + 1), jnp.int32)

    def train_step(state, tok):
        model, opt = nnx.merge(graphdef, state)
        loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(tok[:, :-1]), tok[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss
    return train_step, (state, tok)
