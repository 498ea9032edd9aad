"""The judge of a candidate: XLA's own total for it, XLA:GPU (deviceless, for a GPU preset) or
XLA:CPU (this process's backend), and the budget read against the original's figures.

>>> judge = Judge(None)                         # XLA:CPU
>>> judge.figures(step, args, (0, 1)).total     # doctest: +SKIP
>>> resolve_budget("half-temp", judge.figures(step, args, (0, 1)))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxmem.errors import ConfigError, JaxmemError
from jaxmem.units import PRESETS, format_size, parse_size


@dataclass(frozen=True)
class Figures:
    """XLA's memory analysis of one compiled candidate."""

    argument: int
    output: int
    temp: int
    alias: int

    @property
    def total(self) -> int:
        return self.argument + self.output + self.temp - self.alias

    @property
    def half_temp(self) -> int:
        """The issue's budget: arguments + outputs - aliases + half of the temporaries."""
        return self.argument + self.output - self.alias + self.temp // 2

    @property
    def floor(self) -> int:
        """No candidate can go below this: arguments + outputs - aliases (no temporaries)."""
        return self.argument + self.output - self.alias


class Judge:
    """XLA's total for a function: `device` a GPU preset (XLA:GPU, deviceless), a TPU preset
    (XLA:TPU, deviceless) or None (XLA:CPU).

    A deviceless compile in this process needs JAX started with `JAX_PLATFORMS=cpu` (the CUDA
    plugin and libtpu then give compile-only devices; `jaxmem fit --device` sets it before JAX
    starts). In a process whose JAX holds a GPU or TPU (a notebook on a TPU VM, the training
    script itself), each candidate is lowered here and compiled in a child, as `jaxmem.analyze`
    compiles there (`xla.lowered`).
    """

    def __init__(self, device: str | None = None):
        from jaxmem.accelerators import find, gpu_presets, tpu_presets

        self.device = device.strip().lower() if device else None
        self.spec = None
        self.accelerator = None
        if self.device is not None:
            self.accelerator = find(self.device)
            if self.accelerator is None:
                raise ConfigError(f"unknown device {device!r}: use a GPU or TPU preset "
                                  f"({', '.join(gpu_presets() + tpu_presets())})")
            self.spec = self.accelerator.gpu_spec or self.accelerator.topology
        self.compiles = 0

    @property
    def name(self) -> str:
        if self.accelerator is None:
            return "XLA:CPU"
        return f"{self.accelerator.xla_name} {self.device}"

    def figures(self, fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int]) -> Figures:
        self.compiles += 1
        if self.device is None:
            from jaxmem.xla.cpu.compile import xla_reference

            ref = xla_reference(fn, args, donate_argnums=tuple(donate))
            return Figures(ref.argument_bytes, ref.output_bytes, ref.temp_bytes, ref.alias_bytes)
        if not _started_on_cpu():
            return self._child_figures(fn, args, donate)
        if self.accelerator is not None and self.accelerator.is_tpu:
            return self._tpu_figures(fn, args, donate)
        from jaxmem.xla.gpu.compile import GpuUnavailable, compile_for_gpu, unavailable_reason

        _deviceless_ready(unavailable_reason(), GpuUnavailable)
        data = compile_for_gpu(fn, args, spec=self.spec, device=self.device, donate_argnums=tuple(donate))
        return Figures(int(data["argument_bytes"]), int(data["output_bytes"]), int(data["temp_bytes"]),
                       int(data["alias_bytes"]))

    def _tpu_figures(self, fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int]) -> Figures:
        """XLA:TPU's figures, deviceless in this process. A program XLA:TPU refuses (over the
        chip's memory) counts as its message's figure, above the chip: it does not fit."""
        from jaxmem.xla.tpu.compile import TpuUnavailable, compile_for_tpu, unavailable_reason

        _deviceless_ready(unavailable_reason(), TpuUnavailable)
        data = compile_for_tpu(fn, args, accelerator=self.accelerator, donate_argnums=tuple(donate), top=0)
        return Figures(int(data["argument_bytes"]), int(data["output_bytes"]), int(data["temp_bytes"]),
                       int(data["alias_bytes"]))

    def _child_figures(self, fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int]) -> Figures:
        """XLA's figures from a deviceless compile in a child of the candidate lowered here for the
        device's platform. A program XLA:TPU refuses counts as the bytes its message asks for."""
        import jax

        from jaxmem.xla.lowered import from_lowered, lowered_reference

        platform = "tpu" if self.accelerator.is_tpu else "cuda"
        lowered = jax.jit(fn, donate_argnums=tuple(donate)).trace(*args).lower(lowering_platforms=(platform,))
        ref = lowered_reference(from_lowered(lowered, platform), self.accelerator, top=0)
        return Figures(int(ref.argument_bytes), int(ref.output_bytes), int(ref.temp_bytes), int(ref.alias_bytes))

    def total(self, fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int]) -> int:
        return self.figures(fn, args, donate).total


# Values: a candidate must compute what the original computes. In f32 the only differences are
# XLA's reassociation inside fusions, well within these.
RTOL, ATOL = 1e-4, 1e-5
ULPS = 2   # at a narrower compute dtype: two roundings' worth of that dtype's precision


def compute_dtype(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """The narrowest floating dtype `fn` computes in (bf16 for a mixed-precision step whose
    arguments and results are all f32), from its jaxpr, nested ones included; None: f32 or wider."""
    import jax.numpy as jnp
    import numpy as np

    from jaxmem.compiler import jaxpr_adapter as ja

    found: list[Any] = []
    for eqn in ja.walk_eqns(ja.make_closed_jaxpr(fn, *args)):
        for aval in ja.eqn_out_avals(eqn):
            dtype = getattr(aval, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
                found.append(np.dtype(dtype))
    return max(found, key=lambda d: float(jnp.finfo(d).eps)) if found else None   # bf16 before f16


def values_equal(expected: Any, got: Any, computed_in: Any = None) -> bool:
    """Whether `got` holds the original's values, leaf by leaf: integers exactly; floats at
    RTOL/ATOL where the function computes in f32, and where it computes in a narrower dtype
    (`computed_in`, e.g. bf16: `compute_dtype`) at ULPS of that dtype's precision, relative to
    each element and to the leaf's largest magnitude. Why: a checkpoint moves where XLA rounds
    to bf16 (a value recomputed in the backward pass is fused differently, and a fusion keeps
    its intermediates in f32 where a stored value was rounded), so a gradient summed from such
    values differs by a rounding of bf16 relative to the sum, not of f32 (bf16_train under
    nothing_saveable: Adam's first moment of the embedding off by 1.7e-5 where its largest
    entry is 2.1e-3, 0.8%)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        pairs = list(zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True))
    except ValueError:
        return False
    for a, b in pairs:
        if jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)   # typed keys: their key data
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            if not np.array_equal(a, b):
                return False
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        if computed_in is None:
            rtol, atol = RTOL, ATOL
        else:
            rtol = ULPS * float(jnp.finfo(computed_in).eps)
            atol = max(ATOL, rtol * float(np.max(np.abs(a), initial=0.0)))
        if not np.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True


HALF_TEMP = ("half-temp", "half_temp", "halftemp")


def resolve_budget(budget: int | str, original: Figures) -> int:
    """Bytes from a budget: an int, a size ("300MiB"), a preset, a share of the original's total
    ("50%") or "half-temp" (arguments + outputs - aliases + half the original's temporaries).

    >>> resolve_budget("half-temp", Figures(100, 50, 40, 30))
    140
    >>> resolve_budget("50%", Figures(100, 50, 40, 30))
    80
    """
    if isinstance(budget, str):
        text = budget.strip().lower()
        if text in HALF_TEMP:
            return original.half_temp
        if text.endswith("%"):
            try:
                share = float(text[:-1]) / 100
            except ValueError:
                raise ConfigError(f"cannot read budget {budget!r}: use bytes, '300MiB', 'half-temp' or '50%'") from None
            if not 0 < share < float("inf"):
                raise ConfigError(f"budget must be a positive, finite share, got {budget!r}")
            return max(1, int(share * original.total))
    try:
        return parse_size(budget)
    except ConfigError as err:
        raise ConfigError(f"{err}; or 'half-temp', or a share such as '50%'") from None


def infeasible_line(budget: int, floor: int, judge: str) -> str | None:
    """The one line that proves a budget infeasible: below XLA's arguments + outputs - aliases,
    which no recompute can lower."""
    if budget < floor:
        return (f"budget {format_size(budget)} is below {format_size(floor)}, {judge}'s arguments + "
                f"outputs - aliases for this function, which no recomputation can lower")
    return None


__all__ = ["Figures", "Judge", "resolve_budget", "infeasible_line", "values_equal", "compute_dtype", "JaxmemError"]


def _started_on_cpu() -> bool:
    """Whether this process's JAX was told to use the CPU alone (`JAX_PLATFORMS=cpu`), so that the
    deviceless compilers can run in it."""
    return os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"


def _deviceless_ready(reason: str | None, unavailable: type[Exception]) -> None:
    """Raise `unavailable`, with its reason, where the deviceless compiler cannot run here."""
    if reason:
        raise unavailable(reason)
