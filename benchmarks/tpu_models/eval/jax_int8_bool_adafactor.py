"""Plain JAX tabular MLP on int8-quantized features dequantized in the step, bool row/feature masks, odd widths (1000, 37), Adafactor."""
import jax
import jax.numpy as jnp
import optax

FEATURES, H1, H2, OUT = 1111, 1000, 37, 1


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"l1": {"w": jax.random.normal(k1, (FEATURES, H1)) * FEATURES ** -0.5, "b": jnp.zeros((H1,))},
            "l2": {"w": jax.random.normal(k2, (H1, H2)) * H1 ** -0.5, "b": jnp.zeros((H2,))},
            "l3": {"w": jax.random.normal(k3, (H2, OUT)) * H2 ** -0.5, "b": jnp.zeros((OUT,))}}


def forward(params, x):
    h = jax.nn.relu(x @ params["l1"]["w"] + params["l1"]["b"])
    h = jax.nn.relu(h @ params["l2"]["w"] + params["l2"]["b"])
    return (h @ params["l3"]["w"] + params["l3"]["b"])[:, 0]


tx = optax.adafactor(learning_rate=1e-3)


def train_step(params, opt_state, q_features, scales, feature_mask, row_mask, labels):
    x = q_features.astype(jnp.float32) * scales  # dequantize int8 -> f32
    x = jnp.where(feature_mask[None, :], x, 0.0)
    def loss_fn(p):
        logits = forward(p, x)
        per_row = optax.sigmoid_binary_cross_entropy(logits, labels.astype(jnp.float32))
        return jnp.sum(jnp.where(row_mask, per_row, 0.0)) / jnp.maximum(row_mask.sum(), 1)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make():
    params = init_params(jax.random.key(0))
    B = 8191
    q = jax.random.randint(jax.random.key(1), (B, FEATURES), -128, 128, dtype=jnp.int8)
    scales = jax.random.uniform(jax.random.key(2), (FEATURES,), minval=0.001, maxval=0.05)
    feature_mask = jax.random.bernoulli(jax.random.key(3), 0.9, (FEATURES,))
    row_mask = jax.random.bernoulli(jax.random.key(4), 0.95, (B,))
    labels = jax.random.bernoulli(jax.random.key(5), 0.3, (B,))
    return train_step, (params, tx.init(params), q, scales, feature_mask, row_mask, labels)
