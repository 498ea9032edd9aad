"""Plain JAX attention MLP block stack: jax.jit with static_argnames and donate_argnames, called with keyword arguments (a static head count and training flag, a dropout key)."""
import functools

import jax
import jax.numpy as jnp
import optax

FRAMEWORK = "jax"
DIM, LAYERS, SEQ, BATCH, VOCAB = 512, 4, 256, 16, 8000
optim = optax.adam(1e-3)


def init(key):
    keys = jax.random.split(key, 2 + 4 * LAYERS)
    dense = lambda k, a, b: jax.random.normal(k, (a, b)) / jnp.sqrt(a)  # noqa: E731
    layers = [{"qkv": dense(keys[2 + 4 * i], DIM, 3 * DIM), "out": dense(keys[3 + 4 * i], DIM, DIM),
               "up": dense(keys[4 + 4 * i], DIM, 4 * DIM), "down": dense(keys[5 + 4 * i], 4 * DIM, DIM)}
              for i in range(LAYERS)]
    return {"embed": dense(keys[0], VOCAB, DIM), "layers": layers}


def forward(params, tokens, num_heads, training, rng):
    x = params["embed"][tokens]
    for i, layer in enumerate(params["layers"]):
        q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
        heads = lambda t: t.reshape(t.shape[0], t.shape[1], num_heads, -1)  # noqa: E731
        att = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + att.reshape(x.shape) @ layer["out"]
        h = jax.nn.gelu(x @ layer["up"])
        if training:
            keep = jax.random.bernoulli(jax.random.fold_in(rng, i), 0.9, h.shape)
            h = jnp.where(keep, h / 0.9, 0.0)
        x = x + h @ layer["down"]
    return x @ params["embed"].T


@functools.partial(jax.jit, static_argnames=("num_heads", "training"), donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, tokens, *, num_heads, training, dropout_rng):
    def loss_fn(params):
        logits = forward(params, tokens[:, :-1], num_heads, training, dropout_rng)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def build():
    params = init(jax.random.key(0))
    tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
    return params, optim.init(params), tokens


def keywords():
    return {"num_heads": 8, "training": True, "dropout_rng": jax.random.key(1)}


def make():
    return train_step, build()


def lowered():
    return train_step.lower(*build(), **keywords())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    params, opt_state, tokens = objects
    for _ in range(steps):
        params, opt_state, loss = train_step(params, opt_state, tokens, **keywords())
    jax.block_until_ready(params)


def loop(steps):
    run(build(), steps)
