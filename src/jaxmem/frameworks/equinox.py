"""Equinox: the program `eqx.filter_jit` compiles.

`filter_jit` traces every array of its arguments (and of the function, a module being a
function too) and holds everything else static: activation functions, Python numbers, strings.
A `filter_jit` function is read through its own `jax.jit` and its own split of the arguments,
so the figures are those of the program Equinox runs (its donation, `"all"` or
`"all-except-first"`, included). A plain function that takes Equinox modules is read as
`eqx.filter_jit(fn)` runs it: `jax.jit` cannot take a module's non-array fields.

    step = step_of(eqx.filter_jit(train_step), (model, opt_state, x, y), {})

Arguments may be arrays or `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape` of a model too
large to build): each array leaf stands in Equinox's split as a placeholder array and comes
back as a struct, so nothing is allocated.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from jaxmem.errors import PlanError
from jaxmem.frameworks.step import (
    Change, Step, arg_names, copy_arrays, devices_of, fn_name, from_args_info, one_line, to_struct,
)


def loaded() -> bool:
    """Whether the user's process has imported Equinox (jaxmem never imports it on its own)."""
    return "equinox" in sys.modules


def _wrapper_and_self(fn: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """(the `filter_jit` wrapper, the instance it is bound to) of a `filter_jit` function or
    method; None for anything else."""
    if not loaded():
        return None
    kind = type(fn)
    if kind.__name__ == "_JitWrapper" and kind.__module__.startswith("equinox"):
        return fn, ()
    if kind.__name__ == "Partial" and kind.__module__.startswith("equinox"):
        inner = _wrapper_and_self(getattr(fn, "func", None))
        if inner is not None and not getattr(fn, "keywords", None):
            return inner[0], tuple(fn.args)
    return None


def is_filter_jit(fn: Any) -> bool:
    """Whether `fn` is an `eqx.filter_jit` function (or a method of a module, bound by Equinox)."""
    return _wrapper_and_self(fn) is not None


def takes_modules(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether any argument holds an Equinox module with a field `jax.jit` cannot take (an
    activation function, a string): only `filter_jit` runs such a step. A module of arrays alone
    (`eqx.partition`'s arrays) is a pytree `jax.jit` takes as it is."""
    if not loaded():
        return False
    import equinox as eqx
    import jax
    import numpy as np

    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    modules = [x for x in jax.tree.leaves((tuple(args), kwargs), is_leaf=is_module) if is_module(x)]
    takes = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex)
    return any(not isinstance(leaf, takes) for module in modules for leaf in jax.tree.leaves(module))


def _donate_mode(donate: Sequence[int] | None, count: int) -> str:
    """`filter_jit`'s `donate=` for donated positions: Equinox donates everything, everything
    but the first argument, or nothing."""
    wanted = set(donate or ())
    if not wanted:
        return "none"
    if wanted == set(range(count)):
        return "all"
    if wanted == set(range(1, count)):
        return "all-except-first"
    raise PlanError(f"donate={tuple(sorted(wanted))}: eqx.filter_jit donates all arguments, all but the first, or "
                    "none; donate all of them, all but the first, or none")


def step_of(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], donate: Sequence[int] | None = None,
            *, jitted_by_user: bool = True) -> Step:
    """The `Step` of an `eqx.filter_jit` function (`jitted_by_user`), or of a plain function
    taking Equinox modules, read as `eqx.filter_jit(fn, donate=...)` runs it."""
    import equinox as eqx

    if jitted_by_user:
        if donate:
            raise PlanError(f"donate= is for plain functions: {fn_name(fn)} is an eqx.filter_jit function, whose "
                            "own donate= says what it donates")
        wrapper, bound = _wrapper_and_self(fn)  # type: ignore[misc]
    else:
        wrapper, bound = eqx.filter_jit(fn, donate=_donate_mode(donate, len(args))), ()
    user_args = bound + tuple(args)
    traced = _traced(wrapper, user_args, kwargs)
    user_fn = wrapper.__wrapped__
    how = None if jitted_by_user else (f"a plain function taking Equinox modules, read as eqx.filter_jit({fn_name(fn)}) "
                                       "runs it: arrays traced, every other field static")
    step = Step(framework="equinox", name=fn_name(user_fn), traced=traced, how=how,
                names=_names(traced, wrapper, user_args, kwargs), user_fn=user_fn, runner=wrapper,
                user_args=user_args, user_kwargs=dict(kwargs), clone=copy_arrays, results=lambda out, a: out,
                devices=devices_of((user_args, kwargs)),
                pure=lambda: (wrapper._cached, *from_args_info(traced)))
    step.changes = lambda: _changes(step, wrapper, bound)
    return step


def _traced(wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """JAX's `Traced` of `filter_jit`'s own `jax.jit` over Equinox's own split of the arguments,
    every array leaf a `jax.ShapeDtypeStruct`."""
    import jax
    import numpy as np

    from equinox import _jit

    stand_in: dict[int, Any] = {}

    def placeholder(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct) or isinstance(leaf, (jax.Array, np.ndarray)):
            marker = np.empty((0,), np.float32)
            stand_in[id(marker)] = to_struct(leaf)
            return marker
        return leaf

    info = (wrapper._signature, wrapper._dynamic_fun, wrapper._static_fun, wrapper.donate_first, wrapper.donate_rest)
    marked_args, marked_kwargs = jax.tree.map(placeholder, (tuple(args), dict(kwargs)))
    try:
        donate, keep, static = _jit._preprocess(info, marked_args, marked_kwargs, return_static=True)
    except TypeError as err:   # the arguments do not match the function's signature
        raise PlanError(f"cannot call {fn_name(wrapper.__wrapped__)} with these arguments: {one_line(err)}") from None
    back = lambda leaf: stand_in.get(id(leaf), to_struct(leaf) if leaf is not None else None)  # noqa: E731
    donate, keep = jax.tree.map(back, (donate, keep))
    try:
        return wrapper._cached.trace(donate, keep, static)
    except PlanError:
        raise
    except Exception as err:  # the user's function failed to trace under filter_jit: one line
        raise PlanError(f"cannot trace {fn_name(wrapper.__wrapped__)} under eqx.filter_jit: {one_line(err)}") from None


def _names(traced: Any, wrapper: Any, user_args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str] | None:
    """`model.layers[0].weight` for each flat input, in the order of Equinox's split (the
    donated half first, each half's `first`, `fun`, `rest` in turn); None where the count is off."""
    import jax

    import equinox as eqx

    params = arg_names(wrapper.__wrapped__, len(user_args))
    parts = {
        "first": [f"{params[0]}{jax.tree_util.keystr(p)}" for p, x in _arrays_with_paths(user_args[0] if user_args else None)],
        "rest": [_rest_name(p, params) for p, x in _arrays_with_paths((tuple(user_args[1:]) + (None,), dict(kwargs)))],
        "fun": [f"{fn_name(wrapper.__wrapped__)}{jax.tree_util.keystr(p)}" for p, x in _arrays_with_paths(wrapper._dynamic_fun)
                if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)],
    }
    donated = {"first": wrapper.donate_first, "fun": wrapper.donate_rest, "rest": wrapper.donate_rest}
    names = [n for half in (True, False) for key in sorted(parts) if donated[key] == half for n in parts[key]]
    infos = jax.tree.leaves(traced.args_info, is_leaf=lambda x: hasattr(x, "donated"))
    return names if len(names) == len(infos) else None


def _arrays_with_paths(tree: Any) -> list[tuple[Any, Any]]:
    import jax
    import numpy as np

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(p, x) for p, x in flat if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))]


def _rest_name(path: Any, params: list[str]) -> str:
    """A path into `(rest_args, kwargs)` as the user's parameter name and the rest of the path."""
    import jax

    head, *tail = path
    if getattr(head, "idx", None) == 0 and tail:   # positional: rest_args[i] is argument i + 1
        index = getattr(tail[0], "idx", 0) + 1
        name = params[index] if index < len(params) else f"args[{index}]"
        return name + jax.tree_util.keystr(tuple(tail[1:]))
    return "kwargs" + jax.tree_util.keystr(tuple(tail))


def _changes(step: Step, wrapper: Any, bound: tuple[Any, ...]) -> list[Change]:
    """Donate the state the step replaces (`donate="all"`, or `"all-except-first"` where the
    first argument is not state)."""
    import equinox as eqx

    from jaxmem.frameworks.plain import replaced_positions

    if bound or wrapper.donate_rest:
        return []
    state = replaced_positions(step.user_args, step.traced)
    if not state:
        return []
    mode = "all" if 0 in state else "all-except-first"
    fun = wrapper.__wrapped__

    def build() -> Step:
        return step_of(eqx.filter_jit(fun, donate=mode), step.user_args, step.user_kwargs)

    said = "every argument (the batch too)" if mode == "all" else "every argument but the first"
    return [Change(f"donate the state the step replaces: {said}", f'eqx.filter_jit({step.name}, donate="{mode}")', build)]
