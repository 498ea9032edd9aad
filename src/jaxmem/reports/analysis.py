"""The report of one `jaxmem analyze` run: built once, read by every view.

`summarize` turns a plan (and the XLA figures and pool verdict found beside it) into one plain
dict, `AnalysisReport.data`: what `--json` prints, what the tables render
(`reports/analysis_tables.py`) and what the file reports add to the plan's timeline
(`reports/cli.write_plan_reports`). The plan itself rides along for those file reports, which
draw its buffers.

    report = AnalysisReport(summarize(plan, args, target="t", device=("h100-80gb", 80 << 30), top=10), plan)
    print(report.json())
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

# JAX preallocates this fraction of device memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
PREALLOCATE_FRACTION = 0.75


@dataclass
class AnalysisReport:
    """One analysis: `data` (plain JSON values) is what every view reads; `plan` is the
    `Plan` it summarizes, whose buffers the file reports (HTML, pprof, PNG, Chrome trace) draw."""

    data: dict[str, Any]
    plan: Any

    @property
    def has_device_reference(self) -> bool:
        """Whether XLA:GPU's or XLA:TPU's figures or a pool verdict are in it (the file reports
        then show them beside the plan)."""
        return any(self.data.get(key) is not None for key in ("xla_gpu", "xla_tpu", "pool"))

    def add_execution(self, execute: dict[str, Any], eager: list[dict[str, Any]]) -> None:
        """`--execute`'s comparison with jax.jit and its eager runs, as plain JSON values."""
        self.data["execute"], self.data["eager"] = jsonable(execute), jsonable(eager)

    def json(self) -> str:
        """What `--json` prints."""
        return json.dumps(self.data, indent=2)


def live_bytes_by_step(plan: Any) -> list[int]:
    """Arena bytes live at each step, index 0 being "on entry" (step -1) and the last "on exit"
    (the compiler's one live-bytes profile, `stages.live_profile`)."""
    from jaxmem.compiler.stages import live_profile

    spans = ((buf.start, buf.end, buf.size) for buf in plan.buffers)
    return [int(x) for x in live_profile(spans, len(plan.schedule))]


def _argument_names(args: Sequence[Any], names: Sequence[str] | None = None) -> list[str]:
    """Flat leaf names such as `args[0]['blocks'][1]['w_fc']`, in jaxpr invar order; `names`,
    where a framework named its inputs (`model.layers[0].kernel`), as they are."""
    import jax

    if names is not None:
        return list(names)
    names = []
    for i, arg in enumerate(args):
        for path, _ in jax.tree_util.tree_flatten_with_path(arg)[0]:
            names.append(f"args[{i}]{jax.tree_util.keystr(path)}")
    return names


def _source(source: Any) -> str:
    return str(source) if source is not None else ""


def _library_source(source: Any) -> str | None:
    """The library frame under the user's line (a Flax layer's `__call__`), where there is one."""
    library = getattr(source, "library", None)
    return str(library) if library is not None else None


def peak_buffers(plan: Any, args: Sequence[Any], top: int,
                 arg_names: Sequence[str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """The peak step and the `top` largest buffers live there, arguments outside the arena included.

    Returns:
        `(peak_step, rows)` where peak_step is a schedule index (-1: on entry) and each row has
        size_bytes, shape, dtype, kind, category, label and source.
    """
    from jaxmem.reports.categories import argument_reasons, buffer_category, value_categories

    live = live_bytes_by_step(plan)
    peak_index = max(range(len(live)), key=live.__getitem__)
    peak_step = peak_index - 1
    names = _argument_names(args, arg_names)
    # The reports' categories (residuals, gradients, optimizer state, ...), derived from the
    # program's structure, so the table and the HTML report name a buffer the same way.
    cats = value_categories(plan, arg_paths=names)
    reasons = argument_reasons(plan, arg_paths=names)  # an argument's category, and why
    rows = [{
        "size_bytes": b.size, "shape": list(b.shape), "dtype": b.dtype, "kind": b.kind,
        "category": buffer_category(b.kind, cats.get(b.values[0]) if b.values else None),
        "label": b.label, "source": _source(b.source), "library_source": _library_source(b.source),
        "offset": b.offset,
        **({"category_reason": reasons[b.values[0]]} if b.values and b.values[0] in reasons else {}),
    } for b in plan.buffers if b.start <= peak_step <= b.end]
    # Non-donated arguments stay in the caller's memory but are live at the peak all the same.
    for position, vid in enumerate(plan.invars):
        info = plan.values.get(vid)
        if info is None or info.buffer is not None:
            continue
        rows.append({
            "size_bytes": info.nbytes, "shape": list(info.shape), "dtype": info.dtype, "kind": "argument",
            "category": cats.get(vid, "parameters"), "label": names[position] if position < len(names) else "argument",
            "source": "", "library_source": None, "offset": None, "category_reason": reasons.get(vid, ""),
        })
    rows.sort(key=lambda r: -r["size_bytes"])
    return peak_step, rows[:top]


_XLA_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64", "s32": "int32",
               "s64": "int64", "s16": "int16", "s8": "int8", "u8": "uint8", "u32": "uint32", "pred": "bool",
               "c64": "complex64", "c128": "complex128", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def _file_line(source: str) -> str:
    return source.split(" (", 1)[0] if source else ""


def gpu_peak_rows(ref: Any, plan: Any, args: Sequence[Any],
                  arg_names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """XLA:GPU's largest buffers live at its peak, each matched to the jaxpr-level array it
    holds where that can be told: an argument by its position, else a planned buffer with the
    same dtype and shape (and the same source line when both have one)."""
    names = _argument_names(args, arg_names)
    by_shape: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    if plan is not None:
        for b in plan.buffers:
            by_shape.setdefault((str(b.dtype), tuple(b.shape)), []).append(b)
    rows = []
    for row in ref.peak_buffers:
        dtype = _XLA_DTYPES.get(row.get("dtype", ""), row.get("dtype", ""))
        array = ""
        xla_source = row.get("source", "")
        source = xla_source
        if row.get("argument") is not None and row["argument"] < len(names):
            array = names[row["argument"]]
        else:
            # XLA's metadata names the innermost frame outside JAX (a library's, for a Flax
            # layer); jaxmem's source is the user's line with that library frame kept beside it.
            where = _file_line(row.get("source", ""))
            candidates = by_shape.get((dtype, tuple(row.get("shape", []))), [])
            same_line = [b for b in candidates if where and where in (
                _file_line(_source(b.source)), _file_line(_library_source(b.source) or ""))]
            unsourced = [b for b in candidates if not _source(b.source)]
            pick = (same_line or unsourced or [None])[0]
            if pick is not None:
                array = pick.label
                if pick.source is not None:
                    source = _source(pick.source)
        rows.append({"size_bytes": int(row["size_bytes"]), "dtype": dtype, "shape": list(row.get("shape", [])),
                     "kind": row.get("kind", ""), "hlo": row.get("name", ""), "op_name": row.get("op_name", ""),
                     "source": source, "library_source": xla_source if xla_source and xla_source != source else None,
                     "jaxpr_array": array})
    return rows


def summarize(plan: Any, args: Sequence[Any], *, target: str, device: tuple[str, int], top: int,
              gpu: Any = None, pool: Any = None, fraction: float = PREALLOCATE_FRACTION,
              note: str | None = None, predicted: Any = None, tpu: Any = None,
              accelerator: Any = None, cpu_totals: dict[str, int] | None = None,
              cpu_xla: Any = None, arg_names: Sequence[str] | None = None) -> dict[str, Any]:
    """The analysis as one plain dict: what `--json` prints and what the tables render.

    Args:
        plan: a `jaxmem.compiler.plan_types.Plan`; None for a program with no jaxpr (a
            `jax.stages.Lowered`): XLA's figures alone, `plan_note` saying so.
        args: the positional arguments the plan was made for (to name argument buffers).
        target: the TARGET string shown in the report.
        device: (name, capacity bytes) for the fit check.
        top: how many buffers live at the peak to list.
        gpu, tpu: XLA:GPU's or XLA:TPU's reference figures, where compiled.
        pool: the pool verdict over N steps; fraction: the pool's share of the device.
        note: why a device's XLA was not compared with (shown, and in the JSON).
        predicted: jaxmem's prediction of XLA:GPU's figures (a GPU preset).
        accelerator: the device's preset row, None for a bare size.
        cpu_totals: XLA:CPU's total under each scheduler compiled (`--cpu-scheduler`).
        cpu_xla: XLA:CPU's figures where there is no plan to carry them.
        arg_names: the flat inputs' names where a framework gave them (else from `args`' paths).
    """
    if plan is None:
        return summarize_without_plan(args, target=target, device=device, gpu=gpu, pool=pool, fraction=fraction,
                                      note=note, tpu=tpu, accelerator=accelerator, cpu_xla=cpu_xla)
    name, capacity = device
    on_tpu = accelerator is not None and accelerator.is_tpu
    # JAX's TPU runtime preallocates nothing: a program may use the whole chip.
    usable = capacity if on_tpu else int(capacity * fraction)
    peak_step, rows = peak_buffers(plan, args, top, arg_names)
    xla = plan.xla
    xla_total = xla.total_bytes if xla is not None else None
    data = {
        "target": target,
        "peak_bytes": plan.peak_bytes,
        "arena_bytes": plan.arena_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "program_order_lower_bound_bytes": plan.program_order_lower_bound_bytes,
        "argument_bytes": plan.argument_bytes,
        "output_bytes": plan.output_bytes,
        "xla_total_bytes": xla_total,
        "xla": _cpu_summary(xla),
        "ratio_to_xla": (plan.peak_bytes / xla_total) if xla_total else None,
        **_rest(plan, peak_step, rows, usable, fraction, name, capacity, on_tpu, accelerator, tpu, pool),
        **_device_part(plan, args, gpu, tpu, pool, predicted, note, cpu_totals, arg_names),
    }
    return _plan_near_device(data)


def _plan_near_device(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with jaxmem's plan withheld where it is far above XLA's figure for the device
    (`reports.plan_check`): the device's fit is then the pool's alone."""
    from jaxmem.reports.plan_check import withhold

    xla, who = (data["xla_tpu"], "XLA:TPU") if data.get("xla_tpu") else (data.get("xla_gpu"), "XLA:GPU")
    out = withhold(data, xla, who, ("peak_bytes", "top_buffers", "ratio_to_xla"))
    if "plan_withheld" in out:
        out["device"] = {**out["device"], "fits": None}
    return out


def _cpu_summary(xla: Any) -> dict[str, Any] | None:
    """XLA:CPU's figures as the JSON's `xla` object."""
    return None if xla is None else {
            "argument_bytes": xla.argument_bytes, "output_bytes": xla.output_bytes, "temp_bytes": xla.temp_bytes,
            "alias_bytes": xla.alias_bytes, "generated_code_bytes": xla.generated_code_bytes,
            "scheduler": xla.scheduler, "total_bytes": xla.total_bytes, "library_fusions": xla.library_fusions,
            "library_hidden_bytes": xla.library_hidden_bytes,
        }


def _rest(plan: Any, peak_step: int, rows: list[dict[str, Any]], usable: int, fraction: float, name: str,
          capacity: int, on_tpu: bool, accelerator: Any, tpu: Any, pool: Any) -> dict[str, Any]:
    """The plan's own figures, and the device's fit."""
    return {
        "gap_to_lower_bound": (plan.peak_bytes / plan.lower_bound_bytes - 1.0) if plan.lower_bound_bytes else 0.0,
        "num_eqns": plan.num_eqns,
        "num_steps": len(plan.schedule),
        "num_buffers": len(plan.buffers),
        "plan_seconds": plan.plan_seconds,
        "trace_seconds": plan.trace_seconds,   # JAX's make_jaxpr, before planning
        "valid": bool(plan.valid),
        "scheduler": plan.scheduler,
        "placement": plan.placement,
        "donated": list(plan.donated),
        "unknown_primitives": sorted(set(plan.unknown_primitives)),
        "peak_step": peak_step,
        "top_buffers": rows,
        "device": {"name": name, "capacity_bytes": capacity, "preallocated_fraction": None if on_tpu else fraction,
                   "usable_bytes": usable,
                   # On a TPU judged by XLA:TPU, jaxmem's unfused plan is no verdict on the chip.
                   "fits": None if on_tpu and tpu is not None else plan.peak_bytes <= usable,
                   "platform": accelerator.platform if accelerator is not None else None,
                   "pool_rules": accelerator.pool_rules if accelerator is not None else "gpu_client"},
        "fits": plan.peak_bytes <= usable if pool is None else bool(pool.fits),
    }


def _device_part(plan: Any, args: Sequence[Any], gpu: Any, tpu: Any, pool: Any, predicted: Any, note: str | None,
                 cpu_totals: dict[str, int] | None, arg_names: Sequence[str] | None = None) -> dict[str, Any]:
    """XLA:GPU's or XLA:TPU's figures and peak buffers, the pool verdict, the prediction."""
    from jaxmem.xla.tpu.compile import summary as tpu_summary

    return {
        "xla_gpu": None if gpu is None else gpu.summary(),
        "xla_gpu_peak_buffers": [] if gpu is None else gpu_peak_rows(gpu, plan, args, arg_names),
        "xla_gpu_peak_live_bytes": None if gpu is None else gpu.peak_live_bytes,
        "xla_tpu": None if tpu is None else tpu_summary(tpu),
        "xla_tpu_peak_buffers": [] if tpu is None else gpu_peak_rows(tpu, plan, args, arg_names),
        "xla_tpu_peak_live_bytes": None if tpu is None else tpu.peak_live_bytes,
        "pool": None if pool is None else {**pool.summary(), "judged_on": "xla_gpu" if gpu is not None else
                                           "xla_tpu" if tpu is not None else
                                           "predicted_xla_gpu" if predicted is not None else "xla_cpu"},
        "xla_note": note,
        "predicted_xla_bytes": None if predicted is None else predicted.total_bytes,
        "predicted_xla": None if predicted is None else predicted.summary(),
        "xla_cpu_schedulers": cpu_totals,
        "plan_note": None,
    }


# What a program with no jaxpr (a `jax.stages.Lowered`) says in place of jaxmem's plan.
NO_PLAN_NOTE = ("no jaxpr (a jax.stages.Lowered): jaxmem made no plan; the figures are XLA's, and the "
                "source lines of its peak buffers are XLA's metadata")


def summarize_without_plan(args: Sequence[Any], *, target: str, device: tuple[str, int], gpu: Any, pool: Any,
                           fraction: float, note: str | None, tpu: Any, accelerator: Any,
                           cpu_xla: Any) -> dict[str, Any]:
    """`summarize` of a program with no jaxpr: every key of the plan's None (or empty), XLA's
    figures and the pool verdict as they are, `plan_note` saying why."""
    name, capacity = device
    on_tpu = accelerator is not None and accelerator.is_tpu
    usable = capacity if on_tpu else int(capacity * fraction)
    empty = dict.fromkeys(("peak_bytes", "arena_bytes", "lower_bound_bytes", "program_order_lower_bound_bytes",
                           "argument_bytes", "output_bytes", "ratio_to_xla", "gap_to_lower_bound", "num_eqns",
                           "num_steps", "num_buffers", "plan_seconds", "trace_seconds", "valid", "scheduler",
                           "placement", "peak_step"))
    return {
        "target": target, **empty,
        "xla_total_bytes": None if cpu_xla is None else cpu_xla.total_bytes, "xla": _cpu_summary(cpu_xla),
        "donated": [], "unknown_primitives": [], "top_buffers": [],
        "device": {"name": name, "capacity_bytes": capacity, "preallocated_fraction": None if on_tpu else fraction,
                   "usable_bytes": usable, "fits": None,
                   "platform": accelerator.platform if accelerator is not None else None,
                   "pool_rules": accelerator.pool_rules if accelerator is not None else "gpu_client"},
        "fits": None if pool is None else bool(pool.fits),
        **_device_part(None, args, gpu, tpu, pool, None, note, None),
        "plan_note": NO_PLAN_NOTE,
    }


def jsonable(obj: Any) -> Any:
    """Numpy scalars and tuples from the executor's dicts, as plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj

