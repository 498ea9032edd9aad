"""Plain JAX transformer encoder with f32 master params and bf16 compute, register_dataclass state, dynamic loss scale, AdamW + clipping."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

D, HEADS, FF, LAYERS, SEQ, CLASSES = 512, 8, 1365, 6, 197, 37


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "opt_state", "loss_scale", "step"],
                   meta_fields=[])
@dataclasses.dataclass
class State:
    params: dict
    opt_state: optax.OptState
    loss_scale: jax.Array
    step: jax.Array


def init_params(key):
    ks = iter(jax.random.split(key, 4 * LAYERS + 2))
    layers = []
    for _ in range(LAYERS):
        layers.append({"wqkv": jax.random.normal(next(ks), (D, 3 * D)) * D ** -0.5,
                       "wo": jax.random.normal(next(ks), (D, D)) * D ** -0.5,
                       "w1": jax.random.normal(next(ks), (D, FF)) * D ** -0.5,
                       "w2": jax.random.normal(next(ks), (FF, D)) * FF ** -0.5,
                       "ln1": jnp.ones((D,)), "ln2": jnp.ones((D,))})
    return {"in_proj": jax.random.normal(next(ks), (48, D)) * 0.1, "layers": layers,
            "head": jax.random.normal(next(ks), (D, CLASSES)) * D ** -0.5}


def rmsnorm(x, g):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-6) * g).astype(x.dtype)


def forward(params, x):
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)  # bf16 compute copy
    h = x.astype(jnp.bfloat16) @ p["in_proj"]
    B, T, _ = h.shape
    for lp in p["layers"]:
        y = rmsnorm(h, lp["ln1"])
        q, k, v = jnp.split(y @ lp["wqkv"], 3, axis=-1)
        q, k, v = (t.reshape(B, T, HEADS, D // HEADS) for t in (q, k, v))
        att = jax.nn.dot_product_attention(q, k, v)
        h = h + att.reshape(B, T, D) @ lp["wo"]
        y = rmsnorm(h, lp["ln2"])
        h = h + jax.nn.gelu(y @ lp["w1"]) @ lp["w2"]
    return (h.mean(axis=1) @ p["head"]).astype(jnp.float32)


tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(1e-3, 1e-5, 20_000), weight_decay=0.05))


def train_step(state: State, x, labels):
    def scaled_loss(params):
        loss = optax.softmax_cross_entropy_with_integer_labels(forward(params, x), labels).mean()
        return loss * state.loss_scale, loss
    grads, loss = jax.grad(scaled_loss, has_aux=True)(state.params)
    grads = jax.tree_util.tree_map(lambda g: g / state.loss_scale, grads)
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    params = jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new_params, state.params)
    opt_state = jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new_opt, state.opt_state)
    loss_scale = jnp.where(finite, state.loss_scale, state.loss_scale / 2)
    return State(params, opt_state, loss_scale, state.step + 1), loss


def make():
    params = init_params(jax.random.key(0))
    state = State(params, tx.init(params), jnp.float32(2.0 ** 15), jnp.zeros((), jnp.int32))
    x = jax.random.normal(jax.random.key(1), (32, SEQ, 48))
    labels = jax.random.randint(jax.random.key(2), (32,), 0, CLASSES)
    return train_step, (state, x, labels)
