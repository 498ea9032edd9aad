"""Flax NNX MobileNet-style CNN with depthwise (feature_group_count) convs, odd channels 3->21->63, nnx.Optimizer with SGD momentum."""
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class DepthwiseSeparable(nnx.Module):
    def __init__(self, cin, cout, stride, *, rngs):
        self.dw = nnx.Conv(cin, cin, (3, 3), strides=stride, feature_group_count=cin, use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(cin, rngs=rngs)
        self.pw = nnx.Conv(cin, cout, (1, 1), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(cout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu6(self.bn1(self.dw(x)))
        return nnx.relu6(self.bn2(self.pw(x)))


class MobileNetTiny(nnx.Module):
    def __init__(self, num_classes, *, rngs):
        self.stem = nnx.Conv(3, 21, (3, 3), strides=2, rngs=rngs)
        self.blocks = nnx.List([DepthwiseSeparable(21, 42, 1, rngs=rngs),
                                DepthwiseSeparable(42, 63, 2, rngs=rngs),
                                DepthwiseSeparable(63, 63, 1, rngs=rngs),
                                DepthwiseSeparable(63, 126, 2, rngs=rngs)])
        self.head = nnx.Linear(126, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu6(self.stem(x))
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(axis=(1, 2)))


def make():
    model = MobileNetTiny(100, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def train_step(state, images, labels):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    images = jax.random.normal(jax.random.key(1), (64, 96, 96, 3))
    labels = jax.random.randint(jax.random.key(2), (64,), 0, 100)
    return train_step, (state, images, labels)
