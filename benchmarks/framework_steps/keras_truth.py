"""The program Keras's own `fit` compiles for a model's train step, read from Keras itself: the
`jax.jit` its trainer makes (`make_train_function`), lowered on the state and batch it hands it.
Shared by the Keras steps of both sets; the truth jaxmem is held to, written apart from
`jaxmem.frameworks.keras`."""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")


def keras_lowered(model, x, y):
    model._symbolic_build(data_batch=(x, y, None))
    model.make_train_function()
    cells = [c.cell_contents for c in model.train_function.__closure__ or ()]
    jitted = next(c for c in cells if hasattr(c, "lower"))
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                 optimizer_variables=True, metrics_variables=True)
    return jitted.lower(state, (x, y, None))
