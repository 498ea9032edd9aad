"""Keras 3 on JAX: the training step a compiled `keras.Model` runs in `fit`.

Keras's JAX trainer compiles `jax.jit(model.train_step, donate_argnums=0)` over the model's
state (trainable, non-trainable, optimizer and metrics variables, donated) and one batch
`(x, y, sample_weight)`. `jaxmem.analyze(model, x, y)` reads that program: the batch given is
the batch `fit` would hand the step.

    step = step_of(model, (x, y), {})

The model must be built (its weights made: jaxmem never runs its initializers, which would
change the weights the user's own run gets) and compiled with `jit_compile` (a step run op by
op is no one program). The optimizer and the compiled metrics are built from the batch's
shapes, as `fit` builds them before its first step.

Keras's JAX backend picks some operations by JAX's default backend (its `argmax`, which accuracy
metrics use, works around a CPU flush-to-zero issue when that backend is a CPU), so a step is
traced as it would be on the device it is judged for (`Step.for_platform`, `traced_as`): on a
TPU v5e, the program Keras compiles there.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Sequence

from jaxmem.errors import PlanError
from jaxmem.frameworks.step import Step, abstract, devices_of, from_args_info, one_line


def loaded() -> bool:
    """Whether the user's process has imported Keras (jaxmem never imports it on its own)."""
    return "keras" in sys.modules


def is_model(fn: Any) -> bool:
    """Whether `fn` is a `keras.Model`."""
    if not loaded():
        return False
    import keras

    return isinstance(fn, keras.Model)


def _batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """`(x, y, sample_weight)` from `(x,)`, `(x, y)` or `(x, y, sample_weight)` and keywords."""
    names = ("x", "y", "sample_weight")
    unknown = set(kwargs) - set(names)
    if unknown or len(args) > 3:
        raise PlanError("a Keras model is analysed on one batch: jaxmem.analyze(model, x, y) or "
                        "(model, x, y, sample_weight), as model.fit would hand it to the train step")
    values = list(args) + [None] * (3 - len(args))
    for k, name in enumerate(names):
        if name in kwargs:
            values[k] = kwargs[name]
    if values[0] is None:
        raise PlanError("a Keras model is analysed on one batch: give at least x, jaxmem.analyze(model, x, y)")
    return values[0], values[1], values[2]


def _check(model: Any) -> None:
    """One line for a model whose step is no one JAX program jaxmem can read."""
    import keras

    name = getattr(model, "name", type(model).__name__)
    if keras.backend.backend() != "jax":
        raise PlanError(f"Keras runs on {keras.backend.backend()} here: jaxmem reads Keras on JAX "
                        "(set KERAS_BACKEND=jax before importing keras)")
    if not model.built or not all(layer.built for layer in model._flatten_layers()):
        raise PlanError(f"the Keras model {name!r} is not built (its weights are not made yet): build it, "
                        "model.build(input_shape) or model(x) on a batch, then analyse it")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise PlanError(f"the Keras model {name!r} is not compiled: model.compile(optimizer=..., loss=...) first, "
                        "as model.fit needs")
    if getattr(model, "run_eagerly", False) or not getattr(model, "jit_compile", True):
        raise PlanError(f"the Keras model {name!r} is compiled with run_eagerly=True or jit_compile=False: its step "
                        "runs op by op, not as one program; compile it with jit_compile=True to analyse it")
    from keras.src.distribution import distribution_lib

    if distribution_lib.distribution() is not None:
        raise PlanError("a keras.distribution is set: jaxmem reads Keras steps on one device; for a mesh, give a "
                        "jax.jit step with NamedSharding arguments")


def state_of(model: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The state Keras's trainer hands its step: trainable, non-trainable, optimizer and metrics
    variables' values, in its order."""
    values = lambda variables: [v.value for v in variables]  # noqa: E731
    return (values(model.trainable_variables), values(model.non_trainable_variables),
            values(model.optimizer.variables), values(model.metrics_variables))


def step_of(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], donate: Sequence[int] | None = None,
            platform: str | None = None) -> Step:
    """The `Step` of `model.fit`'s train step on the batch `args` (`x`, `y`, `sample_weight`),
    traced as on `platform` ("cpu", "gpu", "tpu"; None: this process's own backend)."""
    import jax

    if donate:
        raise PlanError("donate= does not apply to a Keras model: its trainer donates the model's state itself")
    _check(model)
    data = _batch(tuple(args), dict(kwargs))
    try:
        model._symbolic_build(data_batch=abstract(data))   # the optimizer and metrics, as fit builds them
    except Exception as err:  # Keras could not build its optimizer or metrics for this batch
        raise PlanError(f"Keras could not build the train step of {model.name!r} for this batch: {one_line(err)}") from None
    state = state_of(model)

    def train_step(state: Any, data: Any) -> Any:   # a fresh function: JAX's trace cache must not
        return model.train_step(state, data)         # hand back a trace made for another platform

    jitted = jax.jit(train_step, donate_argnums=0)
    try:
        with traced_as(platform):
            traced = jitted.trace(abstract(state), abstract(data))
    except Exception as err:  # the model's train step failed on this batch: one line
        raise PlanError(f"cannot trace {model.name!r}'s train step on this batch: {one_line(err)}") from None
    names = _names(model)
    infos = jax.tree.leaves(traced.args_info, is_leaf=lambda x: hasattr(x, "donated"))
    names += [f"data[{k}]" for k in range(len(infos) - len(names))]
    return Step(framework="keras", name=f"{model.name}.train_step", traced=traced,
                how=f"the train step model.fit runs for Keras model {model.name!r}: jax.jit(train_step, "
                    "donate_argnums=0) over the model's state and this batch",
                names=names if len(names) == len(infos) else None, state=frozenset(range(len(_names(model)))),
                user_fn=type(model).train_step, devices=devices_of((state, data)),
                pure=lambda: (jitted, *from_args_info(traced)),
                for_platform=lambda where: traced if where == (platform or jax.default_backend())
                else step_of(model, args, kwargs, None, where).traced)


class _BackendAs:
    """JAX's module as Keras's JAX backend reads it, with `default_backend()` naming `platform`."""

    def __init__(self, jax_module: Any, platform: str) -> None:
        self._jax, self._platform = jax_module, platform

    def default_backend(self) -> str:
        return self._platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jax, name)


@contextlib.contextmanager
def traced_as(platform: str | None) -> Iterator[None]:
    """While a Keras step traces: Keras's backend operations see JAX's default backend as
    `platform` (None, or this process's own: nothing changes). Only Keras's own module is
    touched, and only for the trace."""
    import jax

    if platform is None or platform == jax.default_backend():
        yield
        return
    from keras.src.backend.jax import numpy as backend_numpy

    real = backend_numpy.jax
    backend_numpy.jax = _BackendAs(real, platform)
    try:
        yield
    finally:
        backend_numpy.jax = real


def _names(model: Any) -> list[str]:
    """The state's flat inputs by the variables' paths."""
    groups = (("trainable", model.trainable_variables), ("non_trainable", model.non_trainable_variables),
              ("optimizer", model.optimizer.variables), ("metrics", model.metrics_variables))
    return [f"{group}:{getattr(v, 'path', getattr(v, 'name', k))}" for group, variables in groups
            for k, v in enumerate(variables)]
