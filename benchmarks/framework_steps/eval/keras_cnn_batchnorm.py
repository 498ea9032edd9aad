"""Keras 3 Sequential CNN with BatchNormalization and max pooling, SGD with momentum, categorical loss: the train step model.fit compiles."""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # noqa: E402
import numpy as np  # noqa: E402

FRAMEWORK = "keras"
BUILD_ON_DEVICE = True   # Keras makes its variables where it builds: on the chip, as users do
BATCH = 64


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64, 64, 3))])
    for filters in (64, 128, 256):
        model.add(keras.layers.Conv2D(filters, 3, padding="same"))
        model.add(keras.layers.BatchNormalization())
        model.add(keras.layers.Activation("relu"))
        model.add(keras.layers.MaxPooling2D())
    model.add(keras.layers.GlobalAveragePooling2D())
    model.add(keras.layers.Dense(10))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    x = np.ones((BATCH, 64, 64, 3), np.float32)
    y = np.zeros((BATCH, 10), np.float32)
    return model, x, y


def make():
    model, x, y = build()
    return model, (x, y)


def lowered():
    from keras_truth import keras_lowered

    return keras_lowered(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    model, x, y = objects
    model.fit(x, y, batch_size=BATCH, epochs=steps, verbose=0, shuffle=False)


def loop(steps):
    run(build(), steps)
