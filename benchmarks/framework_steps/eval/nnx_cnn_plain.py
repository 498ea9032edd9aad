"""Flax NNX CNN with BatchNorm and Dropout, trained by a plain function that updates the model, the optimizer and a metric in place (as NNX code is written before nnx.jit is put on it)."""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

FRAMEWORK = "flax.nnx"
BATCH = 128


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 64, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(64, rngs=rngs)
        self.conv2 = nnx.Conv(64, 128, (3, 3), strides=(2, 2), rngs=rngs)
        self.bn2 = nnx.BatchNorm(128, rngs=rngs)
        self.conv3 = nnx.Conv(128, 256, (3, 3), strides=(2, 2), rngs=rngs)
        self.bn3 = nnx.BatchNorm(256, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(256, 100, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = nnx.relu(self.bn3(self.conv3(x)))
        x = x.mean(axis=(1, 2))
        return self.head(self.dropout(x))


def loss_fn(model, images, labels):
    logits = model(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, logits


def train_step(model, optimizer, metrics, images, labels):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, images, labels)
    metrics.update(loss=loss, logits=logits, labels=labels)
    optimizer.update(model, grads)


def build():
    model = CNN(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    images = jnp.ones((BATCH, 64, 64, 3))
    labels = jnp.zeros((BATCH,), jnp.int32)
    return model, optimizer, metrics, images, labels


def make():
    return train_step, build()


def lowered():
    return nnx.jit(train_step).lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    step = nnx.jit(train_step)
    model, optimizer, metrics, images, labels = objects
    for _ in range(steps):
        step(model, optimizer, metrics, images, labels)
    jax.block_until_ready(nnx.state(model))


def loop(steps):
    run(build(), steps)
