"""Keras 3 on the JAX backend: a Sequential CNN (Conv2D, BatchNormalization, MaxPooling2D, GlobalAveragePooling2D, Dropout) trained with the documented JAX custom loop (model.stateless_call, optimizer.stateless_apply, keras.optimizers.Adam)."""
import os
os.environ.setdefault('KERAS_BACKEND', 'jax')
import jax, jax.numpy as jnp, keras


def build():
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(64, 3, padding='same'), keras.layers.BatchNormalization(), keras.layers.ReLU(),
        keras.layers.Conv2D(64, 3, padding='same'), keras.layers.BatchNormalization(), keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(128, 3, padding='same'), keras.layers.BatchNormalization(), keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(256, 3, padding='same'), keras.layers.BatchNormalization(), keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dropout(0.3), keras.layers.Dense(10),
    ])


def make(batch: int = 64):
    model = build()
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    ov = [v.value for v in optimizer.variables]
    x = jnp.ones((batch, 32, 32, 3)); y = jnp.zeros((batch,), jnp.int32)

    def compute_loss(tv, ntv, x, y):
        logits, ntv = model.stateless_call(tv, ntv, x, training=True)
        return loss_obj(y, logits), ntv

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    def train_step(tv, ntv, ov, x, y):
        (loss, ntv), grads = grad_fn(tv, ntv, x, y)
        tv, ov = optimizer.stateless_apply(ov, grads, tv)
        return loss, tv, ntv, ov
    return train_step, (tv, ntv, ov, x, y)
