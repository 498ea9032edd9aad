"""Keras 3 Sequential MLP with Adam and an accuracy metric: the train step model.fit compiles."""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # noqa: E402
import numpy as np  # noqa: E402

FRAMEWORK = "keras"
BUILD_ON_DEVICE = True   # Keras makes its variables where it builds: on the chip, as users do


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model, np.ones((256, 784), np.float32), np.zeros((256,), np.int32)


def make():
    model, x, y = build()
    return model, (x, y)


def lowered():
    from keras_truth import keras_lowered

    return keras_lowered(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    model, x, y = objects
    model.fit(x, y, batch_size=256, epochs=steps, verbose=0, shuffle=False)


def loop(steps):
    run(build(), steps)
