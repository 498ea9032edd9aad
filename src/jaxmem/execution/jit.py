"""`jaxmem.jit`: run a JAX function planned, inside one host arena of exactly the plan's size.

    >>> import jax.numpy as jnp, numpy as np, jaxmem
    >>> f = jaxmem.jit(lambda x, y: jnp.tanh(x @ y).sum(0))
    >>> f(np.ones((4, 3), np.float32), np.ones((3, 2), np.float32))   # a numpy array
    array([3.980..., 3.980...], dtype=float32)
    >>> f.lower(np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)).plan.arena_bytes
    512

The first call with new argument shapes, dtypes or pytree structure traces the function, plans
it (`jaxmem.compiler.planner.plan_jaxpr`) and compiles the plan into one generated function over
typed views of the arena (`jaxmem.execution.program`); later calls with the same signature reuse
it. `clear_caches()` drops every cached plan and arena.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmem.compiler.plan_types import Plan
from jaxmem.errors import PlanError
from jaxmem.execution import primitives
from jaxmem.execution.program import Program, compile_plan
from jaxmem.compiler.jaxpr_adapter import Traced, trace
from jaxmem.execution.tracing import host_inputs, signature, to_user

_ALL: "weakref.WeakSet[Jitted]" = weakref.WeakSet()


@dataclass
class Executable:
    """One cached specialization: the trace, its plan, and the program bound to its arena."""

    traced: Traced
    plan: Plan
    program: Program
    device: Any = None
    buffer: Any = None                 # the device buffer holding the arena, if a device is used
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def arena(self) -> np.ndarray:
        """The arena's bytes (numpy uint8, exactly `plan.arena_bytes` long)."""
        return self.program.memory

    def run(self, args: Sequence[Any]) -> Any:
        """Run on positional `args` (a pytree matching the trace); returns the output pytree."""
        inputs = host_inputs(args, self.traced.in_avals)
        if self.lock.acquire(blocking=False):
            try:
                flat = self.program.run(inputs)
            finally:
                self.lock.release()
        else:
            # The arena is in use (a call from another thread or a re-entrant call): run this
            # one in an arena of its own rather than share bytes.
            flat = compile_plan(self.plan, host_arena(self.plan.arena_bytes)).run(inputs)
        return jax.tree_util.tree_unflatten(self.traced.out_tree,
                                            [to_user(x, a) for x, a in zip(flat, self.traced.out_avals)])

    def release(self) -> None:
        """Give the arena back; the program bound to it goes first, with its views of the
        arena (a view still alive would hold the arena's bytes, see `jaxmem.Device.view`)."""
        if self.buffer is not None and self.buffer.live:
            self.program = None
            self.device.free(self.buffer)
        self.buffer = None


def build(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int] = (),
          device: Any = None, plan: Plan | None = None) -> Executable:
    """Trace, plan and compile `fn` for `args`; with `device`, the arena is allocated from it.

    **Arguments:** `fn`; `args`, example positional arguments; `donate_argnums`; `device`, a host
    `jaxmem.Device` to hold the arena (default: a private numpy buffer); `plan`, a plan made
    earlier for the same trace (default: plan now).

    **Returns:** an `Executable`.
    """
    from jaxmem.compiler.planner import plan_jaxpr

    traced = trace(fn, args, donate_argnums=donate_argnums)
    if plan is None:
        flags = [k in traced.donated for k in range(len(traced.in_avals))]
        plan = plan_jaxpr(traced.closed_jaxpr, donated=flags)
    elif len(plan.invars) != len(traced.in_avals):
        raise PlanError(f"the plan has {len(plan.invars)} inputs, the function {len(traced.in_avals)}")
    if plan.closed_jaxpr is None:
        plan = dataclasses.replace(plan, closed_jaxpr=traced.closed_jaxpr)
    buffer = None
    if device is None:
        memory = host_arena(plan.arena_bytes)
    else:
        if getattr(device.backend, "kind", "") != "host":
            raise PlanError(f"jaxmem.jit runs in host memory: give it a Device(backend='host'), not {device!r}")
        if plan.arena_bytes == 0:
            memory = np.empty(0, np.uint8)
        else:
            buffer = device.allocate(plan.arena_bytes)
            memory = device.view(buffer)
    try:
        program = compile_plan(plan, memory)
    except BaseException:
        if buffer is not None:
            device.free(buffer)
        raise
    return Executable(traced, plan, program, device, buffer)


# XLA on the CPU takes a numpy array without copying it when its data is 64-byte aligned; every
# planned offset is a multiple of 256, so an aligned arena makes every slot such an array.
ALIGNMENT = 64


def host_arena(nbytes: int) -> np.ndarray:
    """A numpy uint8 arena of exactly `nbytes` bytes whose first byte is 64-byte aligned."""
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes]


class Jitted:
    """A function run planned in one arena; call it like the function. See `jit`."""

    def __init__(self, fn: Callable[..., Any], device: Any, donate_argnums: tuple[int, ...]) -> None:
        self.fn = fn
        self.device = device
        self.donate_argnums = donate_argnums
        self._cache: dict[Any, Executable] = {}
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "jitted")
        self.__doc__ = getattr(fn, "__doc__", None)
        _ALL.add(self)

    def lower(self, *args: Any) -> Executable:
        """The cached `Executable` for these arguments' signature (traced and planned if new)."""
        key = signature(args)
        entry = self._cache.get(key)
        if entry is None:
            entry = build(self.fn, args, self.donate_argnums, self.device)
            self._cache[key] = entry
        return entry

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # as jax.jit: keyword arguments are traced like positional ones
            args = positional(self.fn, args, kwargs)
        return self.lower(*args).run(args)

    def _cache_size(self) -> int:
        return len(self._cache)

    def clear_cache(self) -> None:
        """Forget every plan of this function and give its arenas back."""
        for entry in self._cache.values():
            entry.release()
        self._cache.clear()


def positional(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple:
    """`args` and `kwargs` as one positional tuple for `fn` (defaults fill any gap)."""
    import inspect

    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise PlanError(f"cannot call {getattr(fn, '__name__', 'the function')}: {err}") from None
    bound.apply_defaults()
    if bound.kwargs:
        raise PlanError(f"jaxmem.jit passes keyword-only arguments positionally; cannot pass {', '.join(bound.kwargs)}")
    return bound.args


def jit(fn: Callable[..., Any] | None = None, *, device: Any = None,
        donate_argnums: int | Sequence[int] = ()) -> Any:
    """Run `fn` planned: every step writes into views of one host arena of the plan's size.

    >>> import jax, jax.numpy as jnp, numpy as np, jaxmem
    >>> def train_step(params, opt_state, batch):   # SGD with momentum
    ...     grad = jax.grad(lambda w: jnp.tanh(batch @ w).sum())(params)
    ...     opt_state = 0.9 * opt_state + grad
    ...     return params - 0.1 * opt_state, opt_state, jnp.tanh(batch @ params).sum()
    >>> params, opt_state = np.ones((64, 64), np.float32), np.zeros((64, 64), np.float32)
    >>> step = jaxmem.jit(train_step, donate_argnums=(0, 1))
    >>> params, opt_state, loss = step(params, opt_state, np.ones((8, 64), np.float32))
    >>> loss
    array(512., dtype=float32)

    **Arguments:** `fn`, a function of arrays (pytrees) that `jax.jit` could compile; `device`,
    a `jaxmem.Device(backend="host")` to take the arena from (default: a private buffer);
    `donate_argnums`, positional arguments whose buffers outputs may take over.

    **Returns:** a `Jitted` callable returning numpy arrays in `fn`'s output structure. Usable as
    a decorator, with or without arguments.
    """
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    donate = tuple(donate_argnums)
    if fn is None:
        return lambda f: Jitted(f, device, donate)
    if not callable(fn):
        raise PlanError(f"jaxmem.jit expects a function, got {type(fn).__name__}")
    return Jitted(fn, device, donate)


def clear_caches() -> None:
    """Empty the plan cache of every `jaxmem.jit` function and the per-primitive JAX kernels."""
    for jitted in list(_ALL):
        jitted.clear_cache()
    primitives.clear_kernel_cache()
