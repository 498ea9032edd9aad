"""Flax NNX: the program `nnx.jit` compiles.

An `nnx.jit` function is read through NNX's own trace: the modules, optimizers and other graph
nodes it takes are split into their state, which is the program's input, and the state the
function updates comes back as an output, so the figures are those of the program NNX runs. A
plain function that takes graph nodes is read as `nnx.jit(fn)` runs it: `jax.jit` would drop its
in-place updates as dead code, which is not the program NNX users run.

    step = step_of(nnx.jit(train_step), (model, optimizer, x, y), {})
    step.traced.jaxpr, step.names[:2]    # ['model.layers[0].bias', 'model.layers[0].kernel']

Nothing of the user's is changed: the arguments are copied into abstract objects (NNX's own split
and merge over all of them at once, so a Variable two arguments share stays one) before anything
is traced.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Sequence

from jaxmem.errors import PlanError
from jaxmem.frameworks.step import (
    Change, Step, abstract, arg_names, copy_arrays, devices_of, donated_positions, fn_name, from_args_info, in_context,
    one_line,
)

_JIT_CLASSES = ("JitWrapped", "SimpleJitWrapped", "SimpleJitPartialWrapped")


def loaded() -> bool:
    """Whether the user's process has imported Flax NNX (jaxmem never imports it on its own)."""
    return "flax.nnx" in sys.modules


def is_nnx_jit(fn: Any) -> bool:
    """Whether `fn` is an `nnx.jit` function (or a method of one, which NNX binds as a partial)."""
    if not loaded():
        return False
    target = fn.func if isinstance(fn, functools.partial) else fn
    return type(target).__name__ in _JIT_CLASSES and type(target).__module__.startswith("flax.nnx")


def is_graph_node(x: Any) -> bool:
    """A module, an optimizer, `nnx.Rngs`: an object NNX splits into state. A Variable alone (as
    `nnx.split`'s `State` holds them) is not: a step of `State`s is a pure function `jax.jit`
    takes as it is (NNX's functional API), and one that updates a Variable in place is refused."""
    from flax import nnx

    return bool(nnx.graph.is_graph_node(x)) and not isinstance(x, nnx.Variable)


def takes_graph_nodes(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether any argument is, or holds, an NNX graph node."""
    if not loaded():
        return False
    import jax

    return any(is_graph_node(x) for x in jax.tree.leaves((tuple(args), kwargs), is_leaf=is_graph_node))


def abstract_nodes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of the arguments with every array a `jax.ShapeDtypeStruct`."""
    from flax import nnx

    graphdef, state = nnx.split((tuple(args), dict(kwargs)))
    copy_args, copy_kwargs = nnx.merge(graphdef, abstract(state))
    return tuple(copy_args), dict(copy_kwargs)


def step_of(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], donate: Sequence[int] | None = None,
            *, jitted_by_user: bool = True) -> Step:
    """The `Step` of an `nnx.jit` function (`jitted_by_user`), or of a plain function that takes
    graph nodes, read as `nnx.jit(fn, donate_argnums=donate)` runs it."""
    from flax import nnx

    prefix: tuple[Any, ...] = ()
    if isinstance(fn, functools.partial):   # a method of an nnx.jit function: NNX binds `self` so
        prefix, kwargs = tuple(fn.args), {**fn.keywords, **kwargs}
        fn = fn.func
    if jitted_by_user and donate:
        raise PlanError(f"donate= is for plain functions: {fn_name(fn)} is an nnx.jit function, whose own "
                        "donate_argnums or donate_argnames say what it donates")
    wrapper = fn if jitted_by_user else nnx.jit(fn, donate_argnums=tuple(donate or ()))
    user_args = prefix + tuple(args)
    try:
        copy_args, copy_kwargs = abstract_nodes(user_args, kwargs)
    except PlanError:
        raise
    except Exception as err:  # NNX's split refused the arguments: one line
        raise PlanError(f"Flax NNX could not split the arguments of {fn_name(fn)}: {one_line(err)}") from None
    traced = _traced(wrapper, copy_args, copy_kwargs)
    user_fn = getattr(wrapper, "fun", fn)
    how = None if jitted_by_user else (f"a plain function taking Flax NNX objects, read as nnx.jit({fn_name(fn)}) runs it: "
                                       "the state it updates is an output of the program")
    step = Step(framework="flax.nnx", name=fn_name(user_fn), traced=traced, how=how,
                names=_names(traced, user_args, kwargs, user_fn), state=_state_leaves(user_args, kwargs),
                user_fn=user_fn, runner=wrapper, user_args=user_args, user_kwargs=dict(kwargs),
                clone=clone, results=_results, devices=devices_of((user_args, kwargs)),
                pure=lambda: _pure(wrapper, traced))
    step.changes = lambda: _changes(step, wrapper, traced, prefix)
    return step


def clone(tree: Any) -> Any:
    """A copy of `tree` (the arguments, graph nodes among them) with every array copied: a
    donating run consumes the copy's buffers, never the user's."""
    from flax import nnx

    graphdef, state = nnx.split(tree)
    return nnx.merge(graphdef, copy_arrays(state))


def _traced(wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """JAX's `Traced` of the program `wrapper` (an `nnx.jit` function) compiles for these
    arguments: NNX's own `trace`, unwrapped."""
    try:
        staged = wrapper.trace(*args, **kwargs)
    except PlanError:
        raise
    except Exception as err:  # the user's function failed to trace under nnx.jit: one line
        raise PlanError(f"cannot trace {fn_name(wrapper)} under nnx.jit: {one_line(err)}") from None
    inner = getattr(staged, "traced", None)
    if inner is None or not hasattr(inner, "jaxpr"):
        import flax

        raise PlanError(f"this Flax ({flax.__version__}) gives no JAX Traced for nnx.jit's trace: jaxmem reads "
                        "nnx.jit of Flax 0.10 to 0.12; pass a plain function of nnx.split state instead")
    return inner


def _pure(wrapper: Any, traced: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The function inside `nnx.jit` (its `jax.jit`, in NNX's update context where it needs
    one) and the state arguments it takes."""
    from flax.nnx import graphlib

    args, kwargs = from_args_info(traced)
    context = (lambda: graphlib.update_context(wrapper)) if type(wrapper).__name__ == "JitWrapped" else None
    return in_context(wrapper.jitted_fn, context), args, kwargs


def _flat_paths(user_args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """The flat inputs' paths in the order NNX's split lays them out (a shared Variable once);
    None where NNX cannot say."""
    from flax import nnx

    try:
        _, flat = nnx.graph.flatten((tuple(user_args), dict(kwargs)), with_paths=True)
        return [tuple(path) for path, _ in flat]
    except Exception:  # an NNX without paths: the reports name inputs by position
        return None


def _names(traced: Any, user_args: tuple[Any, ...], kwargs: dict[str, Any], user_fn: Any) -> list[str] | None:
    """`model.layers[0].kernel` for each flat input, where NNX's order of the state is the
    program's (as many leaves, each of the same shape); else None."""
    import jax

    infos = jax.tree.leaves(traced.args_info, is_leaf=lambda x: hasattr(x, "donated"))
    paths = _flat_paths(user_args, kwargs)
    if paths is None or len(paths) != len(infos):
        return None
    from flax import nnx

    _, flat = nnx.graph.flatten((tuple(user_args), dict(kwargs)), with_paths=True)
    if any(tuple(getattr(v, "shape", ())) != tuple(i._aval.shape) for (_, v), i in zip(flat, infos)):
        return None
    params = arg_names(user_fn, len(user_args))
    return [_path_name(path, params) for path in paths]


def _path_name(path: tuple[Any, ...], params: list[str]) -> str:
    """(0, 1, 'layers', 0, 'kernel') as `optimizer.layers[0].kernel`; keyword arguments by name."""
    where, rest = path[0], list(path[1:])
    if where == 0 and rest and isinstance(rest[0], int) and rest[0] < len(params):
        head = params[rest.pop(0)]
    else:
        head = str(rest.pop(0)) if rest else "args"
    return head + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest)


def _state_leaves(user_args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[int]:
    """The flat inputs that are graph nodes' state (not the batch)."""
    paths = _flat_paths(user_args, kwargs)
    if paths is None:
        return frozenset()
    nodes = {i for i, a in enumerate(user_args) if takes_graph_nodes((a,), {})}
    named = {k for k, v in kwargs.items() if takes_graph_nodes((v,), {})}
    return frozenset(i for i, p in enumerate(paths)
                     if len(p) > 1 and ((p[0] == 0 and p[1] in nodes) or (p[0] == 1 and p[1] in named)))


def _results(out: Any, user_args: tuple[Any, ...]) -> Any:
    """What a run leaves for the user: its outputs and every graph node's state after it."""
    from flax import nnx

    return out, [nnx.state(a) for a in user_args if takes_graph_nodes((a,), {})]


def _options(wrapper: Any, traced: Any, prefix: tuple[Any, ...]) -> dict[str, Any] | None:
    """What `nnx.jit` was called with, as far as a changed copy needs it; None where a copy
    cannot be made alike (shardings set, or a method bound to its instance)."""
    if prefix or getattr(wrapper, "in_shardings", None) is not None or getattr(wrapper, "out_shardings", None) is not None:
        return None
    options: dict[str, Any] = {"donate_argnums": donated_positions(traced)}
    static = getattr(wrapper, "static_argnums", None)
    if static:
        options["static_argnums"] = static
    if type(wrapper).__name__ != "JitWrapped":   # tree mode, or graph mode without graph updates
        options["graph"] = bool(getattr(wrapper, "graph", False))
        options["graph_updates"] = False
    return options


def _changes(step: Step, wrapper: Any, traced: Any, prefix: tuple[Any, ...]) -> list[Change]:
    """The changes to try: donate the graph nodes the step takes; return only the Variables that
    changed (`graph_updates=False`, Flax 0.12 and later)."""
    from flax import nnx

    options = _options(wrapper, traced, prefix)
    if options is None or step.user_fn is None:
        return []
    fun, name = step.user_fn, step.name
    nodes = [i for i, a in enumerate(step.user_args) if takes_graph_nodes((a,), {})]
    params = arg_names(fun, len(step.user_args))
    changes = []
    donated = set(options["donate_argnums"])
    if nodes and not set(nodes) <= donated:
        wanted = tuple(sorted(donated | set(nodes)))
        names = tuple(params[i] for i in wanted)
        code = (f"nnx.jit({name}, donate_argnames={names!r})" if not any(n.startswith("args[") for n in names)
                else f"nnx.jit({name}, donate_argnums={wanted!r})")
        changes.append(_change("donate the Flax NNX objects the step updates", code, fun,
                               {**options, "donate_argnums": wanted}, step))
    if "graph_updates" in inspect.signature(nnx.jit).parameters and "graph_updates" not in options:
        changes.append(_change("return only the Variables that changed", f"nnx.jit({name}, graph_updates=False)",
                               fun, {**options, "graph_updates": False}, step))
    return changes


def _change(title: str, code: str, fun: Any, options: dict[str, Any], step: Step) -> Change:
    from flax import nnx

    return Change(title, code, lambda: step_of(nnx.jit(fun, **options), step.user_args, step.user_kwargs))
