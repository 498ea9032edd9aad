"""Plain JAX convnet step: jax.jit with in_shardings and out_shardings on a one-device mesh, a static config tuple (static_argnums) and the parameters and optimizer state donated."""
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

FRAMEWORK = "jax"
BATCH = 128
optim = optax.sgd(0.01, momentum=0.9)


def init(key):
    keys = jax.random.split(key, 4)
    conv = lambda k, i, o: jax.random.normal(k, (3, 3, i, o)) * 0.05  # noqa: E731
    return {"c1": conv(keys[0], 3, 64), "c2": conv(keys[1], 64, 128), "c3": conv(keys[2], 128, 256),
            "head": jax.random.normal(keys[3], (256, 10)) * 0.05}


def forward(params, x, config):
    strides, padding = config
    for name in ("c1", "c2", "c3"):
        x = jax.lax.conv_general_dilated(x, params[name], (strides, strides), padding,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = jax.nn.relu(x)
    return x.mean(axis=(1, 2)) @ params["head"]


def train_step(params, opt_state, batch, config):
    images, labels = batch

    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, images, config), labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def jitted():
    mesh = Mesh(jax.devices()[:1], ("data",))
    replicated = NamedSharding(mesh, P())
    return jax.jit(train_step, in_shardings=(replicated, replicated, NamedSharding(mesh, P("data"))),
                   out_shardings=(replicated, replicated, replicated), static_argnums=(3,), donate_argnums=(0, 1))


def build():
    params = init(jax.random.key(0))
    batch = (jnp.ones((BATCH, 64, 64, 3)), jnp.zeros((BATCH,), jnp.int32))
    return params, optim.init(params), batch, (2, "SAME")


def make():
    return jitted(), build()


def lowered():
    return jitted().lower(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    step = jitted()
    params, opt_state, batch, config = objects
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch, config)
    jax.block_until_ready(params)


def loop(steps):
    run(build(), steps)
