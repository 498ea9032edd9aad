"""Plain JAX: a function jaxmem jits itself, or one the user wrapped in `jax.jit`.

The program is the `jax.jit` of the function (with its `donate_argnums`, `donate_argnames` and
static arguments where the user jitted it). Two kinds of function have no such program and are
refused in one line, never analysed as the smaller program JAX would make of them:

- one that updates an argument in place while traced (`params["w"] = ...`, an object's
  attribute): under `jax.jit` the update is dropped as dead code, so the figure would be that
  of a program whose updates never happen;
- one that stores a traced value outside its outputs (a global, a closure, an attribute of an
  object it closes over): JAX's own leak check finds it, and the line names where it went.

A `jax.jit` function that updates the Flax NNX objects it takes is refused the same way (the
model it is given never changes when it runs): `nnx.jit` of it, or the function itself, is what
NNX users run.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Sequence

from jaxmem.errors import JaxmemError, PlanError
from jaxmem.frameworks.step import (
    Change, Step, abstract, arg_names, copy_arrays, devices_of, donated_positions, fn_name, from_args_info,
)


def is_jitted(fn: Any) -> bool:
    """Whether `fn` is `jax.jit`-wrapped (it can trace and lower itself)."""
    return callable(getattr(fn, "trace", None)) and callable(getattr(fn, "lower", None))


def step_of(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], donate: Sequence[int] | None) -> Step:
    """The `Step` of a plain or `jax.jit`-wrapped function."""
    if is_jitted(fn):
        return _jitted(fn, args, kwargs, donate)
    return _function(fn, args, kwargs, donate)


class _Probe:
    """`fn`, watching its arguments: after the call, which leaves of them are no longer the
    values it was handed and are not among its outputs either (an update made in place while
    traced, which `jax.jit` drops: an update the function also returns is kept)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.changed: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import jax

        before = _leaves_by_path((args, kwargs))
        out = self.fn(*args, **kwargs)
        after = _leaves_by_path((args, kwargs))
        returned = {id(leaf) for leaf in jax.tree.leaves(out)}
        self.changed = [path for path, leaf in after.items()
                        if before.get(path, _MISSING) is not leaf and id(leaf) not in returned]
        return out


_MISSING = object()


def _leaves_by_path(tree: Any) -> dict[str, Any]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_arg_path(path): leaf for path, leaf in flat}


def _arg_path(path: Any) -> str:
    """A `(args, kwargs)` key path as `args[0]['w']` or `kwargs['lr']`."""
    import jax

    text = jax.tree_util.keystr(path)
    match = re.match(r"\[(0|1)\]", text)
    if not match:
        return text
    return ("args" if match.group(1) == "0" else "kwargs") + text[match.end():]


def _function(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              donate: Sequence[int] | None) -> Step:
    """A plain function: jitted here, with `donate` (positions) as its `donate_argnums`;
    keyword arguments of arrays are inputs, any other keyword is closed over."""
    import jax

    from jaxmem.compiler.jaxpr_adapter import donate_positions, split_kwargs

    positions = donate_positions(len(args), donate if donate is not None else ())
    dynamic, static = split_kwargs(kwargs)
    probe = _Probe(functools.partial(fn, **static) if static else fn)
    probe.__name__ = fn_name(fn)
    jitted = jax.jit(probe, donate_argnums=positions)
    traced = _checked_trace(lambda: jitted.trace(*abstract(args), **abstract(dynamic)), fn)
    if probe.changed:
        raise PlanError(_updated_in_place(fn_name(fn), probe.changed))
    runner = jax.jit(functools.partial(fn, **static) if static else fn, donate_argnums=positions)
    step = Step(framework="jax", name=fn_name(fn), traced=traced, user_fn=fn, runner=runner, user_args=tuple(args),
                user_kwargs=dict(dynamic), clone=copy_arrays, results=lambda out, a: out, devices=devices_of((args, kwargs)),
                pure=lambda: (fn if not static else functools.partial(fn, **static), *from_args_info(traced)))
    step.changes = lambda: _donation_changes(step, lambda wanted: jax.jit(probe.fn, donate_argnums=wanted), "jax.jit")
    return step


def _jitted(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], donate: Sequence[int] | None) -> Step:
    """A `jax.jit`-wrapped function: its own donation and static arguments; a `donate` where it
    donates nothing wraps it in one more `jax.jit` that donates those."""
    import jax

    from jaxmem.compiler.jaxpr_adapter import donate_positions

    def trace(f: Any) -> Any:
        try:   # abstract arguments: no array of the user's is committed to a device
            return f.trace(*abstract(args), **kwargs)
        except Exception:  # a static argument must stay a value: JAX's trace of the originals
            return f.trace(*args, **kwargs)

    _refuse_dropped_nnx_updates(fn, args, kwargs)
    traced = _checked_trace(lambda: trace(fn), fn)
    runner = fn
    if donate is not None:
        if not any(_donated_flags(traced)):
            runner = jax.jit(fn, donate_argnums=donate_positions(len(args), donate))
            traced = _checked_trace(lambda: trace(runner), fn)
        else:
            check_donate(traced, len(args), donate, fn_name(fn))
    step = Step(framework="jax", name=fn_name(fn), traced=traced, user_fn=getattr(fn, "__wrapped__", fn), runner=runner,
                user_args=tuple(args), user_kwargs=dict(kwargs), clone=copy_arrays, results=lambda out, a: out,
                devices=devices_of((args, kwargs)), pure=lambda: (runner, *from_args_info(traced)))
    step.changes = lambda: _donation_changes(step, lambda wanted: jax.jit(fn, donate_argnums=wanted), "jax.jit")
    return step


def _checked_trace(trace: Callable[[], Any], fn: Any) -> Any:
    """`trace()`, then a look through what the user's code can reach for a traced value it
    stored outside its outputs (`_leak`): one line naming where it went, and the module globals
    it names given their values back (tracing leaves the user's program as it was). Other
    failures go on to the caller's policy."""
    saved = _globals_of(fn)
    try:
        traced = trace()
    except JaxmemError:
        raise
    except Exception as err:
        refused = refused_leaf(err, fn_name(fn))
        if refused:
            raise PlanError(refused) from None
        raise
    where = _leak(fn)
    if where is not None:
        _restore(saved)
        raise PlanError(_leaked(fn_name(fn), where))
    return traced


# How far `_leak` looks: functions of the user's code it follows, and the depth of containers
# and objects it opens from each global or closed-over variable.
_LEAK_FUNCTIONS, _LEAK_DEPTH = 64, 3


def _leak(fn: Any) -> str | None:
    """Where a traced value sits after tracing, reachable from the user's own code: a module
    global one of its functions names, or a variable one closes over (or an item or attribute
    within those); None where there is none. Library code (JAX's, Flax's caches) is not looked
    at: its tracers are its own business."""
    from jaxmem.compiler.jaxpr_adapter import is_internal_frame, is_library_frame

    todo, seen, met = [_unwrapped(fn)], set(), 0
    while todo and met < _LEAK_FUNCTIONS:
        func = todo.pop()
        code = getattr(func, "__code__", None)
        if code is None or id(func) in seen or is_internal_frame(code.co_filename) or is_library_frame(code.co_filename):
            continue
        seen.add(id(func))
        met += 1
        space = getattr(func, "__globals__", {})
        for name in sorted(_names_used(code)):
            if name in space:
                found = _tracer_in(space[name], f"{space.get('__name__', '?')}.{name}", _LEAK_DEPTH, todo)
                if found:
                    return found
        for var, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:   # a cell not filled yet
                continue
            found = _tracer_in(value, f"{func.__name__}'s closed-over {var}", _LEAK_DEPTH, todo)
            if found:
                return found
    return None


def _unwrapped(fn: Any) -> Any:
    """The user's own function under `functools.partial`s and wrappers."""
    while hasattr(fn, "__wrapped__") or isinstance(fn, functools.partial):
        fn = fn.func if isinstance(fn, functools.partial) else fn.__wrapped__
    return fn


def _names_used(code: Any) -> set[str]:
    """The global names a code object and the code nested in it name."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def _tracer_in(value: Any, where: str, depth: int, functions: list[Any]) -> str | None:
    """`where` (or a place within it) if `value` is or holds a traced value, `depth` levels of
    containers and object attributes down; a function met is queued in `functions`."""
    import types

    from jaxmem.compiler.jaxpr_adapter import is_tracer

    if is_tracer(value):
        return where
    if isinstance(value, types.FunctionType):
        functions.append(value)
        return None
    if depth <= 0 or isinstance(value, (types.ModuleType, type, str, bytes, int, float)):
        return None
    if isinstance(value, dict):
        items = [(f"{where}[{k!r}]", v) for k, v in list(value.items())[:256]]
    elif isinstance(value, (list, tuple)):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value[:256])]
    else:
        attrs = getattr(value, "__dict__", None)
        items = [(f"{where}.{k}", v) for k, v in list(attrs.items())[:256]] if isinstance(attrs, dict) else []
    for place, item in items:
        found = _tracer_in(item, place, depth - 1, functions)
        if found:
            return found
    return None


def _globals_of(fn: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the module globals `fn`'s code names, their values now), to give back after a trace
    that leaked into them."""
    inner = _unwrapped(fn)
    space = getattr(inner, "__globals__", None)
    code = getattr(inner, "__code__", None)
    if not isinstance(space, dict) or code is None:
        return {}, {}
    return space, {name: space[name] for name in code.co_names if name in space}


def _restore(saved: tuple[dict[str, Any], dict[str, Any]]) -> None:
    space, values = saved
    for name, value in values.items():
        if space.get(name) is not value:
            space[name] = value


def _leaked(name: str, where: str) -> str:
    """The one line for a traced value stored outside the function's outputs."""
    return (f"{name} stores a traced value in {where[:120]} while traced (a global, a closure or an object's "
            "attribute): jax.jit keeps none of it; return the new value from the function instead")


def _updated_in_place(name: str, paths: list[str]) -> str:
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return (f"{name} updates {shown} in place while traced, and jax.jit drops such updates as dead code (the "
            "arguments never change when it runs): return the updated values from the function instead")


def _refuse_dropped_nnx_updates(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A `jax.jit` function that updates the Flax NNX objects it takes: one line naming the
    program NNX users run instead."""
    from jaxmem.frameworks import nnx

    inner = getattr(fn, "__wrapped__", None)
    if inner is None or not nnx.takes_graph_nodes(args, kwargs):
        return
    import jax

    probe = _Probe(inner)
    copy_args, copy_kwargs = nnx.abstract_nodes(tuple(args), kwargs)
    try:
        jax.eval_shape(lambda a, k: probe(*a, **k), copy_args, copy_kwargs)
    except Exception:  # the trace below says what fails, in its own line
        return
    if probe.changed:
        name = fn_name(fn)
        raise PlanError(f"{name} updates the Flax NNX objects it takes in place ({probe.changed[0]}, ...), and jax.jit "
                        f"drops those updates: the model it is given never changes when it runs. Pass nnx.jit({name}) "
                        f"or {name} itself, which jaxmem reads as nnx.jit runs it")


def _donated_flags(traced: Any) -> list[bool]:
    import jax

    positional, named = traced.args_info
    return [bool(i.donated) for i in jax.tree.leaves((tuple(positional), dict(named)), is_leaf=lambda x: hasattr(x, "donated"))]


def check_donate(traced: Any, num_args: int, donate: int | Sequence[int], name: str) -> None:
    """`donate` (positions) must say what the jitted function's own donation says."""
    import jax

    from jaxmem.compiler.jaxpr_adapter import donate_positions

    wanted = tuple(sorted(set(donate_positions(num_args, donate))))
    positional, named = traced.args_info
    flags: list[bool] = []
    for k, arg in enumerate(positional):
        flags += [k in wanted] * len(jax.tree.leaves(arg, is_leaf=lambda x: hasattr(x, "donated")))
    own = _donated_flags(traced)
    if flags != own[:len(flags)] or any(own[len(flags):]):
        positions = donated_positions(traced)
        said = ", ".join(map(str, positions)) if positions else ("some leaves" if any(own) else "nothing")
        raise PlanError(f"donate={wanted} contradicts {name}'s own jax.jit donation ({said}); "
                        "leave donate out: it is read from the jitted function")


def replaced_positions(args: Sequence[Any], traced: Any) -> tuple[int, ...]:
    """The positional arguments (as the user passes them) every array leaf of which an output
    of the program of the same shape and dtype replaces (the first unclaimed output, in order):
    the step's state, as a training loop feeds its outputs back."""
    import jax
    import numpy as np

    outs = [(tuple(o.shape), str(o.dtype)) for o in jax.tree.leaves(traced.out_info)]
    claimed: set[int] = set()
    found = []
    for k, arg in enumerate(args):
        leaves = [x for x in jax.tree.leaves(arg) if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))]
        mine: list[int] = []
        for leaf in leaves:
            key = (tuple(leaf.shape), str(leaf.dtype))
            j = next((j for j, o in enumerate(outs) if j not in claimed and j not in mine and o == key), None)
            if j is None:
                break
            mine.append(j)
        else:
            if leaves:
                claimed |= set(mine)
                found.append(k)
    return tuple(found)


def _donation_changes(step: Step, rebuild: Callable[[tuple[int, ...]], Any], how: str) -> list[Change]:
    """Donate the arguments the step's outputs replace, where it does not already."""
    state = replaced_positions(step.user_args, step.traced)
    donated = set(donated_positions(step.traced))
    if not state or set(state) <= donated:
        return []
    wanted = tuple(sorted(donated | set(state)))
    names = arg_names(step.user_fn, len(step.user_args))
    said = ", ".join(names[i] for i in wanted)
    code = f"{how}({step.name}, donate_argnums={wanted!r})"

    def build() -> Step:
        return step_of(rebuild(wanted), step.user_args, step.user_kwargs, None)

    return [Change(f"donate the state the step replaces ({said})", code, build)]


def refused_leaf(err: BaseException, name: str) -> str | None:
    """JAX's refusal of a non-array argument leaf, as one line saying what to do; None for any
    other error."""
    text = " ".join(str(err).split())
    found = re.search(r"The problematic value is of type (<class '[^']+'>|\S+) and was passed to the function at path "
                      r"(\S+?)\.?(?: |$)", text)
    if not found:
        return None
    kind = found.group(1).replace("<class '", "").replace("'>", "")
    return (f"{name}'s argument {found.group(2)} is a {kind}, which jax.jit cannot take as an argument: close over it, "
            "mark it static (static_argnums), or for an Equinox module use eqx.filter_jit, which jaxmem reads")
