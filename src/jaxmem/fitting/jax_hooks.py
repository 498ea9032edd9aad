"""Every hook fit puts on JAX, by one mechanism, and the only module of fitting/ that reaches
into JAX's internals (`jax._src`).

fit has to see, and for a rewrite change, what a user's step does while JAX traces it, however
the user imported what they call (`from jax import grad` done before fit started):

- `fitting.sites`: the function handed to `grad` / `value_and_grad` / `vjp` (JAX's
  `api.argnums_partial2` and `ad.linearize`, which every reverse-mode entry calls), and the
  policy of the user's own `jax.checkpoint` calls (the checkpoint primitive's `bind`);
- `fitting.pools`: max pools (the `reduce_window_max` primitive's `bind`);
- `fitting.scales`: `x * a * b` (`jnp.multiply` / `jnp.true_divide` where JAX arrays' `*` and
  `/` find them, `jax._src.numpy.ufuncs`, and in `jax.numpy`);
- `fitting.attention`: `jax.nn.dot_product_attention`'s XLA implementation (a global of
  `jax._src.nn.functions`).

The mechanism: `hook(owner, name, make)` replaces `owner.name` (a module global JAX looks up
at each call, or a primitive's `bind`, an instance attribute found before the class's) by
`make(original)`, once per process; the replacement is marked with `__jaxmem_original__`.
Each replacement reads a context variable of its module and calls JAX's own at once where it
is unset. The variable is set only inside that module's contexts (`active(var, value)`, or
`while_set(fn, var, value)`: for each call of a rewritten step), so another thread, a task,
or code run after the context, sees JAX as it is. Patching once and dispatching per context,
rather than patching in and restoring on exit, keeps concurrent threads apart and lets a
rewritten step be traced later, by the user's own `jax.jit`, wherever it runs.

Before the first hook is installed, this package's frames are excluded from JAX's source
information (`outside_user_frames`): a hook runs between the user's line and JAX, and JAX
would otherwise name the hook's line, not the user's, for every equation traced afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import threading
from typing import Any, Callable, Iterator

from jaxmem.compiler import jaxpr_adapter as ja

ORIGINAL = "__jaxmem_original__"   # the attribute a hook keeps JAX's own function in

_LOCK = threading.RLock()


# -- the JAX internals hooked (JAX 0.10 names) ------------------------------------------------

def remat_primitive() -> Any:
    """The primitive `jax.checkpoint` binds (`remat_p`, named "checkpoint")."""
    from jax._src import ad_checkpoint

    return ad_checkpoint.remat_p


def max_pool_primitive() -> Any:
    """The primitive of a max pool (`lax.reduce_window` with `lax.max`): `reduce_window_max_p`."""
    from jax._src.lax import windowed_reductions

    return windowed_reductions.reduce_window_max_p


def nn_functions() -> Any:
    """The module of `jax.nn.dot_product_attention`, whose XLA implementation
    (`_dot_product_attention_xla`) it looks up at each call."""
    from jax._src.nn import functions

    return functions


def numpy_ufuncs() -> Any:
    """The module whose `multiply` / `true_divide` the `*` and `/` of JAX arrays call."""
    from jax._src.numpy import ufuncs

    return ufuncs


def reverse_mode_modules() -> tuple[Any, Any]:
    """(`jax._src.api`, `jax._src.interpreters.ad`): where `grad`, `value_and_grad` and `vjp`
    find `argnums_partial2` and `linearize` when they run."""
    from jax._src import api
    from jax._src.interpreters import ad

    return api, ad


# -- the mechanism ----------------------------------------------------------------------------

def hook(owner: Any, name: str, make: Callable[[Any], Any]) -> bool:
    """Replace `owner.name` by `make(original)`, once per process (a second call finds the
    mark `make` left, `__jaxmem_original__`, and changes nothing). False where `owner` has no
    such attribute (this JAX lacks it: nothing is hooked)."""
    with _LOCK:
        current = getattr(owner, name, None)
        if current is None:
            return False
        if getattr(current, ORIGINAL, None) is None:
            outside_user_frames()
            setattr(owner, name, make(current))
        return True


def original(fn: Any) -> Any:
    """JAX's own function behind a hook (`fn` itself where it is not one)."""
    return getattr(fn, ORIGINAL, fn)


@contextlib.contextmanager
def active(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """A context in which `var`, which a hook reads, is `value` (this thread or task only)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def while_set(fn: Callable[..., Any], var: contextvars.ContextVar[Any], value: Callable[[], Any]) -> Callable[..., Any]:
    """`fn`, each call run with `var` set to a fresh `value()`: what a rewrite's hook reads while
    the step traces (outside a call, the hook is JAX's own). A call inside a function the user
    jitted themselves, that JAX traced before, comes from JAX's cache and stays as written
    (`jax.disable_jit` would inline it, but would also unroll every `lax.scan`)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        token = var.set(value())
        try:
            return fn(*args, **kwargs)
        finally:
            var.reset(token)

    return wrapped


def innermost_line() -> tuple[str, int] | None:
    """The user's line on the Python stack now, seen from a hook, as `ja.source_line` reads an
    equation's: the innermost frame of the user's own code, else the innermost library frame."""
    frame, library = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if not ja.is_internal_frame(name):
            if not ja.is_library_frame(name):
                return name, frame.f_lineno
            library = library or (name, frame.f_lineno)
        frame = frame.f_back
    return library


def outside_user_frames() -> None:
    """Once per process, before any hook is installed: this package's frames are not the user's
    code in JAX's source information. A hook runs between the user's line and JAX (`x * a` goes
    through `fitting.scales`' multiply), and JAX names an equation, and XLA's metadata, after
    the innermost frame it takes for the user's: without this, every product traced in the
    process afterwards would name the hook's line instead of the user's."""
    from jax._src import source_info_util

    here = os.path.dirname(os.path.abspath(__file__))
    register = getattr(source_info_util, "register_exclusion", None)
    if register is not None and here not in getattr(source_info_util, "_exclude_paths", []):
        register(here)
