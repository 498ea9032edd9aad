"""Flax NNX ensemble of MLPs made by nnx.vmap, trained through the functional API: nnx.split once, a jax.jit step of the state that nnx.merge()s it, donated."""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

FRAMEWORK = "flax.nnx"
READ_AS = "jax"   # the functional API: a jax.jit of nnx.split state, a pytree jax.jit takes as it is
MEMBERS, IN, HIDDEN, OUT, BATCH = 8, 256, 1024, 16, 512


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.l3 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.gelu(self.l2(nnx.gelu(self.l1(x)))))


@nnx.split_rngs(splits=MEMBERS)
@nnx.vmap(in_axes=(0,), out_axes=0)
def make_ensemble(rngs):
    return MLP(rngs)


def build():
    ensemble = make_ensemble(nnx.Rngs(0))
    optimizer = nnx.Optimizer(ensemble, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((ensemble, optimizer))
    x = jnp.ones((BATCH, IN))
    y = jnp.zeros((BATCH, OUT))
    return graphdef, state, x, y


def step_for(graphdef):
    def train_step(state, x, y):
        ensemble, optimizer = nnx.merge(graphdef, state)

        def loss_fn(ensemble):
            @nnx.vmap(in_axes=(0, None))
            def predict(member, x):
                return member(x)

            return jnp.mean((predict(ensemble, x) - y[None]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(ensemble)
        optimizer.update(ensemble, grads)
        return loss, nnx.state((ensemble, optimizer))

    return jax.jit(train_step, donate_argnums=0)


def make():
    graphdef, state, x, y = build()
    return step_for(graphdef), (state, x, y)


def lowered():
    graphdef, state, x, y = build()
    return step_for(graphdef).lower(state, x, y)


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    graphdef, state, x, y = objects
    step = step_for(graphdef)
    for _ in range(steps):
        loss, state = step(state, x, y)
    jax.block_until_ready(state)


def loop(steps):
    run(build(), steps)
