"""Plain JAX dilated temporal conv net (1D lax.conv, NWC) with bf16 weights and activations end to end, Lion optimizer."""
import jax
import jax.numpy as jnp
import optax

CIN, CH, K, DILATIONS, T, CLASSES = 13, 147, 3, (1, 2, 4, 8, 16, 32), 2000, 29


def init_params(key):
    ks = jax.random.split(key, len(DILATIONS) * 2 + 2)
    p = {"in": (jax.random.normal(ks[0], (1, CIN, CH)) * CIN ** -0.5).astype(jnp.bfloat16), "blocks": []}
    for i, _ in enumerate(DILATIONS):
        p["blocks"].append({
            "conv": (jax.random.normal(ks[2 * i + 1], (K, CH, 2 * CH)) * (K * CH) ** -0.5).astype(jnp.bfloat16),
            "bias": jnp.zeros((2 * CH,), jnp.bfloat16),
            "res": (jax.random.normal(ks[2 * i + 2], (1, CH, CH)) * CH ** -0.5).astype(jnp.bfloat16)})
    p["out"] = (jax.random.normal(ks[-1], (CH, CLASSES)) * CH ** -0.5).astype(jnp.bfloat16)
    return p


def conv1d(x, w, dilation=1):
    pad = (w.shape[0] - 1) * dilation
    return jax.lax.conv_general_dilated(x, w, window_strides=(1,), padding=[(pad, 0)], rhs_dilation=(dilation,),
                                        dimension_numbers=("NWC", "WIO", "NWC"))


def forward(p, x):
    h = conv1d(x, p["in"])
    for blk, d in zip(p["blocks"], DILATIONS):
        y = conv1d(h, blk["conv"], d) + blk["bias"]
        a, g = jnp.split(y, 2, axis=-1)
        h = h + conv1d(jnp.tanh(a) * jax.nn.sigmoid(g), blk["res"])
    return h @ p["out"]


tx = optax.lion(learning_rate=3e-5, weight_decay=0.01, mu_dtype=jnp.bfloat16)


def train_step(params, opt_state, x, y):
    def loss_fn(p):
        logits = forward(p, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make():
    params = init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (24, T, CIN), jnp.bfloat16)
    y = jax.random.randint(jax.random.key(2), (24, T), 0, CLASSES)
    return train_step, (params, tx.init(params), x, y)
