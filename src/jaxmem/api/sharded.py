"""`jaxmem.analyze` of a function whose arguments carry `NamedSharding`s over several devices:
memory per device, as `jaxmem analyze TARGET` reports it for a factory's sharded arguments.

The function is traced here over an `AbstractMesh` with the arguments' axes (their own mesh may
be abstract, of this host's devices, or of the accelerators the notebook runs on), its tagged
copy is lowered for the device's platform, and a child compiles the text partitioned over N
compile-only GPUs or TPU chips (`xla/sharding/lowered.py`); from there on it is the TARGET
path's analysis (`xla/sharding.finish_sharded`), then the pool or the TPU runtime over N steps.

    mesh = jax.sharding.AbstractMesh((8,), ("data",))
    batch = jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    result = jaxmem.analyze(step, params, batch, device="h100-80gb")
    result.devices, result.xla["total_bytes"], result.replicated[0]
"""

from __future__ import annotations

import io
import time
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from jaxmem.errors import PlanError
from jaxmem.xla.sharding.lowered import reference_of_traced, trace_on_mesh  # noqa: F401  (api names)
from jaxmem.units import format_size


def xla_kind(device: str, xla: str = "auto", topology: str | None = None) -> tuple[str, str | None]:
    """("gpu", "tpu" or "cpu": which XLA compiles the mesh for `device`, a note when XLA:GPU or
    XLA:TPU was wanted but is not installed here and XLA:CPU on host devices stands in).

    Raises:
        PlanError: `xla` names a compiler the device has not, or one not installed here.
    """
    from jaxmem.accelerators import find
    from jaxmem.xla.gpu.compile import spec_for, unavailable_reason

    accelerator = find(device)
    if topology and (accelerator is None or not accelerator.is_tpu):
        raise PlanError(f"--topology is for a TPU preset, not {device!r}")
    if accelerator is not None and accelerator.is_tpu and xla in ("auto", "tpu"):
        from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

        return _kind_or_cpu("tpu", tpu_reason(), xla == "tpu")
    if xla == "tpu":
        raise PlanError(f"--xla tpu needs a TPU preset, not {device!r}")
    if xla == "cpu" or spec_for(device) is None:
        if xla == "gpu":
            raise PlanError(f"--xla gpu needs a GPU preset with an XLA target description, not {device!r}")
        return "cpu", None
    return _kind_or_cpu("gpu", unavailable_reason(), xla == "gpu")


def _kind_or_cpu(kind: str, reason: str | None, forced: bool) -> tuple[str, str | None]:
    """`kind` where its compiler runs here; else an error when it was asked for (`forced`), or
    "cpu" with a note."""
    if not reason:
        return kind, None
    name = f"XLA:{kind.upper()}"
    if forced:
        raise PlanError(f"{name} is not available here: {reason}")
    return "cpu", f"{name} is not available here ({reason}); comparing with XLA:CPU on host devices"


def pool_verdict(ref: dict[str, Any], dev: Any, steps: int) -> Any:
    """The per-device pool across `steps` training steps, from a sharded reference (per chip,
    under the TPU runtime's rules, for an XLA:TPU reference)."""
    from jaxmem.runtime.steps import program_from_reference, simulate_steps

    view = SimpleNamespace(arguments=ref["arguments"], outputs=ref["outputs"], temp_bytes=ref["xla"]["temp_bytes"])
    if ref["xla_kind"] == "tpu":
        from jaxmem.accelerators import resolve
        from jaxmem.runtime.tpu_pool import simulate_tpu_steps

        return simulate_tpu_steps(program_from_reference(view), resolve(ref["xla"]["target"]).capacity_bytes, steps,
                                  code_bytes=ref["xla"].get("generated_code_bytes", 0))
    return simulate_steps(program_from_reference(view), dev, steps)


def summarize(ref: dict[str, Any], pool: Any, *, target: str, device: tuple[str, int]) -> dict[str, Any]:
    """The JSON object of one sharded analysis (what `jaxmem analyze TARGET --json` prints)."""
    from jaxmem.reports.plan_check import withheld_because

    key = {"gpu": "xla_gpu", "tpu": "xla_tpu"}.get(ref["xla_kind"], "xla_cpu")
    who = {"xla_gpu": "XLA:GPU", "xla_tpu": "XLA:TPU"}.get(key, "XLA:CPU")
    why = withheld_because(ref["peak_bytes"], ref["xla"], who, per_device=True)
    plan = ref["plan"] if why is None else {**ref["plan"], "top": [], "withheld": why,
                                            "withheld_peak_bytes": ref["peak_bytes"]}
    return {
        "target": target, "device": device[0], "capacity_bytes": device[1], "devices": ref["devices"],
        "mesh": ref["mesh"], "layout": ref.get("layout"), "cached": bool(ref.get("cached")),
        key: ref["xla"], "peak_bytes": ref["peak_bytes"] if why is None else None,
        "plan": plan, "replicated_bytes": ref["replicated_bytes"], "replicated": ref["replicated"],
        f"{key}_peak_buffers": ref["peak_buffers"], f"{key}_peak_live_bytes": ref["peak_live_bytes"],
        "pool": pool.summary() if pool is not None else None,
        "pool_line": pool.line() if pool is not None else None,
    }


class ShardedAnalysis:
    """One analysis of a program on a mesh, per device.

    **Attributes:** `fits` (the pool's verdict per device over the steps: the GPU client's
    pool, or the TPU runtime's per chip; None where no pool was simulated), `xla` (XLA's
    per-device figures, a dict), `pool`, `peak_buffers` (the largest buffers live at jaxmem's
    per-device peak, else at XLA's), `plan` (jaxmem's per-device plan as a dict: `peak_bytes`,
    `method`, `valid`, `top`; `note` where none was made), `devices`, `mesh`, `replicated`
    (arguments over 1 MiB per device left replicated over a mesh axis, with what sharding them
    would save), `note`.
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    @property
    def fits(self) -> bool | None:
        pool = self.data.get("pool")
        return None if pool is None else bool(pool["fits"])

    @property
    def xla(self) -> dict[str, Any]:
        return next(self.data[k] for k in ("xla_gpu", "xla_tpu", "xla_cpu") if k in self.data)

    @property
    def pool(self) -> dict[str, Any] | None:
        return self.data.get("pool")

    @property
    def plan(self) -> dict[str, Any]:
        return self.data["plan"]

    @property
    def devices(self) -> int:
        return int(self.data["devices"])

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.data["mesh"])

    @property
    def replicated(self) -> list[dict[str, Any]]:
        return list(self.data["replicated"])

    @property
    def peak_buffers(self) -> list[dict[str, Any]]:
        if self.plan.get("top"):
            return list(self.plan["top"])
        return next((self.data[k] for k in ("xla_gpu_peak_buffers", "xla_tpu_peak_buffers") if self.data.get(k)), [])

    @property
    def note(self) -> str | None:
        return (self.data.get("note") or self.plan.get("withheld")
                or (self.plan.get("note") and f"no per-device plan of jaxmem's: {self.plan['note']}") or None)

    def to_dict(self) -> dict[str, Any]:
        """The analysis as plain JSON values: what `jaxmem analyze TARGET --json` prints."""
        import json

        return json.loads(json.dumps({k: v for k, v in self.data.items() if k != "note"}))

    def text(self, width: int = 160) -> str:
        """The tables `jaxmem analyze` prints for a mesh, as plain text `width` columns wide."""
        from rich.console import Console

        from jaxmem.reports.sharded_tables import render

        out = io.StringIO()
        render(self.data, Console(file=out, width=width, force_terminal=False, color_system=None))
        return out.getvalue()

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return (f"<jaxmem.ShardedAnalysis {self.data['target']} on {self.devices} x {self.data['device']}: "
                f"fits={self.fits}, XLA total per device {self.xla.get('total_bytes')} B>")

    def html(self) -> str:
        """The tables as a self-contained HTML fragment (inline styles; nothing is fetched)."""
        from rich.console import Console

        from jaxmem.reports.sharded_tables import render

        console = Console(record=True, file=io.StringIO(), width=140, force_terminal=True, color_system="truecolor")
        render(self.data, console)
        body = console.export_html(inline_styles=True, code_format="<pre style=\"font-family:monospace\">{code}</pre>")
        verdict = {True: "fits", False: "does not fit", None: "not judged"}[self.fits]
        return (f"<div class=\"jaxmem-sharded\"><p><b>{_escape(self.data['target'])}</b> per device on "
                f"{self.devices} x {_escape(self.data['device'])}: {verdict}; XLA total "
                f"{format_size(self.xla['total_bytes'])}</p>{body}</div>")

    def _repr_html_(self) -> str:
        return self.html()


def _escape(text: Any) -> str:
    import html

    return html.escape(str(text))


def analyze_sharded(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, donate: Any, options: Any,
                    busy: Callable[[str], Any], device_reason: str | None = None) -> ShardedAnalysis:
    """The per-device analysis of `fn(*args, **kwargs)` on the arguments' mesh, with the
    options of `jaxmem.analyze` (`api.pipeline.Options`); `device_reason` says why the device
    was chosen, where the caller named none.

    Raises:
        JaxmemError: one line: `fn` fails to trace or does not match its arguments, a sharding
            names an axis the mesh lacks or does not divide its array, the device is unknown,
            or XLA refuses the per-device program.
    """
    from jaxmem.api.pipeline import parse_device
    from jaxmem.api.program import _name, prepare

    name = _name(fn)
    device = parse_device(options.device)
    kind, note = xla_kind(device[0].strip().lower(), options.xla)
    with busy(f"tracing {name}"):
        call, dynamic = _dynamic_call(fn, tuple(args), dict(kwargs or {}))
        try:   # JAX's own reading of the function: its donation and static arguments
            program = prepare(fn, args, kwargs, donate)
        except PlanError:
            trace_on_mesh(call, dynamic)   # on the mesh, a failure names the axis it lacks (ShardingError)
            raise
        refuse_framework_on_mesh(program)
        traced = trace_on_mesh(call, dynamic, donate_argnums=program.donated_positions)
    on = {"gpu": f"XLA:GPU {device[0]}", "tpu": f"XLA:TPU {device[0]}"}.get(kind, "XLA:CPU")
    started = time.perf_counter()
    with busy(f"compiling per device for {on}"):
        ref = reference_of_traced(traced, xla=kind, device=device[0].strip().lower(), top=options.top)
    pool, pool_note = _pool(ref, options, device[1])
    data = summarize(ref, pool, target=name, device=device)
    if device_reason:
        data["device_chosen_because"] = device_reason
    data["total_seconds"] = time.perf_counter() - started
    notes = [n for n in (note, pool_note) if n]
    if notes:
        data["note"] = "; ".join(notes)
    return ShardedAnalysis(data)


def refuse_framework_on_mesh(program: Any) -> None:
    """One line for a framework's step (an `nnx.jit` step, ...) given on a mesh: jaxmem reads those
    on one device; on a mesh it takes the pure step."""
    if program.framework != "jax":
        raise PlanError(f"jaxmem reads {program.step.label} steps on one device; on a mesh, give the pure step "
                        "(jax.jit of the state, with NamedSharding arguments)")


def sharded_reference_of(fn: Callable[..., Any], args: Sequence[Any], *, device: str, xla: str,
                         donate_argnums: Sequence[int] = (), top: int = 10, mesh: str | None = None,
                         layout: str | None = None, topology: str | None = None,
                         use_cache: bool = True) -> dict[str, Any]:
    """XLA's per-device figures of `fn(*args)` on the arguments' mesh (or `mesh` under
    `layout`), jaxmem's per-device plan and what is replicated: the reference `jaxmem analyze`
    reports for a factory's sharded arguments (`xla.sharding.compile_sharded` has its keys)."""
    traced = trace_on_mesh(fn, args, donate_argnums=donate_argnums, mesh=mesh, layout=layout)
    return reference_of_traced(traced, xla=xla, device=device, top=top, topology=topology, use_cache=use_cache)


def _pool(ref: dict[str, Any], options: Any, capacity: int) -> tuple[Any, str | None]:
    """The pool's verdict per device over `options.steps` (the TPU runtime's, per chip), or
    None and why it was not simulated (the environment's pool settings cannot be read)."""
    if ref["xla_kind"] == "tpu":
        return pool_verdict(ref, None, options.steps), None
    from jaxmem.api.pipeline import pool_device
    from jaxmem.errors import ConfigError

    try:
        dev = pool_device(options, capacity)
    except ConfigError as err:
        return None, f"the pool is not simulated: {err}"
    return pool_verdict(ref, dev, options.steps), None


def _dynamic_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`fn` as a function of its dynamic arguments alone, and those arguments: the positional
    ones a `jax.jit`-wrapped `fn` does not hold static, then the keyword arguments that are
    arrays, as one last dict (as `jaxmem.analyze`'s reports name them)."""
    info = getattr(fn, "_jit_info", None)   # JAX's record of a jitted function's static arguments
    static_nums = {i % max(1, len(args)) for i in getattr(info, "static_argnums", ()) or ()}
    static_names = set(getattr(info, "static_argnames", ()) or ())
    positions = [i for i in range(len(args)) if i not in static_nums]
    dynamic_kw = {k: v for k, v in kwargs.items() if k not in static_names and _arrays(v)}
    static_kw = {k: v for k, v in kwargs.items() if k not in dynamic_kw}

    def call(*dynamic: Any) -> Any:
        full = list(args)
        for i, value in zip(positions, dynamic):
            full[i] = value
        named = dict(static_kw, **(dynamic[len(positions)] if dynamic_kw else {}))
        return fn(*full, **named)

    call.__name__ = getattr(fn, "__name__", None) or type(fn).__name__
    return call, tuple(args[i] for i in positions) + ((dynamic_kw,) if dynamic_kw else ())


def _arrays(tree: Any) -> bool:
    import jax

    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves)
