"""`jaxmem.analyze`: one function's device memory on a GPU or TPU, from Python.

    import jax, jaxmem
    result = jaxmem.analyze(jax.jit(step, donate_argnums=(0, 1)), state, batch, device="tpu-v5e-16gb")
    result.fits, result.xla["total_bytes"]

The same analysis as `jaxmem analyze TARGET` (which loads the factory and calls this): jaxmem's
plan of the jaxpr, XLA's own figures from a deviceless compile for the device (the program is
lowered here and its StableHLO compiled in a child process), and the runtime's verdict over N
steps.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxmem.api.pipeline import Options, Run, analyze_run, stderr_say
from jaxmem.api.program import prepare
from jaxmem.api.result import Analysis
from jaxmem.errors import PlanError


def analyze(fn: Any, *args: Any, device: str = "h100-80gb", donate: int | Sequence[int] | None = None,
            steps: int = 3, kwargs: dict[str, Any] | None = None, quiet: bool = False) -> Analysis:
    """Plan `fn(*args, **kwargs)`'s memory and judge it on `device` with XLA's own figures.

    >>> import jax, jax.numpy as jnp, jaxmem
    >>> step = jax.jit(lambda w, x: w - 0.1 * jnp.tanh(x @ w), donate_argnums=0)
    >>> result = jaxmem.analyze(step, jnp.ones((256, 256)), jnp.ones((8, 256)), device="tpu-v5e-16gb",
    ...                         quiet=True)  # doctest: +SKIP
    >>> result.fits, result.xla["total_bytes"]  # doctest: +SKIP
    (True, 270336)

    **Arguments:**

    - `fn`: a function, a `jax.jit`-wrapped one (its `donate_argnums`, `donate_argnames` and
      static arguments are read from it), a `jax.stages.Traced` or a `jax.stages.Lowered`
      (which has no jaxpr: no plan of jaxmem's, XLA's figures alone).
    - `args`: its positional arguments: arrays, `jax.ShapeDtypeStruct`s, any pytree `jax.jit`
      takes (none for a `Traced` or `Lowered`).
    - `device`: a preset (`h100-80gb`, `a100-40gb`, `tpu-v5e-16gb`, ...) or a size (`24GiB`).
    - `donate`: positional arguments to donate, as `jax.jit`'s `donate_argnums`; for a jitted
      function, only what it donates itself.
    - `steps`: training steps the runtime's pool runs.
    - `kwargs`: `fn`'s keyword arguments.
    - `quiet`: no progress display (a spinner on stderr, a line in a notebook) and no notes.

    **Returns:** an `Analysis` (`.fits`, `.xla`, `.pool`, `.peak_buffers`, `.plan`,
    `.to_dict()`, `str()`, `.html()`).

    **Raises:** `JaxmemError`, one line: `fn` is not callable or fails to trace, the arguments
    do not match, the device is unknown, `donate` contradicts the jitted function's donation.
    """
    from jaxmem.api.progress import busy_for

    options = Options(device=device, steps=steps, quiet=quiet)
    check_options(options)
    busy = busy_for(quiet)
    if _sharded(args):
        from jaxmem.api.sharded import analyze_sharded

        return analyze_sharded(fn, args, kwargs, donate, options, busy)
    with busy(f"tracing {getattr(fn, 'fun_name', None) or getattr(fn, '__name__', type(fn).__name__)}"):
        program = prepare(fn, args, kwargs, donate)
    run = Run(options, program, program.name, say=(lambda text: None) if quiet else stderr_say("jaxmem"),
              busy=busy)
    return Analysis(analyze_run(run))


def check_options(options: Options) -> None:
    """The device and step count, checked before anything is traced."""
    from jaxmem.api.pipeline import parse_device

    if not isinstance(options.device, str):
        raise PlanError(f"device must be a preset name or a size such as '24GiB', not a {type(options.device).__name__}")
    parse_device(options.device)
    if not isinstance(options.steps, int) or options.steps < 1:
        raise PlanError(f"steps must be an integer of 1 or more, got {options.steps!r}")


def _sharded(args: Sequence[Any]) -> bool:
    """Whether the arguments carry a sharding over more than one device."""
    from jaxmem.xla.sharding import find_mesh

    return bool(args) and find_mesh(args) is not None
