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


def analyze(fn: Any, *args: Any, device: str | None = None, donate: int | Sequence[int] | None = None,
            steps: int = 3, kwargs: dict[str, Any] | None = None, quiet: bool = False,
            costs: bool | str = "auto") -> Analysis:
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
      (which has no jaxpr: no plan of jaxmem's, XLA's figures alone); a framework's step,
      read as the framework compiles it: an `nnx.jit` function or a plain function taking Flax
      NNX objects, an `eqx.filter_jit` function or a plain one taking Equinox modules, a
      compiled `keras.Model` (its `fit` train step, on the batch `args`).
    - `args`: its positional arguments: arrays, `jax.ShapeDtypeStruct`s, any pytree `jax.jit`
      takes, modules and optimizers (none for a `Traced` or `Lowered`; `x, y` for Keras).
    - `device`: a preset (`h100-80gb`, `a100-40gb`, `tpu-v5e-16gb`, ...) or a size (`24GiB`);
      None: the chip or GPU the arguments live on, else JAX's default device where it is one,
      else an H100 80GB (the result says which and why).
    - `donate`: positional arguments to donate, as `jax.jit`'s `donate_argnums`; for a jitted
      function, only what it donates itself.
    - `steps`: training steps the runtime's pool runs.
    - `kwargs`: `fn`'s keyword arguments.
    - `quiet`: no progress display (a spinner on stderr, a line in a notebook) and no notes.
    - `costs`: what the step's framework adds over the same step written pure, and the changes
      that remove it, each compiled for the device ("auto": for a framework's step, not for
      plain JAX; True; False).

    **Returns:** an `Analysis` (`.fits`, `.xla`, `.pool`, `.peak_buffers`, `.plan`,
    `.framework`, `.device`, `.to_dict()`, `str()`, `.html()`).

    **Raises:** `JaxmemError`, one line: `fn` is not callable or fails to trace, the arguments
    do not match, the device is unknown, `donate` contradicts the jitted function's donation.
    """
    from jaxmem.api.costs import check_costs_mode
    from jaxmem.api.progress import busy_for

    options = Options(device=device or "", steps=steps, quiet=quiet, costs=check_costs_mode(costs))
    if device is not None:
        check_options(options)
    elif not isinstance(steps, int) or steps < 1:
        raise PlanError(f"steps must be an integer of 1 or more, got {steps!r}")
    busy = busy_for(quiet)
    say = (lambda text: None) if quiet else stderr_say("jaxmem")
    if _sharded(args):
        from jaxmem.api.sharded import analyze_sharded

        from jaxmem.frameworks.step import devices_of

        reason = _choose(options, devices_of((tuple(args), kwargs or {})), say)
        return analyze_sharded(fn, args, kwargs, donate, options, busy, device_reason=reason)
    with busy(f"tracing {getattr(fn, 'fun_name', None) or getattr(fn, '__name__', type(fn).__name__)}"):
        program = prepare(fn, args, kwargs, donate)
    reason = _choose(options, program.step.devices if program.step is not None else [], say)
    run = Run(options, program, program.name, say=say, busy=busy, device_reason=reason)
    return Analysis(analyze_run(run))


def _choose(options: Options, devices: Sequence[Any], say: Any) -> str | None:
    """Where `device=` was left out: the device the arguments live on (`api/devices.py`), set in
    `options`, and why (said on stderr too); None where the caller named one."""
    if options.device:
        return None
    from jaxmem.api.devices import choose_device

    choice = choose_device(devices)
    options.device = choice.device
    say(f"judged for {choice.device}: {choice.reason}")
    return choice.reason


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
