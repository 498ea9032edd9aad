"""Plain JAX dict params with 200 tiny bias vectors (lengths 3-17) and a None leaf, Python float lr and bool train args, optax Adam scaled by hand."""
import jax
import jax.numpy as jnp
import optax

N_HEADS = 200
IN = 37


def init_params(key):
    params = {"trunk": {"w": jax.random.normal(key, (IN, 64)) * 0.1, "b": jnp.zeros((64,)), "gate": None}, "heads": {}}
    for i in range(N_HEADS):
        key, sub = jax.random.split(key)
        n = 3 + i % 15
        params["heads"][f"head_{i:03d}"] = {"w": jax.random.normal(sub, (64, n)) * 0.1, "b": jnp.zeros((n,))}
    return params


def forward(params, x, train):
    h = jnp.tanh(x @ params["trunk"]["w"] + params["trunk"]["b"])
    keep = jnp.where(train, 0.9, 1.0)  # a Python bool used arithmetically, not in control flow
    h = h * keep
    outs = [jax.nn.logsumexp(h @ p["w"] + p["b"], axis=-1) for p in params["heads"].values()]
    return jnp.stack(outs, axis=-1)


tx = optax.scale_by_adam()


def train_step(params, opt_state, x, y, lr, train):
    def loss_fn(p):
        return jnp.mean((forward(p, x, train) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    updates = jax.tree_util.tree_map(lambda u: -lr * u, updates)
    return optax.apply_updates(params, updates), opt_state, loss


def make():
    params = init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2048, IN))
    y = jax.random.normal(jax.random.key(2), (2048, N_HEADS))
    return train_step, (params, tx.init(params), x, y, 1e-3, True)
