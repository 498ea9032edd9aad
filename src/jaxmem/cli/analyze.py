"""Plan a JAX function's device memory and compare it with XLA's: `jaxmem analyze [TARGET]`.

TARGET is `path/to/file.py:factory` or `package.module:factory`, where `factory()` returns
`(fn, args)`. Without TARGET, a built-in GPT-style transformer training step with Adam
(`jaxmem.examples.gpt:default_example`) is analyzed.

For a GPU preset (h100-80gb, a100-40gb, ...) XLA:GPU's own figures come from a deviceless
compile for that GPU in a subprocess (cached), with the buffers XLA:GPU holds at its peak, and
the pool verdict: N training steps (`--steps`, default 3) in jaxmem's BFC pool, set up from
JAX's environment variables as JAX would (`XLA_PYTHON_CLIENT_PREALLOCATE`,
`XLA_CLIENT_MEM_FRACTION`, `XLA_PYTHON_CLIENT_ALLOCATOR`) or from the flags that override them.
`--xla cpu` compares with XLA:CPU on this machine only, as before.

    jaxmem analyze
    jaxmem analyze my_model.py:make_step --donate 0,1 --device a100-40gb
    jaxmem analyze jaxmem.examples.suite:cnn_train --json --xla cpu
    jaxmem analyze jaxmem.examples.sharded:fsdp_step
    jaxmem analyze jaxmem.examples.sharded:gpt_step --compare-shardings --mesh 4x2

A factory whose arguments carry a `NamedSharding` over several devices (an `AbstractMesh`, or a
mesh of this host's devices) is analyzed per device on as many compile-only GPUs (`--xla cpu`:
host devices); `--mesh`/`--layout`/`--compare-shardings` lay out an unsharded training step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from jaxmem.cli import OneLineParser, report_console
from jaxmem.errors import ConfigError, JaxmemError, PlanError
from jaxmem.accelerators import find as find_accelerator, tpu_presets
from jaxmem.units import PRESETS, format_size, parse_size

DEFAULT_TARGET = "jaxmem.examples.gpt:default_example"
DEFAULT_DEVICE = "h100-80gb"
# JAX preallocates this fraction of device memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
PREALLOCATE_FRACTION = 0.75
TOP_BUFFERS = 10


def build_parser() -> argparse.ArgumentParser:
    from jaxmem.reports.cli import add_arguments

    parser = OneLineParser(
        prog="jaxmem analyze",
        description=(__doc__ or "").strip().splitlines()[0],
        epilog="TARGET: 'path/to/file.py:factory' or 'package.module:factory'; factory() returns (fn, args).",
    )
    parser.add_argument("target", nargs="?", default=None, metavar="TARGET",
                        help=f"what to analyze (default: the built-in GPT training step, {DEFAULT_TARGET})")
    parser.add_argument("--donate", default="", metavar="0,1",
                        help="positional arguments of fn to donate, as jax.jit's donate_argnums")
    parser.add_argument("--device", default=DEFAULT_DEVICE, metavar="PRESET",
                        help=f"device to check the fit against: a preset ({', '.join(sorted(PRESETS))}) "
                             f"or a size such as 24GiB (default {DEFAULT_DEVICE})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--top", type=int, default=TOP_BUFFERS, metavar="N",
                        help=f"how many of the largest buffers live at the peak to list (default {TOP_BUFFERS})")
    parser.add_argument("--no-xla", action="store_true", help="skip compiling with XLA for its reference figures")
    parser.add_argument("--xla", choices=("auto", "gpu", "tpu", "cpu"), default="auto",
                        help="which XLA to compare with: auto (default: XLA:GPU for a GPU preset, XLA:TPU for a "
                             "TPU preset, compiled deviceless, and XLA:CPU here), gpu or tpu (that one only) or "
                             "cpu (XLA:CPU here only)")
    parser.add_argument("--cpu-scheduler", choices=("default", "dfs", "bfs", "both"), default="default",
                        help="XLA:CPU's scheduler to compare with: default (compiled in this process), dfs "
                             "(memory-optimized) or bfs (concurrency-optimized), each compiled in a fresh "
                             "process, or both (the lower total is the comparison)")
    add_pool_arguments(parser)
    from jaxmem.cli.sharded import add_arguments as add_mesh_arguments

    add_mesh_arguments(parser)
    parser.add_argument("--execute", action="store_true",
                        help="also run the planned program against jax.jit, and eagerly under each allocator")
    add_arguments(parser)
    return parser


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The pool flags shared by `analyze` and `maxbatch`: each overrides the environment variable
    JAX reads (unset: as JAX would read the environment)."""
    group = parser.add_argument_group("pool (default: as JAX reads this environment)")
    group.add_argument("--steps", type=int, default=3, metavar="N",
                       help="training steps to run in the pool (default 3)")
    group.add_argument("--mem-fraction", type=float, default=None, metavar="F",
                       help="the pool's share of device memory (XLA_CLIENT_MEM_FRACTION; JAX's default 0.75)")
    group.add_argument("--preallocate", choices=("true", "false"), default=None,
                       help="take the pool at start (XLA_PYTHON_CLIENT_PREALLOCATE; default true)")
    group.add_argument("--allocator", choices=("bfc", "platform"), default=None,
                       help="XLA_PYTHON_CLIENT_ALLOCATOR: bfc (JAX's default) or platform")


def pool_device(args: argparse.Namespace, capacity: int) -> Any:
    """A simulated device of `capacity` set up from the environment and the pool flags."""
    from jaxmem.runtime.steps import make_device

    if args.steps < 1:
        raise PlanError(f"--steps must be 1 or more, got {args.steps}")
    preallocate = None if args.preallocate is None else args.preallocate == "true"
    return make_device(capacity, allocator=args.allocator, preallocate=preallocate, mem_fraction=args.mem_fraction)


def parse_donate(text: str, num_args: int) -> tuple[int, ...]:
    """`--donate 0,1` as a sorted tuple of valid positions.

    >>> parse_donate("1, 0", 3)
    (0, 1)

    Raises:
        PlanError: not integers, or a position `fn` does not have.
    """
    try:
        positions = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise PlanError(f"--donate takes argument positions such as 0,1, got {text!r}") from None
    bad = [p for p in positions if not 0 <= p < num_args]
    if bad:
        raise PlanError(f"--donate {text}: fn takes {num_args} positional argument(s), so {bad[0]} is out of range")
    return tuple(positions)


def parse_device(text: str) -> tuple[str, int]:
    """(name, capacity in bytes) for `--device`."""
    try:
        return text, parse_size(text)
    except ConfigError as err:
        raise PlanError(f"--device: {err}") from None


# -- data ------------------------------------------------------------------------------------

def live_bytes_by_step(plan: Any) -> list[int]:
    """Arena bytes live at each step, index 0 being "on entry" (step -1) and the last "on exit"
    (the compiler's one live-bytes profile, `stages.live_profile`)."""
    from jaxmem.compiler.stages import live_profile

    spans = ((buf.start, buf.end, buf.size) for buf in plan.buffers)
    return [int(x) for x in live_profile(spans, len(plan.schedule))]


def _argument_names(args: Sequence[Any]) -> list[str]:
    """Flat leaf names such as `args[0]['blocks'][1]['w_fc']`, in jaxpr invar order."""
    import jax

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


def peak_buffers(plan: Any, args: Sequence[Any], top: int) -> tuple[int, list[dict[str, Any]]]:
    """The peak step and the `top` largest buffers live there, arguments outside the arena included.

    Returns:
        `(peak_step, rows)` where peak_step is a schedule index (-1: on entry) and each row has
        size_bytes, shape, dtype, kind, category, label and source.
    """
    from jaxmem.reports.categories import argument_reasons, buffer_category, value_categories

    live = live_bytes_by_step(plan)
    peak_index = max(range(len(live)), key=live.__getitem__)
    peak_step = peak_index - 1
    names = _argument_names(args)
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


def gpu_peak_rows(ref: Any, plan: Any, args: Sequence[Any]) -> list[dict[str, Any]]:
    """XLA:GPU's largest buffers live at its peak, each matched to the jaxpr-level array it
    holds where that can be told: an argument by its position, else a planned buffer with the
    same dtype and shape (and the same source line when both have one)."""
    names = _argument_names(args)
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
              accelerator: Any = None) -> dict[str, Any]:
    """The analysis as one plain dict: what `--json` prints and what the tables render.

    Args:
        plan: a `jaxmem.compiler.plan_types.Plan`.
        args: the positional arguments the plan was made for (to name argument buffers).
        target: the TARGET string shown in the report.
        device: (name, capacity bytes) for the fit check.
        top: how many buffers live at the peak to list.
    """
    from jaxmem.xla.tpu import summary as tpu_summary

    name, capacity = device
    on_tpu = accelerator is not None and accelerator.is_tpu
    # JAX's TPU runtime preallocates nothing: a program may use the whole chip.
    usable = capacity if on_tpu else int(capacity * fraction)
    peak_step, rows = peak_buffers(plan, args, top)
    xla = plan.xla
    xla_total = xla.total_bytes if xla is not None else None
    return {
        "target": target,
        "peak_bytes": plan.peak_bytes,
        "arena_bytes": plan.arena_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "program_order_lower_bound_bytes": plan.program_order_lower_bound_bytes,
        "argument_bytes": plan.argument_bytes,
        "output_bytes": plan.output_bytes,
        "xla_total_bytes": xla_total,
        "xla": None if xla is None else {
            "argument_bytes": xla.argument_bytes, "output_bytes": xla.output_bytes, "temp_bytes": xla.temp_bytes,
            "alias_bytes": xla.alias_bytes, "generated_code_bytes": xla.generated_code_bytes,
            "scheduler": xla.scheduler, "total_bytes": xla_total, "library_fusions": xla.library_fusions,
            "library_hidden_bytes": xla.library_hidden_bytes,
        },
        "ratio_to_xla": (plan.peak_bytes / xla_total) if xla_total else None,
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
                   "usable_bytes": usable, "fits": plan.peak_bytes <= usable,
                   "platform": accelerator.platform if accelerator is not None else None,
                   "pool_rules": accelerator.pool_rules if accelerator is not None else "gpu_client"},
        "fits": plan.peak_bytes <= usable if pool is None else bool(pool.fits),
        "xla_gpu": None if gpu is None else gpu.summary(),
        "xla_gpu_peak_buffers": [] if gpu is None else gpu_peak_rows(gpu, plan, args),
        "xla_gpu_peak_live_bytes": None if gpu is None else gpu.peak_live_bytes,
        "xla_tpu": None if tpu is None else tpu_summary(tpu),
        "xla_tpu_peak_buffers": [] if tpu is None else gpu_peak_rows(tpu, plan, args),
        "xla_tpu_peak_live_bytes": None if tpu is None else tpu.peak_live_bytes,
        "pool": None if pool is None else {**pool.summary(), "judged_on": "xla_gpu" if gpu is not None else
                                           "xla_tpu" if tpu is not None else
                                           "predicted_xla_gpu" if predicted is not None else "xla_cpu"},
        "xla_note": note,
    }


# -- running ---------------------------------------------------------------------------------

@contextmanager
def progress_after(seconds: float, label: str) -> Iterator[None]:
    """A transient rich progress bar on stderr, shown only when the work lasts over `seconds` and
    stderr is a terminal (so pipes and `--json` consumers see nothing)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    progress = Progress(SpinnerColumn(), TextColumn(label), BarColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    progress.add_task(label, total=None)
    timer = threading.Timer(seconds, progress.start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        progress.stop()


def run_plan(fn: Callable[..., Any], args: Sequence[Any], donate: tuple[int, ...], xla: bool) -> Any:
    """Plan `fn(*args)`, with XLA's reference figures compiled in a second thread meanwhile.

    XLA's compile is C++ that releases the GIL, so running it beside the (Python) planner makes
    the whole analysis take about as long as the slower of the two instead of their sum.
    """
    from jaxmem.compiler.planner import plan as make_plan

    if not xla:
        return make_plan(fn, *args, donate_argnums=donate, xla=False)
    from jaxmem.xla.cpu import xla_reference

    box: dict[str, Any] = {}

    def compile_reference() -> None:
        try:
            box["ref"] = xla_reference(fn, args, donate_argnums=donate)
        except BaseException as err:  # handed to the main thread, which raises it
            box["err"] = err

    worker = threading.Thread(target=compile_reference, name="jaxmem-xla-reference", daemon=True)
    worker.start()
    try:
        result = make_plan(fn, *args, donate_argnums=donate, xla=False)
    finally:
        worker.join()
    if "err" in box:
        raise box["err"]
    return dataclasses.replace(result, xla=box["ref"])


def start_gpu_reference(target: str, device: str, donate: tuple[int, ...], top: int) -> tuple[threading.Thread, dict[str, Any]]:
    """Start XLA:GPU's deviceless compile (a subprocess) in a thread; join it and read `box`
    ("ref" or "err") after planning."""
    from jaxmem.xla.gpu import xla_gpu_reference

    return start_reference(lambda on_start: xla_gpu_reference(target, device=device, donate_argnums=donate,
                                                              top=top, on_start=on_start))


def start_tpu_reference(target: str, accelerator: Any, donate: tuple[int, ...], top: int) -> tuple[threading.Thread, dict[str, Any]]:
    """Start XLA:TPU's deviceless compile (a subprocess) in a thread, as `start_gpu_reference`."""
    from jaxmem.xla.tpu import xla_tpu_reference

    return start_reference(lambda on_start: xla_tpu_reference(target, accelerator, donate_argnums=donate,
                                                              top=top, on_start=on_start))


def start_reference(compile: Callable[[Callable[[Any], None]], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `compile(on_start)` (a deviceless compile in a child process) in a thread; `box`
    gets "proc" (the child, so that it can be killed), then "ref" or "err"."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["ref"] = compile(lambda proc: box.__setitem__("proc", proc))
        except BaseException as err:  # handed to the main thread
            box["err"] = err

    worker = threading.Thread(target=work, name="jaxmem-xla-gpu", daemon=True)
    worker.start()
    return worker, box


def stop_gpu_reference(worker: threading.Thread | None, box: dict[str, Any] | None) -> None:
    """Kill XLA:GPU's compile (planning failed: its answer is not needed) and wait for the thread."""
    if worker is None or box is None:
        return
    for _ in range(50):   # the child may not have started yet
        proc = box.get("proc")
        if proc is not None or not worker.is_alive():
            break
        worker.join(0.1)
    proc = box.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
    worker.join(10.0)


def cpu_step_program(fn: Callable[..., Any], args: Sequence[Any], donate: tuple[int, ...], temp_bytes: int) -> Any:
    """The pool's view of a step from XLA:CPU's figures (when XLA:GPU cannot run here): the
    argument and output leaves, donated arguments taken over by the first output of the same
    shape and dtype, and XLA:CPU's temp bytes as the one temp allocation."""
    import jax

    from jaxmem.compiler.jaxpr_adapter import aval_bytes
    from jaxmem.runtime.steps import Leaf, StepProgram, match_state

    def key(leaf: Any) -> str:
        return f"{leaf.dtype}{list(leaf.shape)}"

    def nbytes(leaf: Any) -> int:
        return aval_bytes(leaf)

    arguments, keys_in = [], []
    for position, arg in enumerate(args):
        for leaf in jax.tree.leaves(arg):
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                arguments.append(Leaf(nbytes(leaf), donated=position in donate))
                keys_in.append(key(leaf))
    outs = jax.tree.leaves(jax.eval_shape(fn, *args))
    free = {i for i, a in enumerate(arguments) if a.donated}
    outputs, keys_out = [], []
    for leaf in outs:
        alias = next((i for i in sorted(free) if keys_in[i] == key(leaf)), None)
        if alias is not None:
            free.discard(alias)
        outputs.append(Leaf(nbytes(leaf), aliases=alias))
        keys_out.append(key(leaf))
    return StepProgram(arguments, match_state(arguments, outputs, keys_in, keys_out), int(temp_bytes))


def has_abstract_args(args: Sequence[Any]) -> bool:
    """Whether any argument leaf is a `jax.ShapeDtypeStruct` (shape and dtype, no values)."""
    import jax

    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tuple(args)))


def start_cpu_schedulers(target: str, donate: tuple[int, ...], which: str) -> tuple[list[threading.Thread], dict[str, Any]]:
    """Compile TARGET with XLA:CPU's "dfs" and/or "bfs" scheduler, each in a fresh process (XLA
    reads its flags once per process), in threads beside the planner; `box` maps each scheduler
    to its `XlaReference` or to the error it raised."""
    from jaxmem.xla.cpu import xla_reference_in_subprocess

    box: dict[str, Any] = {}

    def work(name: str) -> None:
        try:
            box[name] = xla_reference_in_subprocess(target, donate_argnums=donate, scheduler=name)
        except BaseException as err:  # handed to the main thread
            box[name] = err

    names = ("dfs", "bfs") if which == "both" else (which,)
    workers = [threading.Thread(target=work, args=(n,), name=f"jaxmem-xla-{n}", daemon=True) for n in names]
    for w in workers:
        w.start()
    return workers, box


def better_schedule(box: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """The reference with the lower total among the schedulers compiled, and every total."""
    for ref in box.values():
        if isinstance(ref, BaseException):
            raise ref
    totals = {name: ref.total_bytes for name, ref in sorted(box.items())}
    best = min(sorted(box), key=lambda name: box[name].total_bytes)
    return box[best], totals


def _cpu_reference(fn: Callable[..., Any], args: Sequence[Any], donate: tuple[int, ...]) -> Any:
    from jaxmem.xla.cpu import xla_reference

    return xla_reference(fn, args, donate_argnums=donate)


def run_execute(fn: Callable[..., Any], args: Sequence[Any], plan: Any, donate: tuple[int, ...],
                capacity: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`--execute`: the executor's comparison with jax.jit and its eager runs per allocator."""
    try:
        from jaxmem.execution import verify
    except ImportError:
        raise PlanError("--execute needs jaxmem.execution.verify, which this build does not have") from None
    # Eager first: a donating jax.jit call may consume the arguments.
    eager = verify.eager_summaries(fn, args, capacity)
    execute = verify.compare_with_jit(fn, args, plan, donate)
    return execute, eager


# -- rendering -------------------------------------------------------------------------------

def _size(n: int | None) -> str:
    return "—" if n is None else format_size(n)


def short_label(label: str, narrow: bool = False) -> str:
    """An argument's pytree path as a table shows it: `['k']` keys as `.k`; when `narrow`, the
    last two keys only.

    >>> short_label("args[1][0].nu['params']['Dense_1']['kernel']")
    'args[1][0].nu.params.Dense_1.kernel'
    >>> short_label("args[1][0].nu['params']['Dense_1']['kernel']", narrow=True)
    '….Dense_1.kernel'
    """
    text = re.sub(r"\['([A-Za-z_][A-Za-z0-9_]*)'\]", r".\1", label)
    if narrow and len(text) > 20 and text.count(".") >= 2:
        text = "…." + ".".join(text.split(".")[-2:])
    return text


def short_source(source: str, narrow: bool = False) -> str:
    """A source line as people read it in a table: relative to the working directory when under
    it, from the package folder for installed libraries and jaxmem's examples, else the last two
    folders of its path; when `narrow`, the file's name and line only.

    >>> short_source("/nowhere/deep/project/models/x.py:3 (f)")
    '…/models/x.py:3 (f)'
    >>> short_source("/v/lib/python3.11/site-packages/flax/linen/linear.py:287 (__call__)")
    'flax/linen/linear.py:287 (__call__)'
    >>> short_source("/nowhere/deep/project/models/x.py:3 (f)", narrow=True)
    'x.py:3'
    """
    if narrow and source.startswith("/") and " (" in source:
        return os.path.basename(source.rsplit(" (", 1)[0])
    if not source.startswith("/"):
        return source
    cwd = os.getcwd().rstrip("/") + "/"
    if source.startswith(cwd):
        return source[len(cwd):]
    for marker, keep in (("/site-packages/", ""), ("/dist-packages/", ""), ("/jaxmem/examples/", "jaxmem/examples/")):
        if marker in source:
            return keep + source.split(marker, 1)[1]
    parts = source.split("/")
    return "…/" + "/".join(parts[-2:]) if len(parts) > 3 else source


def _shape(shape: Sequence[int], dtype: str) -> str:
    if not dtype:   # a loop or cond body's scratch: bytes, not an array
        return "—"
    return f"{dtype}[{','.join(str(d) for d in shape)}]"


def _trace_note(data: dict[str, Any]) -> str:
    trace = data.get("trace_seconds")
    return f" (+{trace:.2f} s tracing)" if isinstance(trace, (int, float)) else ""


def render(data: dict[str, Any], console: Any) -> None:
    """The analysis as rich tables on `console`."""
    from rich.table import Table
    from rich.text import Text

    peak, lower, xla_total = data["peak_bytes"], data["lower_bound_bytes"], data["xla_total_bytes"]
    from jaxmem.reports.escape import markup

    summary = Table(title=f"jaxmem analyze · {markup(data['target'])}", title_justify="left", show_header=False,
                    box=None, padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_column(style="dim")
    summary.add_row("jaxmem peak", Text(_size(peak), style="bold green"),
                    f"arguments {_size(data['argument_bytes'])} + arena {_size(data['arena_bytes'])}")
    if xla_total is not None:
        ratio = data["ratio_to_xla"]
        style = "green" if ratio is not None and ratio <= 1.0 else "red"
        summary.add_row("XLA total here", _size(xla_total),
                        Text(f"{ratio:.3f}x of XLA ({data['xla']['scheduler']} scheduler)" if ratio is not None
                             else f"XLA holds nothing ({data['xla']['scheduler']} scheduler)", style=style))
        totals = data.get("xla_cpu_schedulers")
        if totals and len(totals) > 1:
            summary.add_row("", "", "XLA:CPU's schedulers: " + ", ".join(f"{name} {_size(total)}" for name, total in
                                                                         totals.items()) + "; the lower is compared")
        elif data["xla"]["scheduler"] == "default":
            summary.add_row("", "", "XLA:CPU's memory-optimized scheduler may need less: --cpu-scheduler both "
                            "compares with both of its schedulers")
        if data["xla"]["library_hidden_bytes"]:
            summary.add_row("", "", f"XLA:CPU's YNNPACK fusions hold {_size(data['xla']['library_hidden_bytes'])} "
                            "of dot/conv results that its figure leaves out")
    gpu = data.get("xla_gpu")
    if gpu:
        ratio = peak / gpu["total_bytes"] if gpu["total_bytes"] else 0.0
        summary.add_row(f"XLA:GPU {gpu['target']}", Text(_size(gpu["total_bytes"]), style="bold"),
                        f"arguments {_size(gpu['argument_bytes'])} + outputs {_size(gpu['output_bytes'])} + temp "
                        f"{_size(gpu['temp_bytes'])} - aliased {_size(gpu['alias_bytes'])}; jaxmem {ratio:.3f}x of it; "
                        + ("cached" if gpu.get("cached") else f"compiled deviceless in {gpu['compile_seconds']:.1f} s"))
        if gpu.get("note"):
            summary.add_row("", "", Text(gpu["note"][:160], style="yellow"))
    tpu = data.get("xla_tpu")
    if tpu:
        render_tpu_row(tpu, peak, summary)
    predicted = data.get("predicted_xla")
    if predicted:
        against = f"; {predicted['total_bytes'] / gpu['total_bytes']:.3f}x of XLA:GPU's" if gpu and gpu["total_bytes"] else ""
        summary.add_row(f"predicted XLA:GPU {predicted['device']}", _size(predicted["total_bytes"]),
                        f"arguments {_size(predicted['argument_bytes'])} + outputs {_size(predicted['output_bytes'])} "
                        f"+ temp {_size(predicted['temp_bytes'])} - aliased {_size(predicted['alias_bytes'])}, "
                        f"jaxmem's model of XLA:GPU's fusion in {predicted['seconds']:.2f} s{against}")
    pool = data.get("pool")
    if pool:
        on = {"xla_gpu": "XLA:GPU", "xla_tpu": "XLA:TPU",
              "predicted_xla_gpu": "the predicted XLA:GPU"}.get(pool.get("judged_on"), "XLA:CPU")
        mode = ("TPU runtime: no preallocation, temporaries reserved, code resident" if pool.get("rules") == "tpu_runtime"
                else f"{pool['allocator']}, preallocate {str(pool['preallocate']).lower()}, "
                     f"fraction {pool['mem_fraction']:g}")
        if pool["fits"]:
            summary.add_row("pool", Text("fits", style="bold green"),
                            f"{pool['steps']} steps of {on}'s buffers: peak {_size(pool['peak_bytes'])} of limit "
                            f"{_size(pool['limit_bytes'])}, headroom {_size(pool['headroom_bytes'])} ({mode})")
        else:
            why = "fragmentation: the free bytes add up, no block is large enough" if pool["fragmentation"] else "out of memory"
            where = "the arguments alone" if pool["failed_step"] == 0 else f"step {pool['failed_step']} of {pool['steps']}"
            summary.add_row("pool", Text("does not fit", style="bold red"),
                            f"{where}: {pool['failed_allocation']} "
                            f"({_size(pool['failed_bytes'])}) under limit {_size(pool['limit_bytes'])}; {why} ({mode})")
    summary.add_row("lower bound", _size(lower),
                    f"gap {100 * data['gap_to_lower_bound']:.2f}% (program order: "
                    f"{_size(data['program_order_lower_bound_bytes'])})")
    summary.add_row("outputs", _size(data["output_bytes"]),
                    f"donated arguments: {', '.join(map(str, data['donated'])) or 'none'}")
    verdict = Text("valid", style="green") if data["valid"] else Text("INVALID", style="bold red")
    summary.add_row("plan", verdict,
                    f"{data['num_eqns']} equations, {data['num_buffers']} buffers, planned in "
                    f"{data['plan_seconds']:.2f} s{_trace_note(data)}; "
                    f"schedule {data['scheduler'] or '?'}, placement {data['placement'] or '?'}")
    dev = data["device"]
    fit = Text("fits", style="bold green") if dev["fits"] else Text("does not fit", style="bold red")
    if dev.get("pool_rules") == "tpu_runtime":
        held = (f"{dev['name']}: {_size(dev['capacity_bytes'])}, all of it a program's (JAX's TPU runtime "
                "preallocates nothing; XLA_PYTHON_CLIENT_* are the GPU client's)")
    else:
        held = (f"{dev['name']}: {_size(dev['capacity_bytes'])}, JAX preallocates "
                f"{int(100 * dev['preallocated_fraction'])}% = {_size(dev['usable_bytes'])}")
    summary.add_row("jaxmem's plan" if pool else "device", fit, held)
    unknown = data["unknown_primitives"]
    summary.add_row("unknown primitives", Text(str(len(unknown)), style="yellow" if unknown else ""),
                    ", ".join(unknown) + (" (planned conservatively)" if unknown else ""))
    console.print(summary)
    console.print()

    where = "on entry" if data["peak_step"] < 0 else f"step {data['peak_step']}"
    narrow = console.width < 120  # a piped report or a small terminal: one line a row
    from rich import box

    # Below 100 columns the borders and the row number are what no longer fit.
    tight = console.width < 100
    table = Table(title=f"Largest buffers live at the peak ({where})", title_justify="left",
                  box=box.SIMPLE_HEAD if tight else box.HEAVY_HEAD, padding=(0, 0 if tight else 1),
                  show_edge=not tight)
    if not tight:
        table.add_column("#", justify="right", style="dim", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("array", overflow="fold")
    table.add_column("category", no_wrap=True)
    table.add_column("made by", overflow="fold")
    # Source lines come from the user's frames; a model whose code has none gets no empty column.
    with_source = any(row["source"] for row in data["top_buffers"])
    if with_source:
        table.add_column("source line", overflow="fold")
    for i, row in enumerate(data["top_buffers"], 1):
        cells = [*([] if tight else [str(i)]), _size(row["size_bytes"]), _shape(row["shape"], row["dtype"]),
                 row["category"] or row["kind"], short_label(row["label"], narrow)]
        source = short_source(row["source"], narrow) if row["source"] else "—"
        table.add_row(*map(markup, cells), *([markup(source)] if with_source else []))
    console.print(table)
    if data.get("xla_gpu_peak_buffers"):
        render_gpu_peak(data, console)
    if data.get("xla_tpu_peak_buffers"):
        render_gpu_peak(data, console, platform="tpu")


def render_tpu_row(tpu: dict[str, Any], peak: int, summary: Any) -> None:
    """XLA:TPU's figures (or its refusal) as one row of the summary table."""
    from rich.text import Text

    from jaxmem.reports.escape import markup

    how = "cached" if tpu.get("cached") else f"compiled deviceless in {tpu['compile_seconds']:.1f} s"
    if tpu.get("oom"):
        summary.add_row(f"XLA:TPU {tpu['target']}", Text("does not fit", style="bold red"),
                        markup(f"{tpu['oom'][:200]} ({how})"))
        return
    ratio = peak / tpu["total_bytes"] if tpu["total_bytes"] else 0.0
    summary.add_row(f"XLA:TPU {tpu['target']}", Text(_size(tpu["total_bytes"]), style="bold"),
                    f"arguments {_size(tpu['argument_bytes'])} + outputs {_size(tpu['output_bytes'])} + temp "
                    f"{_size(tpu['temp_bytes'])} - aliased {_size(tpu['alias_bytes'])}; code "
                    f"{_size(tpu['generated_code_bytes'])} beside it; jaxmem {ratio:.3f}x of it; {how}")


def render_gpu_peak(data: dict[str, Any], console: Any, platform: str = "gpu") -> None:
    """XLA:GPU's (or XLA:TPU's) largest buffers live at its peak, as a rich table."""
    from rich.table import Table

    from jaxmem.reports.escape import markup

    console.print()
    live = data.get(f"xla_{platform}_peak_live_bytes")
    title = f"What XLA:{platform.upper()} holds at its peak on {data[f'xla_{platform}']['target']}"
    if live:
        title += f" ({_size(live)} live there)"
    narrow = console.width < 140
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right", style="dim", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("array", overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("jaxpr array", overflow="fold")
    table.add_column("XLA op", overflow="fold")
    table.add_column("source line", overflow="fold")
    for i, row in enumerate(data[f"xla_{platform}_peak_buffers"], 1):
        op = short_op(row["op_name"]) or row["hlo"]
        cells = [str(i), _size(row["size_bytes"]), _shape(row["shape"], row["dtype"]), row["kind"],
                 short_label(row["jaxpr_array"], narrow) or "—", "…" + op[-27:] if narrow and len(op) > 28 else op,
                 short_source(row["source"], narrow) if row["source"] else "—"]
        table.add_row(*map(markup, cells))
    console.print(table)


def short_op(op_name: str) -> str:
    """An HLO op_name without its leading `jit(fn)/`, as the table shows it.

    >>> short_op("jit(train_step)/jvp()/dot_general")
    'jvp()/dot_general'
    """
    if op_name.startswith("jit(") and "/" in op_name:
        return op_name.split("/", 1)[1]
    return op_name
    console.print(table)


def render_execute(execute: dict[str, Any], eager: list[dict[str, Any]], planned_peak: int, console: Any) -> None:
    """`--execute` results as rich tables; eager peaks are also shown against the planned peak."""
    from rich.table import Table

    console.print()
    run = Table(title="Planned execution against jax.jit", title_justify="left")
    for col in ("results", "max abs err", "rel err", "tolerance", "JAX op by op", "planned", "jax.jit"):
        run.add_column(col, justify="right")
    tol, noise = execute.get("tolerance"), execute.get("noise_rel")
    run.add_row("equal" if execute.get("ok") else "DIFFER", f"{execute.get('max_abs_err', 0.0):.3g}",
                f"{execute.get('max_rel_err', 0.0):.3g}", "exact" if tol is None else f"{tol:.3g}",
                "—" if noise is None else f"{noise:.3g}", f"{execute.get('seconds', 0.0):.3f} s",
                f"{execute.get('jax_jit_seconds', 0.0):.3f} s")
    console.print(run)
    if tol is not None:
        console.print(f"[dim]rel err: the worst output's largest error over its largest magnitude; tolerance: "
                      f"{execute.get('reduction', 1):,}-term sums in its dtype"
                      f"{'' if noise is None else ', or 4x JAX op by op against jax.jit'}[/dim]")
    console.print()
    table = Table(title="Eager (op by op) under each allocator", title_justify="left")
    for col in ("allocator", "peak in use", "vs planned", "pool", "largest free", "fragmentation", "allocs",
                "device allocs", "fits"):
        table.add_column(col, justify="right" if col != "allocator" else "left")
    for row in eager:
        frag = row.get("fragmentation_at_peak")
        in_use = row.get("peak_bytes_in_use")
        versus = f"{in_use / planned_peak:.2f}x" if isinstance(in_use, (int, float)) and planned_peak else "—"
        table.add_row(str(row.get("allocator", "?")), _size(in_use), versus,
                      _size(row.get("peak_pool_bytes")), _size(row.get("largest_free_block_bytes")),
                      "—" if frag is None else f"{100 * frag:.1f}%", str(row.get("num_allocs", "—")),
                      str(row.get("device_allocs", "—")), "yes" if row.get("fits") else "no")
    console.print(table)


def _guarded(work: Callable[[], Any], what: str) -> Any:
    """Run `work`; an error from the user's function (a shape error while tracing, say) becomes one
    line. JAXMEM_TRACEBACK=1 lets it through with its traceback, for debugging jaxmem itself."""
    try:
        return work()
    except (JaxmemError, KeyboardInterrupt):
        raise
    except Exception as err:
        if os.environ.get("JAXMEM_TRACEBACK"):
            raise
        message = " ".join(str(err).split())[:400]
        raise PlanError(f"{what}: {type(err).__name__}: {message} (JAXMEM_TRACEBACK=1 shows where)") from None


def _jsonable(obj: Any) -> Any:
    """Numpy scalars and tuples from the executor's dicts, as plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj


def gpu_pool(args: argparse.Namespace, capacity: int, gpu: Any, predicted: Any, plan: Any, fn: Callable[..., Any],
             fn_args: Sequence[Any], donate: tuple[int, ...], target: str) -> tuple[Any, float]:
    """The GPU client's pool verdict over N steps (on XLA:GPU's figures, else the predicted
    XLA:GPU figures, else XLA:CPU's; None when there are none) and the pool's share of the
    device; (None, JAX's default share) when the environment holds a setting jaxmem cannot model
    (said in one line)."""
    from jaxmem.runtime.steps import program_from_reference, simulate_steps

    try:
        dev = pool_device(args, capacity)
    except ConfigError as err:
        if any(v is not None for v in (args.mem_fraction, args.preallocate, args.allocator)):
            raise
        # The environment holds a setting jaxmem cannot model: the plan and XLA's figures stand,
        # the pool is not simulated, and the user is told in one line.
        print(f"jaxmem analyze: the pool is not simulated: {err}", file=sys.stderr)
        return None, PREALLOCATE_FRACTION
    if gpu is not None:
        return simulate_steps(program_from_reference(gpu), dev, args.steps), dev.mem_fraction
    if predicted is not None:
        # A GPU preset with no XLA:GPU compile here: the pool over the predicted XLA:GPU figures.
        return simulate_steps(program_from_reference(predicted), dev, args.steps), dev.mem_fraction
    if plan.xla is not None:
        program = _guarded(lambda: cpu_step_program(fn, fn_args, donate, plan.xla.temp_bytes), f"cannot plan {target}")
        return simulate_steps(program, dev, args.steps), dev.mem_fraction
    return None, dev.mem_fraction


def tpu_pool(args: argparse.Namespace, accelerator: Any, tpu: Any, plan: Any, fn: Callable[..., Any],
             fn_args: Sequence[Any], donate: tuple[int, ...], target: str) -> Any:
    """The TPU runtime's verdict over N steps (`runtime/tpu_pool.py`): on XLA:TPU's figures (its
    out-of-memory message, when its compile refused the program), else on XLA:CPU's."""
    from jaxmem.runtime.steps import program_from_reference
    from jaxmem.runtime.tpu_pool import check_tpu_flags, compile_refused, ignored_gpu_variables, simulate_tpu_steps

    check_tpu_flags(args.mem_fraction, args.preallocate, args.allocator, args.steps)
    ignored = ignored_gpu_variables()
    if ignored:
        print(f"jaxmem analyze: {', '.join(ignored)} set JAX's GPU client; JAX's TPU runtime does not read them "
              "(ignored for this TPU)", file=sys.stderr)
    if tpu is not None:
        if tpu.oom:
            return compile_refused(tpu, accelerator, args.steps)
        return simulate_tpu_steps(program_from_reference(tpu), accelerator.capacity_bytes, args.steps,
                                  code_bytes=tpu.generated_code_bytes, reserved_bytes=tpu.reserved_bytes)
    if plan.xla is not None:
        program = _guarded(lambda: cpu_step_program(fn, fn_args, donate, plan.xla.temp_bytes), f"cannot plan {target}")
        return simulate_tpu_steps(program, accelerator.capacity_bytes, args.steps)
    return None


def main(argv: list[str]) -> int:
    """`jaxmem analyze`: see the module docstring. Returns the exit code."""
    args = build_parser().parse_args(argv)
    from jaxmem.compiler.target import jit_donation, load_target

    if args.top < 0:
        raise PlanError(f"--top must be 0 or more, got {args.top}")
    device = parse_device(args.device)
    target = args.target or DEFAULT_TARGET
    fn, fn_args = load_target(target)
    donate = parse_donate(args.donate, len(fn_args)) or jit_donation(fn, fn_args)
    from jaxmem.cli import sharded

    if sharded.wanted(args, fn_args):
        # A mesh: per-device figures from a partitioned compile (jaxmem.xla.sharding).
        return sharded.run(args, target, device, donate, pool_device)
    if args.execute and has_abstract_args(fn_args):
        raise PlanError(f"--execute runs the program, and {target} returns jax.ShapeDtypeStruct arguments "
                        "(no values); plan and compile it without --execute")

    started = time.perf_counter()
    gpu, tpu, pool, note = None, None, None, None
    accelerator = find_accelerator(device[0])
    want_gpu = not args.no_xla and args.xla in ("auto", "gpu")
    want_tpu = not args.no_xla and args.xla in ("auto", "tpu") and accelerator is not None and accelerator.is_tpu
    if args.xla == "tpu" and not want_tpu and not args.no_xla:
        raise PlanError(f"--xla tpu needs a TPU preset ({', '.join(tpu_presets())}), not {device[0]!r}")
    worker = box = None
    if want_gpu:
        from jaxmem.xla.gpu import GpuUnavailable, spec_for, unavailable_reason

        reason = unavailable_reason()
        if spec_for(device[0]) is None:
            if args.xla == "gpu":
                raise PlanError(f"--xla gpu needs a GPU preset with an XLA target description, not {device[0]!r}")
            want_gpu = False
        elif reason:
            note = f"XLA:GPU is not available here ({reason}); comparing with XLA:CPU"
            want_gpu = False
        else:
            worker, box = start_gpu_reference(target, device[0].strip().lower(), donate, args.top)
    if want_tpu:
        from jaxmem.xla.tpu import unavailable_reason as tpu_unavailable

        reason = tpu_unavailable()
        if reason and args.xla == "tpu":
            raise PlanError(f"--xla tpu: XLA:TPU is not available here: {reason}")
        if reason:
            note = f"XLA:TPU is not available here ({reason}); comparing with XLA:CPU"
            want_tpu = False
        else:
            worker, box = start_tpu_reference(target, accelerator, donate, args.top)
    cpu_reference = not args.no_xla and (args.xla not in ("gpu", "tpu") or not (want_gpu or want_tpu))
    schedulers, scheduled = [], {}
    if cpu_reference and args.cpu_scheduler != "default":
        schedulers, scheduled = start_cpu_schedulers(target, donate, args.cpu_scheduler)
    label = (f"planning · compiling for XLA:GPU ({device[0]})" if want_gpu else
             f"planning · compiling for XLA:TPU ({device[0]})" if want_tpu else "planning")
    with progress_after(1.0, label):
        try:
            plan = _guarded(lambda: run_plan(fn, fn_args, donate, xla=cpu_reference and not schedulers),
                            f"cannot plan {target}")
        except BaseException:
            stop_gpu_reference(worker, box)
            raise
        if worker is not None:
            worker.join()
        for w in schedulers:
            w.join()
    predicted = None
    from jaxmem.xla.gpu import spec_for as _gpu_spec

    if _gpu_spec(device[0].strip().lower()) is not None:
        # A GPU preset: jaxmem's plan with XLA:GPU's fusion rules, and XLA:GPU's figure predicted.
        from jaxmem.xla.gpu_model import plan_on_gpu, predict_plan

        plan = _guarded(lambda: plan_on_gpu(plan), f"cannot plan {target}")
        predicted = _guarded(lambda: predict_plan(plan, device[0].strip().lower()), f"cannot plan {target}")
    cpu_totals = None
    if schedulers:
        best, cpu_totals = better_schedule(scheduled)
        plan = dataclasses.replace(plan, xla=best)
    if box is not None:
        from jaxmem.xla.gpu import GpuUnavailable
        from jaxmem.xla.tpu import TpuUnavailable

        if "err" in box:
            err = box["err"]
            if isinstance(err, (GpuUnavailable, TpuUnavailable)):
                which = "XLA:TPU" if want_tpu else "XLA:GPU"
                note = f"{which} is not available here ({err}); comparing with XLA:CPU"
                if plan.xla is None:
                    with progress_after(1.0, "compiling with XLA:CPU"):
                        plan = dataclasses.replace(plan, xla=_guarded(lambda: _cpu_reference(fn, fn_args, donate),
                                                                      f"cannot compile {target}"))
            else:
                raise err
        elif want_tpu:
            tpu = box["ref"]
        else:
            gpu = box["ref"]
    if note:
        print(f"jaxmem analyze: {note}", file=sys.stderr)
    if accelerator is not None and accelerator.is_tpu:
        pool, fraction = tpu_pool(args, accelerator, tpu, plan, fn, fn_args, donate, target), 1.0
    else:
        pool, fraction = gpu_pool(args, device[1], gpu, predicted, plan, fn, fn_args, donate, target)
    data = summarize(plan, fn_args, target=target if args.target else f"{DEFAULT_TARGET} (built-in)",
                     device=device, top=args.top, gpu=gpu, pool=pool,
                     fraction=fraction, note=note,
                     predicted=predicted, tpu=tpu, accelerator=accelerator)
    data["predicted_xla_bytes"] = None if predicted is None else predicted.total_bytes
    data["predicted_xla"] = None if predicted is None else predicted.summary()
    data["xla_cpu_schedulers"] = cpu_totals
    data["total_seconds"] = time.perf_counter() - started

    execute = eager = None
    if args.execute:
        with progress_after(1.0, "executing"):
            execute, eager = _guarded(lambda: run_execute(fn, fn_args, plan, donate, device[1]),
                                      f"cannot execute {target}")
        data["execute"], data["eager"] = _jsonable(execute), _jsonable(eager)

    if args.json:
        print(json.dumps(data, indent=2))
    else:
        console = report_console()
        render(data, console)
        if execute is not None:
            render_execute(data["execute"], data["eager"], data["peak_bytes"], console)
    from jaxmem.reports.cli import write_plan_reports

    write_plan_reports(args, plan, gpu=data if gpu is not None or tpu is not None or pool is not None else None)
    if not plan.valid:
        print("jaxmem analyze: the checker found the plan invalid", file=sys.stderr)
        return 1
    return 0
