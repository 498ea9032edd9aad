"""Keras 3 on the JAX backend: a functional-API text classifier (Embedding, stacked LSTMs, Dense) trained with model.stateless_call and keras.optimizers.AdamW.stateless_apply."""
import os
os.environ.setdefault('KERAS_BACKEND', 'jax')
import jax, jax.numpy as jnp, keras

V, T = 20000, 200


def build():
    inp = keras.Input((T,), dtype='int32')
    x = keras.layers.Embedding(V, 128)(inp)
    x = keras.layers.LSTM(256, return_sequences=True)(x)
    x = keras.layers.LSTM(256)(x)
    out = keras.layers.Dense(5)(keras.layers.Dense(128, activation='relu')(x))
    return keras.Model(inp, out)


def make(batch: int = 64):
    model = build()
    optimizer = keras.optimizers.AdamW(1e-3)
    optimizer.build(model.trainable_variables)
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    ov = [v.value for v in optimizer.variables]
    x = jnp.zeros((batch, T), jnp.int32); y = jnp.zeros((batch,), jnp.int32)

    def compute_loss(tv, ntv, x, y):
        logits, ntv = model.stateless_call(tv, ntv, x, training=True)
        return loss_obj(y, logits), ntv

    def train_step(tv, ntv, ov, x, y):
        (loss, ntv), grads = jax.value_and_grad(compute_loss, has_aux=True)(tv, ntv, x, y)
        tv, ov = optimizer.stateless_apply(ov, grads, tv)
        return loss, tv, ntv, ov
    return train_step, (tv, ntv, ov, x, y)
