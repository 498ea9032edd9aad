"""What `jaxmem.analyze` is handed, made one thing: a traced (or lowered) program, its arguments
as the reports name them, and which flat inputs are donated.

`fn` may be a plain function, a `jax.jit`-wrapped one, a `jax.stages.Traced` or a
`jax.stages.Lowered`. Donation and static arguments of a jitted function are JAX's own, read
from its trace (`args_info`, per leaf); `donate=` may repeat them, never contradict them.

    program = prepare(jax.jit(step, donate_argnums=(0, 1)), (state, batch))
    program.donated, program.lower_for("tpu")
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxmem.errors import JaxmemError, PlanError


@dataclass
class Program:
    """One program to analyse.

    `traced` is JAX's `Traced` (None for a `Lowered`, which has no jaxpr: then `lowered` is
    set); `args` are its dynamic arguments as the reports name them (`args[0]['w']`, keyword
    arguments as one last dict); `donated` says per flat input whether it is donated; `fn` and
    `fn_args` are the user's function and arguments where they can run here (`--execute`).
    """

    name: str
    traced: Any
    lowered: Any
    args: tuple[Any, ...]
    donated: list[bool]
    fn: Callable[..., Any] | None = None
    fn_args: tuple[Any, ...] = ()
    trace_seconds: float = 0.0

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
        try:
            # In a thread of its own, as the trace: ops made while lowering get the caller's frames.
            lowered = _in_own_thread(lambda: self.traced.lower(lowering_platforms=(platform,)))
        except Exception as err:  # JAX's own errors are many types; the user needs one line
            raise PlanError(f"JAX could not lower {self.name} for {platform}: {_one_line(err)}") from None
        _check_platform(lowered, platform, self.name)
        return lowered


def _check_platform(lowered: Any, platform: str, name: str) -> None:
    """A program whose arguments are placed on another platform's devices (a `Traced` of arrays
    on this host's CPU) is not the program the device would run: one line saying so."""
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
        found = {d.platform for d in getattr(sharding, "device_set", ())}
        if found - wanted:
            raise PlanError(f"{name}'s arguments are placed on {'/'.join(sorted(found))} devices, and jaxmem "
                            f"compiles it for {platform}: trace it with jax.ShapeDtypeStruct arguments "
                            "(or NamedShardings over a jax.sharding.AbstractMesh)")


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
    """The `Program` of `fn(*args, **kwargs)`.

    Raises:
        JaxmemError: one line: `fn` is not callable, fails to trace, its arguments do not match,
            or `donate` contradicts the jitted function's own donation.
    """
    import jax

    kwargs = dict(kwargs or {})
    if isinstance(fn, (jax.stages.Traced, jax.stages.Lowered)):
        if args or kwargs:
            raise PlanError(f"a jax.stages.{type(fn).__name__} holds its arguments already; pass no arguments")
        return _from_stage(fn, donate)
    if not callable(fn):
        raise PlanError(f"jaxmem.analyze takes a function, a jax.jit-wrapped one, a Traced or a Lowered, "
                        f"not a {type(fn).__name__}")
    if _is_jitted(fn):
        return _from_jitted(fn, tuple(args), kwargs, donate)
    return _from_function(fn, tuple(args), kwargs, donate)


def _is_jitted(fn: Any) -> bool:
    return callable(getattr(fn, "trace", None)) and callable(getattr(fn, "lower", None))


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


def _in_own_thread(work: Callable[[], Any]) -> Any:
    """`work()` run in a thread of its own: JAX records each equation's Python stack, and the
    caller's frames (a notebook cell, a test, the command line) would otherwise land in the
    lowered program's locations, so that the same program, analysed from two places, never
    hits the compile cache (keyed by the program text)."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = work()
        except BaseException as err:  # handed back to the caller's thread
            box["err"] = err

    worker = threading.Thread(target=run, name="jaxmem-trace")
    worker.start()
    worker.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def _from_function(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   donate: int | Sequence[int] | None) -> Program:
    """A plain function: jitted here, with `donate` (positions) as its `donate_argnums`."""
    import jax

    from jaxmem.compiler.jaxpr_adapter import donate_positions, split_kwargs
    from jaxmem.xla.gpu.compile import abstract_args

    positions = donate_positions(len(args), donate if donate is not None else ())
    dynamic, static = split_kwargs(kwargs)
    target = functools.partial(fn, **static) if static else fn
    jitted = jax.jit(target, donate_argnums=positions)
    structs = abstract_args(args)
    named = abstract_args((dynamic,))[0] if dynamic else {}
    traced, seconds = _trace(lambda: jitted.trace(*structs, **named), _name(fn))
    return _program(_name(fn), traced, None, fn, args, seconds, kwargs=dynamic)


def _from_jitted(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 donate: int | Sequence[int] | None) -> Program:
    """A `jax.jit`-wrapped function: its own donation and static arguments; a `donate` where
    it donates nothing wraps it in one more `jax.jit` that donates those."""
    import jax

    from jaxmem.xla.gpu.compile import abstract_args

    def trace(f: Any) -> Any:
        try:   # abstract arguments: no array of the user's is committed to a device
            return f.trace(*abstract_args(args), **kwargs)
        except Exception:  # a static argument must stay a value: JAX's trace of the originals
            return f.trace(*args, **kwargs)

    traced, seconds = _trace(lambda: trace(fn), _name(fn))
    program = _program(_name(fn), traced, None, fn, args, seconds, kwargs=kwargs)
    if donate is None:
        return program
    if not any(program.donated):
        from jaxmem.compiler.jaxpr_adapter import donate_positions

        outer = jax.jit(fn, donate_argnums=donate_positions(len(args), donate))
        traced, seconds = _trace(lambda: trace(outer), _name(fn))
        return _program(_name(fn), traced, None, fn, args, seconds, kwargs=kwargs)
    _check_donate(program, donate)
    return program


def _from_stage(stage: Any, donate: int | Sequence[int] | None) -> Program:
    """A `Traced` or `Lowered` the user made: JAX's donation in it."""
    import jax

    traced = stage if isinstance(stage, jax.stages.Traced) else None
    program = _program(_name(stage), traced, None if traced is not None else stage, None, (), 0.0)
    if donate is not None:
        _check_donate(program, donate)
    return program


def _program(name: str, traced: Any, lowered: Any, fn: Any, fn_args: tuple[Any, ...], seconds: float,
             kwargs: dict[str, Any] | None = None) -> Program:
    """A `Program` from JAX's stage: its arguments and per-leaf donation from `args_info`."""
    import jax

    stage = traced if traced is not None else lowered
    positional, named = stage.args_info
    is_info = lambda x: hasattr(x, "donated")  # noqa: E731
    to_struct = lambda i: jax.ShapeDtypeStruct(i._aval.shape, i._aval.dtype, weak_type=i._aval.weak_type)  # noqa: E731
    tree = tuple(positional) + ((dict(named),) if named else ())
    donated = [bool(i.donated) for i in jax.tree.leaves(tree, is_leaf=is_info)]
    arguments = jax.tree.map(to_struct, tree, is_leaf=is_info)
    return Program(name, traced, lowered, arguments, donated, fn if not kwargs else None, fn_args, seconds)


def _check_donate(program: Program, donate: int | Sequence[int]) -> None:
    """`donate` (positions) must say what the jitted function's own donation says."""
    from jaxmem.compiler.jaxpr_adapter import donate_positions

    wanted = tuple(sorted(set(donate_positions(len(program.args), donate))))
    import jax

    flags: list[bool] = []
    for k, arg in enumerate(program.args):
        flags += [k in wanted] * len(jax.tree.leaves(arg))
    if flags != program.donated:
        own = program.donated_positions
        said = ", ".join(map(str, own)) if own else ("some leaves" if any(program.donated) else "nothing")
        raise PlanError(f"donate={wanted} contradicts {program.name}'s own jax.jit donation ({said}); "
                        "leave donate out: it is read from the jitted function")
