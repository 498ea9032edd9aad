"""One analysis of a program on a device, stage by stage: the one implementation `jaxmem.analyze`
and `jaxmem analyze TARGET` share.

`start_references` (XLA:GPU's or XLA:TPU's deviceless compile of the program lowered here, in a
child; XLA:CPU's schedulers) → `plan_beside_references` (jaxmem's plan of the jaxpr) →
`plan_for_gpu` (XLA:GPU's fusion rules, the predicted figure) → `collect_references` →
`simulate_pool` (the GPU client's pool or the TPU runtime's rules over N steps) →
`summarize_run` (`reports/analysis.AnalysisReport`).

    run = Run(Options(device="tpu-v5e-16gb"), prepare(step, (state, batch)), "step")
    report = analyze_run(run)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jaxmem.accelerators import find as find_accelerator, tpu_presets
from jaxmem.api.program import Program
from jaxmem.errors import ConfigError, JaxmemError, PlanError
from jaxmem.reports.analysis import PREALLOCATE_FRACTION, AnalysisReport, summarize
from jaxmem.units import parse_size

TOP_BUFFERS = 10


@dataclass
class Options:
    """What an analysis is asked for; the command line's flags carry the same names (`jaxmem
    analyze` hands its parsed flags in their place)."""

    device: str = "h100-80gb"
    steps: int = 3
    top: int = TOP_BUFFERS
    xla: str = "auto"               # auto, gpu, tpu or cpu
    no_xla: bool = False
    cpu_scheduler: str = "default"  # XLA:CPU's scheduler (`jaxmem analyze --cpu-scheduler`)
    mem_fraction: float | None = None
    preallocate: str | None = None  # "true", "false" or None (the environment's)
    allocator: str | None = None
    with_targets: list[str] = field(default_factory=list)
    quiet: bool = False
    costs: Any = "auto"             # what a framework adds, and the changes that remove it


def parse_device(text: str) -> tuple[str, int]:
    """(name, capacity in bytes) of a device: a preset or a size such as 24GiB."""
    try:
        return text, parse_size(text)
    except ConfigError as err:
        raise PlanError(f"device: {err}") from None


def pool_device(options: Any, capacity: int) -> Any:
    """A simulated device of `capacity` set up from the environment and the pool options."""
    from jaxmem.runtime.steps import make_device

    if options.steps < 1:
        raise PlanError(f"steps must be 1 or more, got {options.steps}")
    preallocate = None if options.preallocate is None else options.preallocate == "true"
    return make_device(capacity, allocator=options.allocator, preallocate=preallocate,
                       mem_fraction=options.mem_fraction)


@dataclass
class Run:
    """One analysis, filled in stage by stage."""

    args: Any                          # `Options` (or the CLI's parsed flags)
    program: Program
    target: str                        # what the report names: a TARGET, or the function's name
    device: tuple[str, int] = ("", 0)
    accelerator: Any = None            # the preset's row; None for a bare size
    cpu_target: str | None = None      # a TARGET a child can load (XLA:CPU's schedulers)
    factory_texts: Sequence[str] = ()  # the programs the factory ran (a TPU keeps their code)
    say: Callable[[str], None] = print
    busy: Callable[[str], Any] | None = None
    started: float = 0.0
    want_gpu: bool = False
    want_tpu: bool = False
    cpu_reference: bool = False
    worker: threading.Thread | None = None
    box: dict[str, Any] | None = None
    schedulers: list[threading.Thread] = field(default_factory=list)
    scheduled: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    plan: Any = None
    predicted: Any = None
    cpu_totals: dict[str, int] | None = None
    gpu: Any = None
    tpu: Any = None
    pool: Any = None
    fraction: float = PREALLOCATE_FRACTION
    loop: list[dict[str, Any]] | None = None
    device_reason: str | None = None   # why this device, where the caller named none
    costs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.device[0]:
            self.device = parse_device(self.args.device)
            self.accelerator = find_accelerator(self.device[0])

    @property
    def preset(self) -> str:
        """The device as the XLA:GPU tables name it (lower case)."""
        return self.device[0].strip().lower()

    @property
    def fn_args(self) -> tuple[Any, ...]:
        """The program's arguments as the reports name them."""
        return self.program.args

    @property
    def has_jaxpr(self) -> bool:
        return self.program.traced is not None

    def guarded(self, work: Callable[[], Any], what: str = "plan") -> Any:
        """`guarded(work)`, its error naming this run's target."""
        return guarded(work, f"cannot {what} {self.target}")

    def spinner(self, label: str) -> Any:
        from contextlib import nullcontext

        return self.busy(label) if self.busy is not None else nullcontext()


def analyze_run(run: Run, loop: Callable[[Run, Any], Any] | None = None) -> AnalysisReport:
    """Every stage in order; `loop`, where given, is the pool verdict of a loop of programs
    (`jaxmem analyze --with`)."""
    run.started = time.perf_counter()
    start_references(run)
    plan_beside_references(run)
    plan_for_gpu(run)
    collect_references(run)
    simulate_pool(run, loop)
    weigh_framework_costs(run)
    return summarize_run(run)


def start_references(run: Run) -> None:
    """Decide which XLA to compare with and start its compiles, which run beside the planner:
    XLA:GPU's or XLA:TPU's deviceless compile, XLA:CPU's schedulers in subprocesses."""
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
        if run.cpu_target is None:
            raise PlanError("XLA:CPU's dfs and bfs schedulers compile a TARGET in a fresh process: "
                            "give `jaxmem analyze TARGET --cpu-scheduler`")
        run.schedulers, run.scheduled = start_cpu_schedulers(run.cpu_target, run.program.donated_positions,
                                                             args.cpu_scheduler)


def _start_or_note(run: Run, compiler: str, reason: str | None, start: Callable[[], Any]) -> bool:
    """Start `compiler`'s reference (`start()`: its worker and result box), or, where `reason`
    says it cannot run here, leave a note that XLA:CPU is the reference. Whether it started."""
    if reason:
        run.note = f"{compiler} is not available here ({reason}); comparing with XLA:CPU"
        return False
    run.worker, run.box = start()
    return True


def start_xla_gpu(run: Run) -> None:
    """XLA:GPU's deviceless compile for a GPU preset; a note (or, for `--xla gpu`, an error)
    where it cannot run."""
    from jaxmem.xla.gpu.compile import spec_for, unavailable_reason

    reason = unavailable_reason()
    if spec_for(run.device[0]) is None:
        if run.args.xla == "gpu":
            raise PlanError(f"--xla gpu needs a GPU preset with an XLA target description, not {run.device[0]!r}")
        run.want_gpu = False
    else:
        run.want_gpu = _start_or_note(run, "XLA:GPU", reason, lambda: start_device_reference(run, "cuda"))


def start_xla_tpu(run: Run) -> None:
    """XLA:TPU's deviceless compile (libtpu) for a TPU preset; a note (or, for `--xla tpu`, an
    error) where it cannot run."""
    from jaxmem.xla.tpu.compile import unavailable_reason

    reason = unavailable_reason()
    if reason and run.args.xla == "tpu":
        raise PlanError(f"--xla tpu: XLA:TPU is not available here: {reason}")
    run.want_tpu = _start_or_note(run, "XLA:TPU", reason, lambda: start_device_reference(run, "tpu"))


def start_device_reference(run: Run, platform: str) -> tuple[threading.Thread, dict[str, Any]]:
    """The program lowered here for `platform`, and its deviceless compile started in a child
    (`xla.lowered`), in a thread; join it and read `box` ("ref" or "err") after planning."""
    from jaxmem.xla.lowered import from_lowered, lowered_reference

    lowered = run.guarded(lambda: run.program.lower_for(platform), "lower")
    texts = run.factory_texts if platform == "tpu" else ()
    program = from_lowered(lowered, platform, texts)
    accelerator = run.accelerator
    return start_reference(lambda on_start: lowered_reference(program, accelerator, top=run.args.top,
                                                              on_start=on_start))


def start_reference(compile: Callable[[Callable[[Any], None]], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `compile(on_start)` (a deviceless compile in a child process) in a thread; `box`
    gets "proc" (the child, so that it can be killed), then "ref" or "err"."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["ref"] = compile(lambda proc: box.__setitem__("proc", proc))
        except BaseException as err:  # handed to the main thread
            box["err"] = err

    worker = threading.Thread(target=work, name="jaxmem-xla-device", daemon=True)
    worker.start()
    return worker, box


def stop_reference(worker: threading.Thread | None, box: dict[str, Any] | None) -> None:
    """Kill the device's compile (planning failed: its answer is not needed) and wait for the thread."""
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


def plan_beside_references(run: Run) -> None:
    """jaxmem's plan (with XLA:CPU's figures compiled beside it, where wanted), then the
    references started before joined. A `Lowered` has no jaxpr: no plan."""
    label = (f"planning · compiling for XLA:GPU ({run.device[0]})" if run.want_gpu else
             f"planning · compiling for XLA:TPU ({run.device[0]})" if run.want_tpu else "planning")
    if not run.has_jaxpr:
        label = label.replace("planning · ", "").replace("planning", "compiling with XLA:CPU")
    with run.spinner(label):
        xla = run.cpu_reference and not run.schedulers
        try:
            run.plan = run.guarded(lambda: run_plan(run.program, xla=xla))
        except BaseException:
            stop_reference(run.worker, run.box)
            raise
        if run.worker is not None:
            run.worker.join()
        for worker in run.schedulers:
            worker.join()


def run_plan(program: Program, xla: bool) -> Any:
    """jaxmem's plan of the program (None for a `Lowered`), with XLA:CPU's figures compiled in a
    second thread meanwhile (`xla`); a `Lowered`'s XLA:CPU figures stand in a `PlanlessRun`.

    XLA's compile is C++ that releases the GIL, so running it beside the (Python) planner makes
    the whole analysis take about as long as the slower of the two instead of their sum.
    """
    from jaxmem.compiler.planner import plan_jaxpr
    from jaxmem.xla.cpu.compile import reference_from_lowered

    if program.traced is None:
        return Planless(_cpu_figures_of_lowered(program.lowered) if xla else None)
    box: dict[str, Any] = {}

    def compile_reference() -> None:
        try:
            box["ref"] = reference_from_lowered(program.lower_for("cpu"))
        except BaseException as err:  # handed to the main thread, which raises it
            box["err"] = err

    worker = threading.Thread(target=compile_reference, name="jaxmem-xla-reference", daemon=True)
    if xla:
        worker.start()
    try:
        result = plan_jaxpr(program.closed_jaxpr, donated=program.donated)
    finally:
        if xla:
            worker.join()
    result = dataclasses.replace(result, trace_seconds=program.trace_seconds)
    if "err" in box:
        raise box["err"]
    return dataclasses.replace(result, xla=box.get("ref"))


def _cpu_figures_of_lowered(lowered: Any) -> Any:
    """XLA:CPU's figures of a `Lowered` the user made, where XLA:CPU compiles it (one lowered
    for another platform may hold that platform's calls); else None."""
    from jaxmem.xla.cpu.compile import reference_from_lowered

    try:
        return reference_from_lowered(lowered)
    except PlanError:
        return None


@dataclass
class Planless:
    """What stands in for jaxmem's plan of a `Lowered`, which has no jaxpr: XLA:CPU's figures
    (where compiled) and nothing of the plan's."""

    xla: Any = None


def plan_for_gpu(run: Run) -> None:
    """For a GPU preset: jaxmem's plan with XLA:GPU's fusion rules, and XLA:GPU's figure predicted."""
    from jaxmem.xla.gpu.compile import spec_for

    if spec_for(run.preset) is None or not run.has_jaxpr:
        return
    from jaxmem.xla.gpu.model.predict import plan_on_gpu, predict_plan

    run.plan = run.guarded(lambda: plan_on_gpu(run.plan))
    run.predicted = run.guarded(lambda: predict_plan(run.plan, run.preset))


def collect_references(run: Run) -> None:
    """XLA's figures into the run: the better of XLA:CPU's schedulers, XLA:GPU's or XLA:TPU's
    (or, where that compile could not run, XLA:CPU's in its place, with a note)."""
    if run.schedulers:
        best, run.cpu_totals = better_schedule(run.scheduled)
        run.plan = dataclasses.replace(run.plan, xla=best)
    if run.box is not None:
        take_device_reference(run)
    if run.note:
        run.say(run.note)


def take_device_reference(run: Run) -> None:
    """What XLA:GPU's or XLA:TPU's compile handed back: its reference, or its error (raised,
    unless the compiler is unavailable here: then a note, and XLA:CPU's figures)."""
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
    if run.plan.xla is None and run.has_jaxpr:
        from jaxmem.xla.cpu.compile import reference_from_lowered

        with run.spinner("compiling with XLA:CPU"):
            cpu = run.guarded(lambda: reference_from_lowered(run.program.lower_for("cpu")), "compile")
        run.plan = dataclasses.replace(run.plan, xla=cpu)


def simulate_pool(run: Run, loop: Callable[[Run, Any], Any] | None = None) -> None:
    """N training steps in the device's memory, under the GPU client's pool or the TPU runtime's
    rules; `loop`: the verdict for a loop of programs instead (`--with`)."""
    if run.accelerator is not None and run.accelerator.is_tpu:
        run.pool, run.fraction = tpu_pool(run), 1.0
    else:
        run.pool, run.fraction = gpu_pool(run)
    if run.args.with_targets and loop is not None:
        if run.tpu is None and run.gpu is None:
            raise PlanError("--with needs the device's XLA figures (a GPU or TPU preset, with its compiler here)")
        device = None if run.tpu is not None else pool_device(run.args, run.device[1])
        run.pool = loop(run, device) or run.pool


def gpu_pool(run: Run) -> tuple[Any, float]:
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
        run.say(f"the pool is not simulated: {err}")
        return None, PREALLOCATE_FRACTION
    if run.gpu is not None:
        return simulate_steps(program_from_reference(run.gpu), dev, args.steps), dev.mem_fraction
    if run.predicted is not None:
        # A GPU preset with no XLA:GPU compile here: the pool over the predicted XLA:GPU figures.
        return simulate_steps(program_from_reference(run.predicted), dev, args.steps), dev.mem_fraction
    if run.plan.xla is not None:
        return simulate_steps(cpu_program(run), dev, args.steps), dev.mem_fraction
    return None, dev.mem_fraction


def tpu_pool(run: Run) -> Any:
    """The TPU runtime's verdict over N steps (`runtime/tpu_pool.py`): on XLA:TPU's figures (its
    out-of-memory message, when its compile refused the program), else on XLA:CPU's."""
    from jaxmem.runtime.steps import program_from_reference
    from jaxmem.runtime.tpu_pool import check_tpu_flags, compile_refused, ignored_gpu_variables, simulate_tpu_steps

    args, accelerator, tpu = run.args, run.accelerator, run.tpu
    check_tpu_flags(args.mem_fraction, args.preallocate, args.allocator, args.steps)
    ignored = ignored_gpu_variables()
    if ignored:
        run.say(f"{', '.join(ignored)} set JAX's GPU client; JAX's TPU runtime does not read them "
                "(ignored for this TPU)")
    if tpu is not None:
        if tpu.oom:
            return compile_refused(tpu, accelerator, args.steps)
        return simulate_tpu_steps(program_from_reference(tpu), accelerator.capacity_bytes, args.steps,
                                  code_bytes=tpu.generated_code_bytes, reserved_bytes=tpu.reserved_bytes,
                                  factory=tpu.factory)
    if run.plan.xla is not None:
        return simulate_tpu_steps(cpu_program(run), accelerator.capacity_bytes, args.steps)
    return None


def cpu_program(run: Run) -> Any:
    """The pool's view of a step from XLA:CPU's figures (when the device's XLA cannot run here):
    the argument and output leaves, donated arguments taken over by the first output of the
    same shape and dtype, and XLA:CPU's temp bytes as the one temp allocation."""
    from jaxmem.compiler.jaxpr_adapter import aval_bytes
    from jaxmem.runtime.steps import Leaf, StepProgram, match_state

    def key(leaf: Any) -> str:
        return f"{leaf.dtype}{list(leaf.shape)}"

    ins, donated = run.program.in_leaves(), run.program.donated
    arguments = [Leaf(aval_bytes(leaf), donated=donated[i]) for i, leaf in enumerate(ins)]
    keys_in = [key(leaf) for leaf in ins]
    free = {i for i, a in enumerate(arguments) if a.donated}
    outputs, keys_out = [], []
    for leaf in run.program.out_leaves():
        alias = next((i for i in sorted(free) if keys_in[i] == key(leaf)), None)
        if alias is not None:
            free.discard(alias)
        outputs.append(Leaf(aval_bytes(leaf), aliases=alias))
        keys_out.append(key(leaf))
    return StepProgram(arguments, match_state(arguments, outputs, keys_in, keys_out), int(run.plan.xla.temp_bytes))


def weigh_framework_costs(run: Run) -> None:
    """What the step's framework adds over the same step written pure, and the changes that
    remove it, each compiled for the device (`api/costs.py`)."""
    from jaxmem.api.costs import framework_costs, wanted

    if not run.has_jaxpr or not wanted(run):
        return
    with run.spinner("compiling the changes that would cut what the framework adds"):
        run.costs = framework_costs(run, lambda program: figures_of(run, program))


def figures_of(run: Run, program: Program) -> tuple[dict[str, int], dict[str, Any] | None]:
    """XLA's figures for `program` and the pool's verdict over the run's steps, judged as the run
    judged its own program: the device's deviceless compile where it ran, else XLA:CPU's."""
    from jaxmem.xla.cpu.compile import reference_from_lowered
    from jaxmem.xla.lowered import from_lowered, lowered_reference

    other = Run(run.args, program, run.target, run.device, run.accelerator, factory_texts=run.factory_texts,
                say=lambda text: None)
    if run.tpu is not None or run.gpu is not None:
        platform = "tpu" if run.tpu is not None else "cuda"
        lowered = other.guarded(lambda: program.lower_for(platform), "lower")
        texts = run.factory_texts if platform == "tpu" else ()
        ref = lowered_reference(from_lowered(lowered, platform, texts), run.accelerator, top=0)
        other.tpu, other.gpu = (ref, None) if platform == "tpu" else (None, ref)
        other.plan = Planless()
    else:
        ref = other.guarded(lambda: reference_from_lowered(program.lower_for("cpu")), "compile")
        other.plan = Planless(ref)
    pool = tpu_pool(other) if run.accelerator is not None and run.accelerator.is_tpu else gpu_pool(other)[0]
    xla = {key: int(getattr(ref, key)) for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                                   "total_bytes")}
    return xla, None if pool is None else pool.summary()


def summarize_run(run: Run) -> AnalysisReport:
    """The report every view reads (`reports/analysis.py`)."""
    data = summarize(run.plan if run.has_jaxpr else None, run.fn_args, target=run.target, device=run.device,
                     top=run.args.top, gpu=run.gpu, pool=run.pool, fraction=run.fraction, note=run.note,
                     predicted=run.predicted, tpu=run.tpu, accelerator=run.accelerator, cpu_totals=run.cpu_totals,
                     cpu_xla=run.plan.xla, arg_names=run.program.names)
    data["loop"] = run.loop
    data["device"]["chosen_because"] = run.device_reason
    data["framework"] = framework_summary(run)
    data["total_seconds"] = time.perf_counter() - run.started
    return AnalysisReport(data, run.plan if run.has_jaxpr else None)


def framework_summary(run: Run) -> dict[str, Any] | None:
    """Whose program this is and how jaxmem read it; what the framework adds, where weighed."""
    step = run.program.step
    if step is None or (step.framework == "jax" and run.costs is None):
        return None
    return {"name": step.label, "step": step.name, "how": step.how, **(run.costs or {})}


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


def guarded(work: Callable[[], Any], what: str) -> Any:
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


def stderr_say(prefix: str) -> Callable[[str], None]:
    """A line on stderr, `prefix` first (never stdout: the user's program's output is theirs)."""
    return lambda text: print(f"{prefix}: {text}", file=sys.stderr)
