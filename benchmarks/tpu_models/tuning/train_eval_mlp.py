"""A training loop that alternates a train step and an eval step over a larger eval batch (plain JAX, Adam): two programs in one process, both with temporaries."""
import jax, jax.numpy as jnp, optax

WIDTHS = (512, 1024, 1024, 10)
tx = optax.adam(1e-3)


def _forward(params, x):
    for w in params[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ params[-1]


def make(batch: int = 256):
    keys = jax.random.split(jax.random.PRNGKey(0), len(WIDTHS))
    params = [jax.random.normal(k, (a, b)) * a ** -0.5 for k, a, b in zip(keys, WIDTHS[:-1], WIDTHS[1:])]
    x = jnp.ones((batch, WIDTHS[0]))
    y = jnp.zeros((batch,), jnp.int32)

    def train_step(params, opt, x, y):
        def loss(params):
            return optax.softmax_cross_entropy_with_integer_labels(_forward(params, x), y).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, value
    return train_step, (params, tx.init(params), x, y)


def make_eval(batch: int = 4096):
    """The eval step: its first argument is the train step's first (the parameters)."""
    _, (params, *_rest) = make()
    x = jnp.ones((batch, WIDTHS[0]))
    y = jnp.zeros((batch,), jnp.int32)

    def eval_step(params, x, y):
        logits = _forward(params, x)
        return (logits.argmax(-1) == y).mean(), optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return eval_step, (params, x, y)
