"""MNIST-style linen CNN on 28x28 grayscale images, TrainState + Adam, as in the Flax MNIST example."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


def train_step(state, images, labels):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make():
    cnn = CNN()
    params = cnn.init(jax.random.key(0), jnp.ones([1, 28, 28, 1]))["params"]
    state = train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=optax.adam(1e-3))
    images = jax.random.uniform(jax.random.key(1), (256, 28, 28, 1))
    labels = jax.random.randint(jax.random.key(2), (256,), 0, 10)
    return train_step, (state, images, labels)
