"""Plain JAX bag-of-words recommender: 100003x300 embedding table, gathers + segment_sum pooling, odd tower widths, optax Adagrad."""
import jax
import jax.numpy as jnp
import optax

VOCAB, DIM, BAGS, NNZ = 100_003, 300, 1024, 20_011


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"table": jax.random.normal(k1, (VOCAB, DIM)) * 0.01,
            "tower": [{"w": jax.random.normal(k2, (DIM, 77)) * DIM ** -0.5, "b": jnp.zeros((77,))},
                      {"w": jax.random.normal(k3, (77, 1)) * 77 ** -0.5, "b": jnp.zeros((1,))}]}


def forward(params, ids, segments, weights):
    emb = params["table"][ids] * weights[:, None]
    pooled = jax.ops.segment_sum(emb, segments, num_segments=BAGS)
    h = jax.nn.relu(pooled @ params["tower"][0]["w"] + params["tower"][0]["b"])
    return (h @ params["tower"][1]["w"] + params["tower"][1]["b"])[:, 0]


tx = optax.adagrad(0.05)


def train_step(params, opt_state, ids, segments, weights, clicks):
    def loss_fn(p):
        return optax.sigmoid_binary_cross_entropy(forward(p, ids, segments, weights), clicks).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make():
    params = init_params(jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (NNZ,), 0, VOCAB)
    segments = jnp.sort(jax.random.randint(jax.random.key(2), (NNZ,), 0, BAGS))
    weights = jax.random.uniform(jax.random.key(3), (NNZ,))
    clicks = jax.random.bernoulli(jax.random.key(4), 0.1, (BAGS,)).astype(jnp.float32)
    return train_step, (params, tx.init(params), ids, segments, weights, clicks)
