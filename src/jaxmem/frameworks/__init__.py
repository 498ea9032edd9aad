"""What each framework compiles for a step: one JAX program, read the way the framework runs it.

People write steps through frameworks, and each ends in one `jax.jit` of its own making: Flax
NNX's `nnx.jit` over the modules' state, Equinox's `filter_jit` over the arrays of its
arguments, Keras's trainer over a model's variables. `as_step` finds which one the user handed
in and returns that program as a `Step`, so that every command (`analyze`, `maxbatch`, `fit`,
`record --predict`) judges the program the framework runs, never a smaller one JAX would make
of the same function (a function whose in-place updates `jax.jit` drops, say).

    step = as_step(nnx.jit(train_step), (model, optimizer, x, y))
    step.traced          # JAX's Traced of the program nnx.jit compiles
    step.how             # how jaxmem read it, one line (None for plain JAX)
    step.changes()       # changes worth compiling (donation, fewer outputs), each with code to paste

Modules: `step` (the `Step` and `Change` types, abstract arguments), `plain` (JAX's own
`jax.jit`, with the refusals of in-place updates and leaked tracers), `nnx`, `equinox`, `keras`.
Each framework is imported only where the user's process already has (`sys.modules`).
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxmem.frameworks import equinox, keras, nnx, plain
from jaxmem.frameworks.step import Change, Step

__all__ = ["Change", "Step", "as_step", "framework_of"]

# What to write instead, for a command that takes plain JAX steps only: the step as a pure
# function of the framework's state, which every command reads.
PURE_FORM = {
    "flax.nnx": "graphdef, state = nnx.split((model, optimizer)); a jax.jit step of `state` that calls "
                "nnx.merge(graphdef, state) and returns nnx.state((model, optimizer))",
    "equinox": "a jax.jit step of eqx.partition(model, eqx.is_array)'s arrays that eqx.combine()s them with the rest",
    "keras": "a jax.jit step over model.stateless_call(trainable, non_trainable, x) and optimizer.stateless_apply",
}


def as_step(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
            donate: int | Sequence[int] | None = None) -> Step:
    """The program the framework behind `fn` compiles for `fn(*args, **kwargs)`, traced.

    **Arguments:** `fn` (a function, a `jax.jit`, `nnx.jit` or `eqx.filter_jit` one, or a
    compiled `keras.Model`), its arguments (arrays or `jax.ShapeDtypeStruct`s, in modules,
    optimizers and any pytree; a Keras model's are one batch: `x`, `y`, `sample_weight`), and
    `donate` (positions, for a plain function: its `donate_argnums`).

    **Raises:** `PlanError`, one line: the function fails to trace, updates its arguments in
    place where its framework would drop the update, leaks a traced value, or cannot be read.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    positions = (donate,) if isinstance(donate, int) else (tuple(donate) if donate is not None else None)
    if keras.is_model(fn):
        return keras.step_of(fn, args, kwargs, positions)
    if nnx.is_nnx_jit(fn):
        return nnx.step_of(fn, args, kwargs, positions)
    if equinox.is_filter_jit(fn):
        return equinox.step_of(fn, args, kwargs, positions)
    if not plain.is_jitted(fn):
        if nnx.takes_graph_nodes(args, kwargs):
            return nnx.step_of(fn, args, kwargs, _positions(positions, len(args)), jitted_by_user=False)
        if equinox.takes_modules(args, kwargs):
            return equinox.step_of(fn, args, kwargs, _positions(positions, len(args)), jitted_by_user=False)
    return plain.step_of(fn, args, kwargs, positions)


def framework_of(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> str:
    """Whose step `fn(*args, **kwargs)` is, without tracing it: "keras", "flax.nnx",
    "equinox" or "jax"."""
    args, kwargs = tuple(args), dict(kwargs or {})
    if keras.is_model(fn):
        return "keras"
    if nnx.is_nnx_jit(fn) or (not plain.is_jitted(fn) and nnx.takes_graph_nodes(args, kwargs)):
        return "flax.nnx"
    if equinox.is_filter_jit(fn) or (not plain.is_jitted(fn) and equinox.takes_modules(args, kwargs)):
        return "equinox"
    return "jax"


def _positions(donate: tuple[int, ...] | None, count: int) -> tuple[int, ...]:
    from jaxmem.compiler.jaxpr_adapter import donate_positions

    return donate_positions(count, donate or ())
