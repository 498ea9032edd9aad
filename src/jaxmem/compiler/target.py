"""Load a TARGET, `path/to/file.py:factory` or `package.module:factory`, into `(fn, args)`.

`factory` is a zero-argument callable (a dotted attribute path is allowed, `mod:Class.make`)
that returns `(fn, args)`: the function to plan and a tuple of its positional arguments. Every
way a TARGET can be wrong ends in a one-line `PlanError`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Callable

from jaxmem.errors import PlanError

_FORMS = "'path/to/file.py:factory' or 'package.module:factory'"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def call_user(call: Callable[[], Any], failed: str) -> Any:
    """`call()`, user code: whatever it raises, an `Exception` or any other `BaseException`
    (`SystemExit`, `GeneratorExit`, a class of the user's own), is a one-line `PlanError`
    `"{failed}{the error}"`. Only Ctrl-C (`KeyboardInterrupt`) goes through as itself.

    >>> call_user(lambda: exit(3), "the factory raised ")
    Traceback (most recent call last):
    jaxmem.errors.PlanError: the factory raised SystemExit: 3
    """
    try:
        return call()
    except KeyboardInterrupt:
        raise
    except BaseException as err:
        raise PlanError(f"{failed}{_one_line(err)}") from None


def split_target(target: str) -> tuple[str, str]:
    """The (module or file, attribute path) halves of a TARGET string.

    >>> split_target("jaxmem.examples.suite:mlp_train")
    ('jaxmem.examples.suite', 'mlp_train')

    Raises:
        PlanError: no colon, or an empty half.
    """
    if not isinstance(target, str) or ":" not in target:
        raise PlanError(f"TARGET {target!r} must be {_FORMS}")
    where, _, attr = target.rpartition(":")
    where, attr = where.strip(), attr.strip()
    if not where or not attr:
        raise PlanError(f"TARGET {target!r} must be {_FORMS}")
    if not all(part.isidentifier() for part in attr.split(".")):
        raise PlanError(f"TARGET {target!r}: {attr!r} is not a Python name")
    return where, attr


def _is_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


def _import_file(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise PlanError(f"TARGET file {path!r} does not exist")
    path = os.path.abspath(path)
    # Like `python file.py`: the file's folder is importable, so it may import its siblings.
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "_jaxmem_target_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PlanError(f"cannot import {path!r}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        call_user(lambda: spec.loader.exec_module(module), f"cannot import {path!r}: ")
    except PlanError:
        sys.modules.pop(name, None)
        raise
    return module


def _import_module(name: str) -> ModuleType:
    return call_user(lambda: importlib.import_module(name), f"cannot import module {name!r}: ")


def _claim_package(module: ModuleType) -> None:
    """The TARGET's own package is the user's code in source lines, even when it is installed
    among the libraries whose frames are skipped (jaxmem's own examples already count)."""
    from jaxmem.compiler.jaxpr_adapter import claim_user_code

    top = sys.modules.get(module.__name__.split(".")[0], module)
    if top.__name__ == "jaxmem" or not getattr(top, "__file__", None):
        return
    path = top.__file__
    claim_user_code(os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path)


def resolve_factory(target: str) -> Callable[[], Any]:
    """The factory a TARGET names, imported but not called.

    >>> resolve_factory("jaxmem.examples.gpt:default_example").__name__
    'default_example'
    """
    where, attr = split_target(target)
    module = _import_file(where) if _is_file(where) else _import_module(where)
    _claim_package(module)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlanError(f"TARGET {target!r}: {where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PlanError(f"TARGET {target!r}: {attr!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def check_fn_args(result: Any, what: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`result` as `(fn, args)`, or a PlanError saying what `what` returned instead."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        kind = f"a {len(result)}-tuple" if isinstance(result, (tuple, list)) else f"a {type(result).__name__}"
        raise PlanError(f"{what} must return (fn, args), got {kind}")
    fn, args = result
    if not callable(fn):
        raise PlanError(f"{what} must return (fn, args) with a callable fn, got a {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise PlanError(f"{what} must return (fn, args) with args a tuple of positional arguments, "
                        f"got a {type(args).__name__}")
    return fn, tuple(args)


def load_target(target: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Import a TARGET's factory, call it, and return its `(fn, args)`.

    >>> fn, args = load_target("jaxmem.examples.suite:while_cond")
    >>> len(args)
    2

    Args:
        target: `"path/to/file.py:factory"` or `"package.module:factory"`.

    Returns:
        `(fn, args)` with `args` a tuple.

    Raises:
        PlanError: (one line) the TARGET is malformed, cannot be imported, lacks the attribute,
            is not callable, raises (any exception but Ctrl-C's `KeyboardInterrupt`, which
            goes through), or does not return `(fn, args)`.
    """
    factory = resolve_factory(target)
    result = call_user(factory, f"TARGET {target!r}: the factory raised ")
    return check_fn_args(result, f"TARGET {target!r}")


def jit_donation(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[int, ...]:
    """The `donate_argnums` of a function the user already wrapped in `jax.jit(...,
    donate_argnums=...)`, read from its trace; () for any other function.

    jaxmem plans and compiles `jax.jit(fn)` around the function it is given, and an inner
    jit's donation does not carry through an outer one: without this, a TARGET returning
    `jax.jit(step, donate_argnums=(0, 1))` was planned as if nothing were donated.

        >>> import jax, jax.numpy as jnp
        >>> step = jax.jit(lambda x, w: {k: v + x for k, v in w.items()}, donate_argnums=1)
        >>> jit_donation(step, (jnp.ones(2), {"a": jnp.ones(2), "b": jnp.ones(2)}))
        (1,)
    """
    trace = getattr(fn, "trace", None)
    if trace is None or not callable(getattr(fn, "lower", None)):
        return ()
    import jax

    try:
        positional = trace(*args).args_info[0]   # (positional, keyword) pytrees of ArgInfo
        flags = [jax.tree.leaves(jax.tree.map(lambda info: bool(info.donated), arg)) for arg in positional]
    except KeyboardInterrupt:
        raise
    except BaseException:  # not jax.jit's trace, or it fails: the planner's own trace says why
        return ()
    return tuple(k for k, leaves in enumerate(flags) if leaves and all(leaves))


def argument_signatures(args: Sequence[Any]) -> list[tuple[str, list[str]]]:
    """Each positional argument as (its leaves' paths, their dtypes and shapes), the key
    `shared_state` matches a loop's state by. Paths, not the tree's structure: two TrainStates
    made by two factories hold different `apply_fn` and `tx` objects (static fields), and are
    the same state.

    >>> import jax.numpy as jnp
    >>> argument_signatures(({"w": jnp.zeros((2, 3))}, 1.0))[0][1]
    ["['w'] float32[2, 3]"]
    """
    import jax

    out = []
    for arg in args:
        leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        keys = [f"{jax.tree_util.keystr(path)} {jax.typeof(x).dtype}{list(jax.typeof(x).shape)}" for path, x in leaves]
        out.append((type(arg).__name__, keys))
    return out
