"""`jaxmem.eager`: run a JAX function op by op, every result allocated from a `Device`.

As JAX without jit (or PyTorch) runs a program: the arguments are on the device first; each
equation's outputs are allocated when it runs and freed after their last use; a loop or cond
also holds its body's temporaries (XLA's temp buffer for that one executable) while it runs.
Every allocation and free is recorded as a `jaxmem.trace_schema.Trace` (format "jaxmem"), so
the run can be replayed, reported, or compared with the planned peak.

    >>> import jax.numpy as jnp, numpy as np, jaxmem
    >>> loss_fn = lambda w, x: jnp.tanh(x @ w).sum()
    >>> params, batch = np.ones((64, 64), np.float32), np.ones((8, 64), np.float32)
    >>> device = jaxmem.Device("1GiB", backend="host", allocator="bfc", preallocate=False)
    >>> run = jaxmem.eager(loss_fn, device)(params, batch)
    >>> run.outputs, run.peak_bytes_in_use, run.stats["fragmentation"], len(run.trace.events)
    (array(512., dtype=float32), 22528, 0.0, 10)

With a "host" device each result is computed straight into the numpy view of its buffer; with
a "simulated" device (addresses only) results live in ordinary numpy memory and only the
allocations are simulated. `compute=False` skips the arithmetic altogether: the allocation
sequence of an op-by-op run depends on shapes only, never on values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import Const, SourceLine
from jaxmem.compiler.program import Op, Program
from jaxmem.errors import OutOfMemory, PlanError
from jaxmem.execution.primitives import jax_kernel, kernel_for, storage
from jaxmem.execution.tracing import const_array, host_inputs, to_user
from jaxmem.trace_schema import Event, Frame, Trace


@dataclass
class EagerRun:
    """What an op-by-op run did.

    Attributes:
        outputs: the function's outputs (numpy arrays, in its output structure); None when the
            run did not compute (`compute=False`) or ran out of memory.
        trace: every alloc/free, in order, with the primitive and user source line of each.
        stats: the device's `memory_stats()` at the end of the run, before anything is freed.
        at_peak: the device's `memory_stats()` at the moment bytes in use peaked.
        num_ops: equations run; num_allocs: allocations made by this run.
        oom: the `OutOfMemory` error if the run did not fit, else None.
        seconds: wall time of the run.
    """

    outputs: Any
    trace: Trace
    stats: dict[str, Any]
    at_peak: dict[str, Any]
    num_ops: int = 0
    num_allocs: int = 0
    oom: OutOfMemory | None = None
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.oom is None

    @property
    def peak_bytes_in_use(self) -> int:
        return int(self.stats.get("peak_bytes_in_use", 0))


@dataclass
class _State:
    device: Any
    host: bool
    events: list[Event] = field(default_factory=list)
    peak: int = -1
    at_peak: dict[str, Any] = field(default_factory=dict)
    allocs: int = 0
    t0: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def alloc(self, nbytes: int, label: str, frames: tuple[Frame, ...]) -> Any:
        if nbytes <= 0:
            return None  # JAX allocates nothing for an empty array
        try:
            buf = self.device.allocate(nbytes)
        except OutOfMemory as err:
            where = f" at {frames[0]}" if frames else ""
            self.events.append(Event("oom", 0, nbytes, time_us=self._now(), requested=nbytes, frames=frames,
                                     label=label))
            raise OutOfMemory(f"{err} (op by op: allocating {nbytes} bytes for {label}{where})",
                              **getattr(err, "details", {})) from None
        self.allocs += 1
        self.events.append(Event("alloc", buf.address, buf.size, time_us=self._now(), requested=nbytes,
                                 frames=frames, label=label))
        in_use = self.device.allocator.bytes_in_use
        if in_use > self.peak:
            self.peak = in_use
            self.at_peak = self.device.memory_stats()
        return buf

    def free(self, buf: Any, label: str) -> None:
        if buf is None or not buf.live:
            return
        self.events.append(Event("free", buf.address, buf.size, time_us=self._now(), requested=buf.requested_size,
                                 label=label))
        self.device.free(buf)

    def _now(self) -> float:
        return (time.perf_counter() - self.t0) * 1e6


def _frames(line: SourceLine | None) -> tuple[Frame, ...]:
    return (Frame(line.file, line.line, line.function),) if line is not None else ()


def _nbytes(aval: Any) -> int:
    dtype, shape = storage(aval)
    return dtype.itemsize * int(np.prod(shape, dtype=np.int64))


# Compiling a loop to learn its temp bytes takes long, so repeated runs of one program reuse
# the figure. Keyed by id(eqn), each entry also holds the equation, so the id cannot be reused
# by another while cached; the oldest entries go past `_SCRATCH_LIMIT`.
_SCRATCH: dict[int, tuple[Any, int]] = {}
_SCRATCH_LIMIT = 256


def _scratch_bytes(eqn: Any) -> int:
    """XLA's temp bytes for running a loop/cond equation as one executable (its body's temporaries)."""
    if ja.eqn_name(eqn) not in ja.LOOP_PRIMITIVES:
        return 0
    cached = _SCRATCH.get(id(eqn))
    if cached is not None and cached[0] is eqn:
        return cached[1]
    kernel = jax_kernel(eqn)
    try:
        specs = []
        for aval in ja.eqn_in_avals(eqn):
            dtype, shape = storage(aval)
            specs.append(jax.ShapeDtypeStruct(shape, dtype))
        analysis = kernel.jitted.lower(*specs).compile().memory_analysis()
        nbytes = int(getattr(analysis, "temp_size_in_bytes", 0) or 0)
    except Exception:  # noqa: BLE001 - a backend without memory_analysis: no scratch figure
        nbytes = 0
    while len(_SCRATCH) >= _SCRATCH_LIMIT:
        del _SCRATCH[next(iter(_SCRATCH))]
    _SCRATCH[id(eqn)] = (eqn, nbytes)
    return nbytes


def run_eager(prog: Program, inputs: list[np.ndarray] | None, device: Any, *, compute: bool = True) -> tuple[list[Any] | None, _State, OutOfMemory | None]:
    """Run an inlined program op by op on `device`; returns (flat outputs, state, oom)."""
    host = getattr(device.backend, "kind", "") == "host"
    state = _State(device, host, t0=time.perf_counter())
    n = len(prog.avals)
    buffers: list[Any] = [None] * n
    values: list[Any] = [None] * n
    last_use = [-1] * n
    for k, op in enumerate(prog.ops):
        for v in op.inputs:
            last_use[v] = k
    keep = set(prog.invars) | {v for v in prog.outvars if not isinstance(v, Const)}

    def slot(v: int) -> np.ndarray | None:
        if not host or buffers[v] is None:
            return None
        dtype, shape = storage(prog.avals[v])
        return device.view(buffers[v]).view(dtype).reshape(shape)

    oom = None
    try:
        for v, k in zip(prog.invars, range(len(prog.invars))):
            buffers[v] = state.alloc(_nbytes(prog.avals[v]), "argument", ())
            if compute:
                view = slot(v)
                if view is not None:
                    np.copyto(view, inputs[k])
                    values[v] = view
                else:
                    values[v] = inputs[k]
        for k, op in enumerate(prog.ops):
            eqn = op.eqn
            label = op.primitive
            frames = _frames(op.source)
            outs = [o for o in op.outputs if o is not None]
            for o in outs:
                buffers[o] = state.alloc(_nbytes(prog.avals[o]), label, frames)
            scratch = state.alloc(_scratch_bytes(eqn), f"{label} scratch", frames)
            if compute:
                _compute(op, values, slot)
            state.free(scratch, f"{label} scratch")
            dead = {v for v in op.inputs if last_use[v] == k and v not in keep}
            dead |= {o for o in outs if last_use[o] < 0 and o not in keep}
            for v in sorted(dead):
                values[v] = None   # its host view first, so that the free gives the bytes back at once
                state.free(buffers[v], label)
                buffers[v] = None
    except OutOfMemory as err:
        oom = err
    stats = device.memory_stats()
    outputs = None
    if compute and oom is None:
        outputs = [np.array(const_array(v.value, v.aval)) if isinstance(v, Const) else np.array(values[v])
                   for v in prog.outvars]
    values.clear()   # the host views, before their buffers are freed
    for v in range(n):
        if buffers[v] is not None:
            state.free(buffers[v], "end")
    state.stats = stats
    return outputs, state, oom


def _compute(op: Op, values: list[Any], slot: Callable[[int], "np.ndarray | None"]) -> None:
    kernel = kernel_for(op.eqn)
    ins = [const_array(v.value, v.aval) if isinstance(v, Const) else values[v] for v in op.operands]
    outs = op.outputs
    if len(outs) == 1 and outs[0] is not None and kernel.into is not None:
        view = slot(outs[0])
        if view is not None:
            # A fresh buffer never overlaps a live operand, so writing straight into it is safe.
            kernel.into(view, *ins)
            values[outs[0]] = view
            return
    result = kernel.compute(*ins)
    results = result if len(outs) != 1 else (result,)
    for o, r in zip(outs, results):
        if o is None:
            continue
        view = slot(o)
        if view is not None:
            np.copyto(view, r)
            values[o] = view
        else:
            values[o] = r  # simulated device: ordinary numpy memory, never reused under it


def eager(fn: Callable[..., Any], device: Any, *, compute: bool = True) -> Callable[..., EagerRun]:
    """Wrap `fn` to run op by op on `device`, allocating every result from its allocator.

    >>> import jax.numpy as jnp, numpy as np, jaxmem
    >>> f, x = lambda x: jnp.sin(x) * 2, np.ones(1024, np.float32)
    >>> run = jaxmem.eager(f, jaxmem.Device("1GiB", allocator="bfc-growth"))(x)
    >>> run.outputs, run.stats["peak_bytes_in_use"], run.trace.events[0].label
    (array([1.682942, 1.682942, ..., dtype=float32), 12288, 'argument')

    **Arguments:** `fn`, a function of arrays; `device`, a `jaxmem.Device` (host or simulated);
    `compute`, False to simulate only the allocations (no arithmetic, no outputs).

    **Returns:** a callable taking `fn`'s arguments and returning an `EagerRun`. Running out of
    device memory does not raise: the run stops there and `EagerRun.oom` holds the error.
    """
    if not callable(fn):
        raise PlanError(f"jaxmem.eager expects a function, got {type(fn).__name__}")
    if not hasattr(device, "allocate") or not hasattr(device, "memory_stats"):
        raise PlanError(f"jaxmem.eager needs a jaxmem.Device, got {type(device).__name__}")

    def call(*args: Any) -> EagerRun:
        traced = ja.trace(fn, args)
        prog = ja.inline(traced.closed_jaxpr)
        inputs = host_inputs(args, traced.in_avals) if compute else None
        t0 = time.perf_counter()
        flat, state, oom = run_eager(prog, inputs, device, compute=compute)
        seconds = time.perf_counter() - t0
        outputs = None
        if flat is not None:
            outputs = jax.tree_util.tree_unflatten(traced.out_tree,
                                                   [to_user(x, a) for x, a in zip(flat, traced.out_avals)])
        trace = Trace(
            events=state.events, source=getattr(fn, "__name__", "fn"), format="jaxmem",
            allocator_settings={"allocator": getattr(device, "allocator_name", ""),
                                "preallocate": getattr(device, "preallocate", None),
                                "mem_fraction": getattr(device, "mem_fraction", None)},
            device_capacity=getattr(device, "capacity", None),
            meta={"mode": "eager", "num_ops": len(prog.ops), "oom": str(oom) if oom else None},
        )
        return EagerRun(outputs=outputs, trace=trace, stats=state.stats, at_peak=state.at_peak or dict(state.stats),
                        num_ops=len(prog.ops), num_allocs=state.allocs, oom=oom, seconds=seconds)

    return call
