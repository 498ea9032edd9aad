"""What `jaxmem.analyze` is handed, made one thing: a traced (or lowered) program, its arguments
as the reports name them, and which flat inputs are donated.

`fn` may be a plain function, a `jax.jit`-wrapped one, a `jax.stages.Traced` or a
`jax.stages.Lowered`, or a framework's step (`nnx.jit`, `eqx.filter_jit`, a plain function
taking NNX or Equinox objects, a compiled `keras.Model` with a batch): the program is the one
the framework compiles (`jaxmem.frameworks`). Donation and static arguments of a jitted
function are its own, read from its trace (`args_info`, per leaf); `donate=` may repeat them,
never contradict them.

    program = prepare(jax.jit(step, donate_argnums=(0, 1)), (state, batch))
    program.donated, program.lower_for("tpu")
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxmem.compiler.jaxpr_adapter import in_own_thread as _in_own_thread  # noqa: F401  (used here and by api/)
from jaxmem.errors import JaxmemError, PlanError


@dataclass
class Program:
    """One program to analyse.

    `traced` is JAX's `Traced` (None for a `Lowered`, which has no jaxpr: then `lowered` is
    set); `args` are its dynamic arguments (keyword arguments as one last dict), `names` their
    flat leaves as the reports name them where a framework named them (`model.layers[0].kernel`;
    else `args[0]['w']` from `args`); `donated` says per flat input whether it is donated; `fn`
    and `fn_args` are the user's function and arguments where they can run here (`--execute`);
    `step` is the framework's step it was read from (None for a `Traced` or `Lowered`).
    """

    name: str
    traced: Any
    lowered: Any
    args: tuple[Any, ...]
    donated: list[bool]
    fn: Callable[..., Any] | None = None
    fn_args: tuple[Any, ...] = ()
    trace_seconds: float = 0.0
    names: list[str] | None = None
    step: Any = None

    @property
    def framework(self) -> str:
        """"jax", "flax.nnx", "equinox" or "keras": whose program this is."""
        return "jax" if self.step is None else self.step.framework

    @property
    def closed_jaxpr(self) -> Any:
        """The program's ClosedJaxpr; None for a `Lowered`."""
        return None if self.traced is None else self.traced.jaxpr

    @property
    def donated_positions(self) -> tuple[int, ...]:
        """The positional arguments whose every leaf is donated (what `--donate` names)."""
        import jax

        out, start = [], 0
        for k, arg in enumerate(self.args):
            count = len(jax.tree.leaves(arg))
            if count and all(self.donated[start:start + count]):
                out.append(k)
            start += count
        return tuple(out)

    def in_leaves(self) -> list[Any]:
        """The flat inputs, as `jax.ShapeDtypeStruct`s."""
        import jax

        return jax.tree.leaves(self.args)

    def out_leaves(self) -> list[Any]:
        """The flat outputs, as `jax.ShapeDtypeStruct`s."""
        import jax

        stage = self.traced if self.traced is not None else self.lowered
        return jax.tree.leaves(stage.out_info)

    def lower_for(self, platform: str) -> Any:
        """The program lowered for `platform` ("cuda", "tpu", "cpu"): a `Lowered` given stays
        as it is (lowered for the platform it was lowered for)."""
        if self.traced is None:
            return self.lowered
        traced = self.traced
        if self.step is not None and self.step.for_platform is not None:   # a framework tracing per platform
            where = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
            traced, _ = _trace(lambda: self.step.for_platform(where), self.name)
        try:
            # In a thread of its own, as the trace: ops made while lowering get the caller's frames.
            lowered = _in_own_thread(lambda: _quietly(lambda: traced.lower(lowering_platforms=(platform,))))
        except Exception as err:  # JAX's own errors are many types; the user needs one line
            raise PlanError(f"JAX could not lower {self.name} for {platform}: {_one_line(err)}") from None
        _check_platform(lowered, platform, self.name)
        return lowered


def _quietly(lower: Callable[[], Any]) -> Any:
    """`lower()` without JAX's warning that donated buffers go unused (a program the user's own
    run would warn about once is lowered here for several platforms: jaxmem prints nothing of
    the user's program's own)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return lower()


def _check_platform(lowered: Any, platform: str, name: str) -> None:
    """A program placed on several devices of another platform (a `Traced` over a mesh of this
    host's CPUs, or over an `AbstractMesh`) is not the one-device program jaxmem compiles for
    the device: one line saying so. One device anywhere (`in_shardings` on this host's CPU) is
    the same program on the device: it passes."""
    try:   # JAX's own record of the shardings it lowered with (private; nothing to check without it)
        shardings = list(lowered._lowering.compile_args["in_shardings"])
    except Exception:
        return
    wanted = {"cuda": {"gpu", "cuda"}, "rocm": {"gpu", "rocm"}}.get(platform, {platform})
    for sharding in shardings:
        mesh = getattr(sharding, "mesh", None)
        if type(mesh).__name__ == "AbstractMesh":   # no devices to name: a mesh only has a size
            if getattr(mesh, "size", 1) > 1:
                raise PlanError(f"{name} was traced over an AbstractMesh of {mesh.size} devices: pass the function "
                                "and its arguments, jaxmem.analyze(fn, *args, device=...), to analyse it per device")
            continue
        devices = list(getattr(sharding, "device_set", ()))
        found = {d.platform for d in devices}
        if len(devices) > 1 and found - wanted:
            raise PlanError(f"{name}'s arguments are placed on {len(devices)} {'/'.join(sorted(found))} devices, and "
                            f"jaxmem compiles it for one {platform} device: pass the function and its arguments, "
                            "jaxmem.analyze(fn, *args, device=...), to analyse it per device")


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _name(fn: Any) -> str:
    """The function's name: a `Lowered`'s from its module (`module @jit_step`)."""
    import re

    if not hasattr(fn, "fun_name") and hasattr(fn, "as_text"):
        found = re.search(r"module @(?:jit_)?([\w.]+)", fn.as_text()[:2000])
        return found.group(1) if found else "lowered"
    return str(getattr(fn, "fun_name", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def prepare(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
            donate: int | Sequence[int] | None = None) -> Program:
    """The `Program` of `fn(*args, **kwargs)`, as the framework behind `fn` compiles it.

    Raises:
        JaxmemError: one line: `fn` is not callable, fails to trace, its arguments do not match,
            `donate` contradicts the jitted function's own donation, or the function updates
            its arguments in place where its framework would drop the update.
    """
    import jax

    from jaxmem.frameworks import as_step

    kwargs = dict(kwargs or {})
    if isinstance(fn, (jax.stages.Traced, jax.stages.Lowered)):
        if args or kwargs:
            raise PlanError(f"a jax.stages.{type(fn).__name__} holds its arguments already; pass no arguments")
        return _from_stage(fn, donate)
    if not callable(fn):
        raise PlanError(f"jaxmem.analyze takes a function, a jax.jit-wrapped one, a Traced or a Lowered, "
                        f"not a {type(fn).__name__}")
    step, seconds = _trace(lambda: as_step(fn, tuple(args), kwargs, donate), _name(fn))
    runnable = step.framework == "jax" and not kwargs
    program = _program(step.name if step.framework != "jax" else _name(fn), step.traced, None,
                       fn if runnable else None, tuple(args), seconds)
    return dataclasses.replace(program, names=step.names, step=step)


def program_of_step(build: Callable[[], Any]) -> Program:
    """The `Program` of the step `build()` makes (a framework's changed step), traced in
    jaxmem's own thread as every program is."""
    step, seconds = _trace(build, "the changed step")
    program = _program(step.name, step.traced, None, None, (), seconds)
    return dataclasses.replace(program, names=step.names, step=step)


def _trace(trace: Callable[[], Any], name: str) -> tuple[Any, float]:
    """`trace()` (JAX's trace of the user's function) and the seconds it took; whatever it
    raises is one `PlanError` line."""
    from jaxmem.compiler.jaxpr_adapter import first_sentence

    started = time.perf_counter()
    try:
        traced = _in_own_thread(trace)
    except (JaxmemError, KeyboardInterrupt):
        raise
    except BaseException as err:  # the user's function failed to trace (SystemExit too): one line
        raise PlanError(f"cannot trace {name!r}: {type(err).__name__}: {first_sentence(str(err), 300)}") from None
    return traced, time.perf_counter() - started




def _from_stage(stage: Any, donate: int | Sequence[int] | None) -> Program:
    """A `Traced` or `Lowered` the user made: JAX's donation in it."""
    import jax

    traced = stage if isinstance(stage, jax.stages.Traced) else None
    program = _program(_name(stage), traced, None if traced is not None else stage, None, (), 0.0)
    if donate is not None:
        from jaxmem.frameworks.plain import check_donate

        check_donate(stage, len(program.args), donate, program.name)
    return program


def _program(name: str, traced: Any, lowered: Any, fn: Any, fn_args: tuple[Any, ...], seconds: float) -> Program:
    """A `Program` from JAX's stage: its arguments and per-leaf donation from `args_info`."""
    import jax

    stage = traced if traced is not None else lowered
    positional, named = stage.args_info
    is_info = lambda x: hasattr(x, "donated")  # noqa: E731
    to_struct = lambda i: jax.ShapeDtypeStruct(i._aval.shape, i._aval.dtype, weak_type=i._aval.weak_type)  # noqa: E731
    tree = tuple(positional) + ((dict(named),) if named else ())
    donated = [bool(i.donated) for i in jax.tree.leaves(tree, is_leaf=is_info)]
    arguments = jax.tree.map(to_struct, tree, is_leaf=is_info)
    return Program(name, traced, lowered, arguments, donated, fn, fn_args, seconds)
