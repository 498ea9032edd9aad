"""Plain JAX LoRA fine-tune of a frozen MLP stack: optax.multi_transform (AdamW on adapters, set_to_zero on base), rank 7 adapters."""
import jax
import jax.numpy as jnp
import optax

D, FF, LAYERS, RANK, SEQ = 640, 1717, 8, 7, 96


def init_params(key):
    layers = []
    for i in range(LAYERS):
        k = jax.random.split(jax.random.fold_in(key, i), 4)
        layers.append({"base": {"w_in": jax.random.normal(k[0], (D, FF)) * D ** -0.5,
                                "w_out": jax.random.normal(k[1], (FF, D)) * FF ** -0.5},
                       "lora": {"a": jax.random.normal(k[2], (D, RANK)) * 0.01, "b": jnp.zeros((RANK, FF))}})
    return {"layers": layers, "head": {"base": jax.random.normal(key, (D, 10)) * D ** -0.5}}


def forward(params, x):
    for lp in params["layers"]:
        h = x @ lp["base"]["w_in"] + (x @ lp["lora"]["a"]) @ lp["lora"]["b"]
        x = x + jax.nn.gelu(h) @ lp["base"]["w_out"]
        x = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
    return x.mean(axis=1) @ params["head"]["base"]


def label_fn(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if any(getattr(k, "key", None) == "lora" for k in path) else "freeze", params)


tx = optax.multi_transform({"train": optax.adamw(1e-3), "freeze": optax.set_to_zero()}, label_fn)


def train_step(params, opt_state, x, y):
    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make():
    params = init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (64, SEQ, D))
    y = jax.random.randint(jax.random.key(2), (64,), 0, 10)
    return train_step, (params, tx.init(params), x, y)
