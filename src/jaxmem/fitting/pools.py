"""Memory for free in a conv net: max pools as strided slices and a pairwise max.

`lax.reduce_window(x, -inf, lax.max, w, w, ...)` (Flax's `nn.max_pool`, Haiku's `MaxPool`)
differentiates to `select_and_scatter_add`, which XLA:GPU expands into a reduce_window that
writes s32 index arrays beside the activation and a scatter into fresh zeros: on
convnet_bn_train 16 MiB in the first stage that no checkpoint policy removes. Where the windows
do not overlap (window = stride, no padding or dilation), the window's elements are strided
slices of the input, and a max taken pairwise with `jnp.where(a >= b, a, b)` is the same
value; its gradient is a few `pred` masks and selects, which XLA fuses. The `>=` keeps the
earlier element on a tie, in the window's row-major order, so the gradient goes to the first
maximum, as the pool's own does (`select_and_scatter_add` with `ge`): equal bit for bit, ties
included (a reshape and `max` would share a tie's gradient instead, which a constant image
shows at once).

`pool_sites` finds the differentiated pools of a step by the user's line; `pools_rewritten`
returns the step with those pools rewritten (the primitive's `bind` hooked while the step is
traced, as the user would write `reshape_max_pool` there), the function to paste
(`fitting.rewrites` judges it, and checks its values, before fit and optimize start).

>>> sites = pool_sites(step, args)                          # doctest: +SKIP
>>> jax.jit(pools_rewritten(step, sites))(*args)            # doctest: +SKIP
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import SourceLine
from jaxmem.fitting import jax_hooks


def reshape_max_pool(x: jax.Array, window: tuple[int, ...]) -> jax.Array:
    """lax.reduce_window(x, -inf, lax.max, window, window, "VALID") without index arrays in its
    gradient: the window's elements are strided slices, and a max taken pairwise with
    jnp.where keeps the earlier element on a tie, so the gradient goes to the first maximum,
    as the pool's own gradient does."""
    import itertools

    import jax.numpy as jnp

    trimmed = x[tuple(slice(0, n - n % w) for n, w in zip(x.shape, window))]
    items = [trimmed[tuple(slice(d, None, w) for d, w in zip(at, window))]
             for at in itertools.product(*(range(w) for w in window))]
    while len(items) > 1:
        pairs = [jnp.where(a >= b, a, b) for a, b in zip(items[0::2], items[1::2])]
        items = pairs + items[len(pairs) * 2:]
    return items[0]


@dataclass(frozen=True)
class PoolSite:
    """One user line whose max pools (non-overlapping windows) are differentiated."""

    call: SourceLine
    windows: tuple[tuple[int, ...], ...]      # the window of each pool made on the line
    pools: int                                # how many pool equations the line made

    @property
    def key(self) -> tuple[str, int]:
        return (self.call.file, self.call.line)

    def code(self) -> str:
        """What to write: `reshape_max_pool(x, window)` in place of the pool on the line."""
        window = self.windows[0] if len(set(self.windows)) == 1 else None
        arg = repr(window) if window is not None else "window"
        written = f"  (as written: {self.call.text})" if self.call.text else ""
        return (f"{self.call}: write reshape_max_pool(x, {arg}) in place of the max pool of x on this line "
                f"({self.pools} pool{'s' if self.pools != 1 else ''}){written}")


def rewritable(params: dict[str, Any], shape: Sequence[int]) -> bool:
    """A `reduce_window_max` that `reshape_max_pool` computes exactly: each window its own block
    (window = stride, no padding, no dilation). A remainder the pool leaves out, it trims."""
    window = tuple(params["window_dimensions"])
    return (window == tuple(params["window_strides"])
            and all(tuple(p) == (0, 0) for p in params["padding"])
            and all(d == 1 for d in params.get("base_dilation", ()) or ())
            and all(d == 1 for d in params.get("window_dilation", ()) or ())
            and any(w > 1 for w in window)
            and all(n >= w for n, w in zip(shape, window)))


_GRADIENTS = ("select_and_scatter_add", "select_and_gather_add")


def pool_sites(fn: Callable[..., Any], args: Sequence[Any]) -> list[PoolSite]:
    """The lines of `fn` whose max pools can be rewritten and whose gradient `fn` computes
    (a pool only run forward holds no index arrays: nothing to gain)."""
    closed = ja.make_closed_jaxpr(fn, *args)
    pools: dict[tuple[str, int], list[tuple[SourceLine, tuple[int, ...]]]] = {}
    graded: set[tuple[str, int]] = set()
    for eqn in ja.walk_eqns(closed):
        name = ja.eqn_name(eqn)
        line = ja.source_line(eqn) if name == "reduce_window_max" or name in _GRADIENTS else None
        if line is not None and name == "reduce_window_max" \
                and rewritable(ja.eqn_params(eqn), ja.eqn_in_shapes(eqn)[0]):
            pools.setdefault((line.file, line.line), []).append(
                (line, tuple(ja.eqn_params(eqn)["window_dimensions"])))
        elif line is not None and name in _GRADIENTS:
            graded.add((line.file, line.line))
    return [PoolSite(made[0][0], tuple(w for _, w in made), len(made))
            for key, made in pools.items() if key in graded]


_ACTIVE: contextvars.ContextVar[frozenset[tuple[str, int]] | None] = contextvars.ContextVar(
    "jaxmem_pools_rewritten", default=None)


def _hooked_bind(original: Callable[..., Any]) -> Callable[..., Any]:
    def bind(*args: Any, **params: Any) -> Any:
        lines = _ACTIVE.get()
        if lines and len(args) == 1 and rewritable(params, args[0].shape) and jax_hooks.innermost_line() in lines:
            return reshape_max_pool(args[0], tuple(params["window_dimensions"]))
        return original(*args, **params)

    bind.__jaxmem_original__ = original  # type: ignore[attr-defined]
    return bind


def _install() -> None:
    """Hook, once per process, the max pool primitive's `bind` (an instance attribute:
    `reduce_window_max_p.bind(...)` finds it first): inside `pools_rewritten`, a pool made on
    one of its lines is `reshape_max_pool`. Outside, JAX's own."""
    jax_hooks.hook(jax_hooks.max_pool_primitive(), "bind", _hooked_bind)


def pools_rewritten(fn: Callable[..., Any], sites: Sequence[PoolSite]) -> Callable[..., Any]:
    """`fn` with the max pools made on `sites`' lines computed by `reshape_max_pool`, as if the user had
    written it there (what `jax.jit` traces; the hook is active only while `fn` runs)."""
    _install()
    lines = frozenset(s.key for s in sites)
    return jax_hooks.while_set(fn, _ACTIVE, lambda: lines)


def pool_lines(sites: Sequence[PoolSite]) -> list[str]:
    """What to write in the user's code: the helper once, then one line per site."""
    helper = inspect.getsource(reshape_max_pool).rstrip().splitlines()
    return [s.code() for s in sites] + ["with reshape_max_pool defined as (plain JAX, no jaxmem):", *helper]

