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
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jaxmem.cli import OneLineParser, analyze_loop, report_console, sharded
from jaxmem.errors import ConfigError, JaxmemError, PlanError
from jaxmem.accelerators import find as find_accelerator, tpu_presets
from jaxmem.reports.analysis import PREALLOCATE_FRACTION, AnalysisReport, summarize
from jaxmem.units import PRESETS, parse_size

DEFAULT_TARGET = "jaxmem.examples.gpt:default_example"
DEFAULT_DEVICE = "h100-80gb"
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
    analyze_loop.add_arguments(parser)
    sharded.add_arguments(parser)
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


# -- the pipeline ----------------------------------------------------------------------------

@dataclass
class Analysis:
    """One `jaxmem analyze` run, filled in stage by stage (`main` wires the stages in order)."""

    args: argparse.Namespace
    target: str                        # TARGET, or the built-in default
    fn: Callable[..., Any]
    fn_args: Sequence[Any]
    donate: tuple[int, ...]
    device: tuple[str, int]            # --device: (name, capacity in bytes)
    accelerator: Any                   # the preset's row; None for a bare size
    started: float = 0.0
    # start_references: which XLA to compare with, and the compiles running beside the planner
    want_gpu: bool = False
    want_tpu: bool = False
    cpu_reference: bool = False        # XLA:CPU's figures (here, or per scheduler in subprocesses)
    worker: threading.Thread | None = None   # XLA:GPU's or XLA:TPU's deviceless compile ...
    box: dict[str, Any] | None = None        # ... and what it hands back ("proc", then "ref" or "err")
    schedulers: list[threading.Thread] = field(default_factory=list)
    scheduled: dict[str, Any] = field(default_factory=dict)
    note: str | None = None            # why a device's XLA is not compared with
    # plan, plan_for_gpu, collect_references
    plan: Any = None
    predicted: Any = None              # jaxmem's prediction of XLA:GPU's figures (a GPU preset)
    cpu_totals: dict[str, int] | None = None
    gpu: Any = None
    tpu: Any = None
    # simulate_pool
    pool: Any = None
    fraction: float = PREALLOCATE_FRACTION
    loop: list[dict[str, Any]] | None = None   # --with: every program of the loop, TARGET first

    @property
    def preset(self) -> str:
        """--device as the XLA:GPU tables name it (lower case)."""
        return self.device[0].strip().lower()

    def guarded(self, work: Callable[[], Any], what: str = "plan") -> Any:
        """`_guarded(work)`, its error naming this run's target."""
        return _guarded(work, f"cannot {what} {self.target}")


def main(argv: list[str]) -> int:
    """`jaxmem analyze`: see the module docstring. Returns the exit code."""
    from jaxmem.reports.cli import check_paths

    args = build_parser().parse_args(argv)
    check_paths(args)   # `--png t.xyz` is refused before the target is loaded
    run = load(args)
    if sharded.wanted(args, run.fn_args):
        # A mesh: per-device figures from a partitioned compile (jaxmem.xla.sharding).
        return sharded.run(args, run.target, run.device, run.donate, pool_device)
    if args.execute and has_abstract_args(run.fn_args):
        raise PlanError(f"--execute runs the program, and {run.target} returns jax.ShapeDtypeStruct arguments "
                        "(no values); plan and compile it without --execute")
    run.started = time.perf_counter()
    start_references(run)
    plan_beside_references(run)
    plan_for_gpu(run)
    collect_references(run)
    simulate_pool(run)
    report = summarize_run(run)
    if args.execute:
        execute(run, report)
    return output(args, report)


def load(args: argparse.Namespace) -> Analysis:
    """Stage 1: the flags checked, the target loaded, its donation and the device resolved."""
    from jaxmem.compiler.target import jit_donation, load_target

    if args.top < 0:
        raise PlanError(f"--top must be 0 or more, got {args.top}")
    device = parse_device(args.device)
    target = args.target or DEFAULT_TARGET
    fn, fn_args = load_target(target)
    donate = parse_donate(args.donate, len(fn_args)) or jit_donation(fn, fn_args)
    return Analysis(args, target, fn, fn_args, donate, device, find_accelerator(device[0]))


def start_references(run: Analysis) -> None:
    """Stage 2: decide which XLA to compare with and start its compiles, which run beside the
    planner: XLA:GPU's or XLA:TPU's deviceless compile, XLA:CPU's schedulers in subprocesses."""
    args, accelerator = run.args, run.accelerator
    run.want_gpu = not args.no_xla and args.xla in ("auto", "gpu")
    run.want_tpu = (not args.no_xla and args.xla in ("auto", "tpu") and accelerator is not None
                    and accelerator.is_tpu)
    if args.xla == "tpu" and not run.want_tpu and not args.no_xla:
        raise PlanError(f"--xla tpu needs a TPU preset ({', '.join(tpu_presets())}), not {run.device[0]!r}")
    if run.want_gpu:
        start_xla_gpu(run)
    if run.want_tpu:
        start_xla_tpu(run)
    run.cpu_reference = not args.no_xla and (args.xla not in ("gpu", "tpu") or not (run.want_gpu or run.want_tpu))
    if run.cpu_reference and args.cpu_scheduler != "default":
        run.schedulers, run.scheduled = start_cpu_schedulers(run.target, run.donate, args.cpu_scheduler)


def _start_or_note(run: Analysis, compiler: str, reason: str | None, start: Callable[[], Any]) -> bool:
    """Start `compiler`'s reference (`start()`: its worker and result box), or, where `reason`
    says it cannot run here, leave a note that XLA:CPU is the reference. Whether it started."""
    if reason:
        run.note = f"{compiler} is not available here ({reason}); comparing with XLA:CPU"
        return False
    run.worker, run.box = start()
    return True


def start_xla_gpu(run: Analysis) -> None:
    """XLA:GPU's deviceless compile for a GPU preset; a note (or, for `--xla gpu`, an error)
    where it cannot run."""
    from jaxmem.xla.gpu.compile import spec_for, unavailable_reason

    reason = unavailable_reason()
    if spec_for(run.device[0]) is None:
        if run.args.xla == "gpu":
            raise PlanError(f"--xla gpu needs a GPU preset with an XLA target description, not {run.device[0]!r}")
        run.want_gpu = False
    else:
        run.want_gpu = _start_or_note(run, "XLA:GPU", reason, lambda: start_gpu_reference(
            run.target, run.preset, run.donate, run.args.top))


def start_xla_tpu(run: Analysis) -> None:
    """XLA:TPU's deviceless compile (libtpu) for a TPU preset; a note (or, for `--xla tpu`, an
    error) where it cannot run."""
    from jaxmem.xla.tpu.compile import unavailable_reason

    reason = unavailable_reason()
    if reason and run.args.xla == "tpu":
        raise PlanError(f"--xla tpu: XLA:TPU is not available here: {reason}")
    run.want_tpu = _start_or_note(run, "XLA:TPU", reason, lambda: start_tpu_reference(
        run.target, run.accelerator, run.donate, run.args.top))


def plan_beside_references(run: Analysis) -> None:
    """Stage 3: jaxmem's plan (with XLA:CPU's figures compiled beside it, where wanted), then
    the references started in stage 2 joined."""
    from jaxmem.reports.terminal import busy

    label = (f"planning · compiling for XLA:GPU ({run.device[0]})" if run.want_gpu else
             f"planning · compiling for XLA:TPU ({run.device[0]})" if run.want_tpu else "planning")
    with busy(label):
        xla = run.cpu_reference and not run.schedulers
        try:
            run.plan = run.guarded(lambda: run_plan(run.fn, run.fn_args, run.donate, xla=xla))
        except BaseException:
            stop_gpu_reference(run.worker, run.box)
            raise
        if run.worker is not None:
            run.worker.join()
        for worker in run.schedulers:
            worker.join()


def plan_for_gpu(run: Analysis) -> None:
    """Stage 4, for a GPU preset: jaxmem's plan with XLA:GPU's fusion rules, and XLA:GPU's
    figure predicted."""
    from jaxmem.xla.gpu.compile import spec_for

    if spec_for(run.preset) is None:
        return
    from jaxmem.xla.gpu.model.predict import plan_on_gpu, predict_plan

    run.plan = run.guarded(lambda: plan_on_gpu(run.plan))
    run.predicted = run.guarded(lambda: predict_plan(run.plan, run.preset))


def collect_references(run: Analysis) -> None:
    """Stage 5: XLA's figures into the run: the better of XLA:CPU's schedulers, XLA:GPU's or
    XLA:TPU's (or, where that compile could not run, XLA:CPU's in its place, with a note)."""
    if run.schedulers:
        best, run.cpu_totals = better_schedule(run.scheduled)
        run.plan = dataclasses.replace(run.plan, xla=best)
    if run.box is not None:
        take_device_reference(run)
    if run.note:
        print(f"jaxmem analyze: {run.note}", file=sys.stderr)


def take_device_reference(run: Analysis) -> None:
    """What XLA:GPU's or XLA:TPU's compile handed back: its reference, or its error (raised,
    unless the compiler is unavailable here: then a note, and XLA:CPU's figures)."""
    from jaxmem.reports.terminal import busy
    from jaxmem.xla.gpu.compile import GpuUnavailable
    from jaxmem.xla.tpu.compile import TpuUnavailable

    assert run.box is not None
    if "err" not in run.box:
        if run.want_tpu:
            run.tpu = run.box["ref"]
        else:
            run.gpu = run.box["ref"]
        return
    err = run.box["err"]
    if not isinstance(err, (GpuUnavailable, TpuUnavailable)):
        raise err
    which = "XLA:TPU" if run.want_tpu else "XLA:GPU"
    run.note = f"{which} is not available here ({err}); comparing with XLA:CPU"
    if run.plan.xla is None:
        with busy("compiling with XLA:CPU"):
            cpu = run.guarded(lambda: _cpu_reference(run.fn, run.fn_args, run.donate), "compile")
        run.plan = dataclasses.replace(run.plan, xla=cpu)


def simulate_pool(run: Analysis) -> None:
    """Stage 6: N training steps in the device's memory, under the GPU client's pool or the TPU
    runtime's rules."""
    if run.accelerator is not None and run.accelerator.is_tpu:
        run.pool, run.fraction = tpu_pool(run), 1.0
    else:
        run.pool, run.fraction = gpu_pool(run)
    if run.args.with_targets:
        if run.tpu is None and run.gpu is None:
            raise PlanError("--with needs the device's XLA figures (a GPU or TPU preset, with its compiler here)")
        device = None if run.tpu is not None else pool_device(run.args, run.device[1])
        run.pool = analyze_loop.loop_pool(run, device) or run.pool


def gpu_pool(run: Analysis) -> tuple[Any, float]:
    """The GPU client's pool verdict over N steps (on XLA:GPU's figures, else the predicted
    XLA:GPU figures, else XLA:CPU's; None when there are none) and the pool's share of the
    device; (None, JAX's default share) when the environment holds a setting jaxmem cannot model
    (said in one line)."""
    from jaxmem.runtime.steps import program_from_reference, simulate_steps

    args = run.args
    try:
        dev = pool_device(args, run.device[1])
    except ConfigError as err:
        if any(v is not None for v in (args.mem_fraction, args.preallocate, args.allocator)):
            raise
        # The environment holds a setting jaxmem cannot model: the plan and XLA's figures stand,
        # the pool is not simulated, and the user is told in one line.
        print(f"jaxmem analyze: the pool is not simulated: {err}", file=sys.stderr)
        return None, PREALLOCATE_FRACTION
    if run.gpu is not None:
        return simulate_steps(program_from_reference(run.gpu), dev, args.steps), dev.mem_fraction
    if run.predicted is not None:
        # A GPU preset with no XLA:GPU compile here: the pool over the predicted XLA:GPU figures.
        return simulate_steps(program_from_reference(run.predicted), dev, args.steps), dev.mem_fraction
    if run.plan.xla is not None:
        return simulate_steps(cpu_program(run), dev, args.steps), dev.mem_fraction
    return None, dev.mem_fraction


def tpu_pool(run: Analysis) -> Any:
    """The TPU runtime's verdict over N steps (`runtime/tpu_pool.py`): on XLA:TPU's figures (its
    out-of-memory message, when its compile refused the program), else on XLA:CPU's."""
    from jaxmem.runtime.steps import program_from_reference
    from jaxmem.runtime.tpu_pool import check_tpu_flags, compile_refused, ignored_gpu_variables, simulate_tpu_steps

    args, accelerator, tpu = run.args, run.accelerator, run.tpu
    check_tpu_flags(args.mem_fraction, args.preallocate, args.allocator, args.steps)
    ignored = ignored_gpu_variables()
    if ignored:
        print(f"jaxmem analyze: {', '.join(ignored)} set JAX's GPU client; JAX's TPU runtime does not read them "
              "(ignored for this TPU)", file=sys.stderr)
    if tpu is not None:
        if tpu.oom:
            return compile_refused(tpu, accelerator, args.steps)
        return simulate_tpu_steps(program_from_reference(tpu), accelerator.capacity_bytes, args.steps,
                                  code_bytes=tpu.generated_code_bytes, reserved_bytes=tpu.reserved_bytes,
                                  factory=tpu.factory)
    if run.plan.xla is not None:
        return simulate_tpu_steps(cpu_program(run), accelerator.capacity_bytes, args.steps)
    return None


def cpu_program(run: Analysis) -> Any:
    """The pool's view of a step from XLA:CPU's figures (`cpu_step_program`)."""
    return run.guarded(lambda: cpu_step_program(run.fn, run.fn_args, run.donate, run.plan.xla.temp_bytes))


def summarize_run(run: Analysis) -> AnalysisReport:
    """Stage 7: the report every view reads (`reports/analysis.py`)."""
    shown = run.target if run.args.target else f"{DEFAULT_TARGET} (built-in)"
    data = summarize(run.plan, run.fn_args, target=shown, device=run.device, top=run.args.top, gpu=run.gpu,
                     pool=run.pool, fraction=run.fraction, note=run.note, predicted=run.predicted, tpu=run.tpu,
                     accelerator=run.accelerator, cpu_totals=run.cpu_totals)
    data["loop"] = run.loop
    data["total_seconds"] = time.perf_counter() - run.started
    return AnalysisReport(data, run.plan)


def execute(run: Analysis, report: AnalysisReport) -> None:
    """Stage 8, `--execute`: the planned program against jax.jit, and eagerly under each allocator."""
    from jaxmem.reports.terminal import busy

    with busy("executing"):
        result, eager = run.guarded(lambda: run_execute(run.fn, run.fn_args, run.plan, run.donate, run.device[1]),
                                    "execute")
    report.add_execution(result, eager)


def output(args: argparse.Namespace, report: AnalysisReport) -> int:
    """Stage 9: the report as JSON or tables, and as the file reports asked for; the exit code."""
    from jaxmem.reports.analysis_tables import render_report
    from jaxmem.reports.cli import write_plan_reports

    if args.json:
        print(report.json())
    else:
        render_report(report, report_console())
    write_plan_reports(args, report.plan, gpu=report.data if report.has_device_reference else None)
    if not report.plan.valid:
        print("jaxmem analyze: the checker found the plan invalid", file=sys.stderr)
        return 1
    return 0


# -- XLA's references beside the planner -----------------------------------------------------

def run_plan(fn: Callable[..., Any], args: Sequence[Any], donate: tuple[int, ...], xla: bool) -> Any:
    """Plan `fn(*args)`, with XLA's reference figures compiled in a second thread meanwhile.

    XLA's compile is C++ that releases the GIL, so running it beside the (Python) planner makes
    the whole analysis take about as long as the slower of the two instead of their sum.
    """
    from jaxmem.compiler.planner import plan as make_plan

    if not xla:
        return make_plan(fn, *args, donate_argnums=donate, xla=False)
    from jaxmem.xla.cpu.compile import xla_reference

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
    from jaxmem.xla.gpu.compile import xla_gpu_reference

    return start_reference(lambda on_start: xla_gpu_reference(target, device=device, donate_argnums=donate,
                                                              top=top, on_start=on_start))


def start_tpu_reference(target: str, accelerator: Any, donate: tuple[int, ...], top: int) -> tuple[threading.Thread, dict[str, Any]]:
    """Start XLA:TPU's deviceless compile (a subprocess) in a thread, as `start_gpu_reference`."""
    from jaxmem.xla.tpu.compile import xla_tpu_reference

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
    from jaxmem.xla.cpu.compile import xla_reference_in_subprocess

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
    from jaxmem.xla.cpu.compile import xla_reference

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
