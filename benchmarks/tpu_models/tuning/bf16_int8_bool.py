"""bf16 weights, int8 quantized features with a per-feature scale, a bool mask over the batch, Adam."""
import jax, jax.numpy as jnp, optax


def make(batch: int = 96):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    params = {"w1": (jax.random.normal(k1, (200, 333)) * 0.05).astype(jnp.bfloat16),
              "b1": jnp.zeros((333,), jnp.bfloat16),
              "w2": (jax.random.normal(k2, (333, 5)) * 0.05).astype(jnp.bfloat16)}
    tx = optax.adam(1e-3)
    opt = tx.init(params)
    q = (jnp.arange(batch * 200, dtype=jnp.int32).reshape(batch, 200) % 255 - 127).astype(jnp.int8)
    scale = jnp.full((200,), 0.01, jnp.float32)
    mask = jnp.arange(batch) % 3 != 0
    target = jnp.zeros((batch, 5), jnp.bfloat16)

    def step(params, opt, q, scale, mask, target):
        def loss(params):
            x = (q.astype(jnp.float32) * scale).astype(jnp.bfloat16)
            h = jax.nn.relu(x @ params["w1"] + params["b1"])
            err = ((h @ params["w2"] - target).astype(jnp.float32) ** 2).sum(-1)
            return jnp.where(mask, err, 0.0).sum() / mask.sum()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, value
    return step, (params, opt, q, scale, mask, target)
