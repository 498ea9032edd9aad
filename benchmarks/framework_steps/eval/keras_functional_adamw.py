"""Keras 3 functional model (Dense, LayerNormalization, Dropout), AdamW, a sparse categorical loss and accuracy metric: the train step model.fit compiles."""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # noqa: E402
import numpy as np  # noqa: E402

FRAMEWORK = "keras"
BUILD_ON_DEVICE = True   # Keras makes its variables where it builds: on the chip, as users do
IN, WIDTH, CLASSES, BATCH = 1024, 2048, 100, 512


def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((IN,))
    x = inputs
    for _ in range(3):
        x = keras.layers.Dense(WIDTH, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x)
        x = keras.layers.Dropout(0.1)(x)
    outputs = keras.layers.Dense(CLASSES)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    x = np.ones((BATCH, IN), np.float32)
    y = np.zeros((BATCH,), np.int32)
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
