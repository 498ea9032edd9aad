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
import sys
from typing import Any, Callable, Sequence

from jaxmem.cli import OneLineParser, analyze_loop, report_console, sharded
from jaxmem.errors import ConfigError, PlanError
from jaxmem.accelerators import find as find_accelerator
from jaxmem.reports.analysis import AnalysisReport
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
    parser.add_argument("--device", default=None, metavar="PRESET",
                        help=f"device to check the fit against: a preset ({', '.join(sorted(PRESETS))}) "
                             f"or a size such as 24GiB (default: the GPU or TPU the arguments are on, else "
                             f"JAX's default device where it is one, else {DEFAULT_DEVICE})")
    parser.add_argument("--costs", choices=("auto", "on", "off"), default="auto",
                        help="what the step's framework adds over the same step written pure, and the changes "
                             "that remove it, each compiled for the device: auto (default: for a Flax NNX, "
                             "Equinox or Keras step), on (plain JAX too: undonated state), off")
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
    from jaxmem.api.pipeline import pool_device as make

    if args.steps < 1:
        raise PlanError(f"--steps must be 1 or more, got {args.steps}")
    return make(args, capacity)


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


# -- the pipeline: `jaxmem.api.pipeline`, over the loaded TARGET -------------------------------

def main(argv: list[str]) -> int:
    """`jaxmem analyze`: see the module docstring. Returns the exit code."""
    from jaxmem.api.pipeline import Run, analyze_run, stderr_say
    from jaxmem.reports.cli import check_paths
    from jaxmem.reports.terminal import busy

    args = build_parser().parse_args(argv)
    check_paths(args)   # `--png t.xyz` is refused before the target is loaded
    if args.top < 0:
        raise PlanError(f"--top must be 0 or more, got {args.top}")
    target = args.target or DEFAULT_TARGET
    device = parse_device(args.device) if args.device is not None else None
    accelerator = find_accelerator(device[0]) if device is not None else None
    record = not args.no_xla and (device is None or (accelerator is not None and accelerator.is_tpu))
    fn, fn_args, texts = load(target, record=record)
    reason = None
    if device is None:
        device, reason = choose_for(fn_args)
        accelerator = find_accelerator(device[0])
        args.device = device[0]
    donate = parse_donate(args.donate, len(fn_args))
    if sharded.wanted(args, fn_args):
        # A mesh: per-device figures from a partitioned compile (jaxmem.api.sharded).
        return sharded.run(args, target, device, donate or _jit_donation(fn, fn_args), pool_device, fn, fn_args)
    if args.execute and has_abstract_args(fn_args):
        raise PlanError(f"--execute runs the program, and {target} returns jax.ShapeDtypeStruct arguments "
                        "(no values); plan and compile it without --execute")
    program = _prepare(fn, fn_args, donate, target)
    if args.execute and program.fn is None:
        raise PlanError(f"--execute runs plain JAX steps; {target} is a {program.step.label} step, which jaxmem "
                        "compiles but does not run")
    shown = target if args.target else f"{DEFAULT_TARGET} (built-in)"
    run = Run(args, program, shown, device, accelerator, cpu_target=target, factory_texts=texts,
              say=stderr_say("jaxmem analyze"), busy=busy, device_reason=reason)
    report = analyze_run(run, loop=analyze_loop.loop_pool)
    if args.execute:
        execute(run, report)
    return output(args, report)


def choose_for(fn_args: Sequence[Any]) -> tuple[tuple[str, int], str]:
    """The device the factory's arguments live on (`api/devices.py`), and why (the report's
    "judged for" row says it)."""
    from jaxmem.api.devices import choose_device
    from jaxmem.frameworks.step import devices_of

    choice = choose_device(devices_of(tuple(fn_args)))
    return parse_device(choice.device), choice.reason


def load(target: str, record: bool) -> tuple[Any, tuple[Any, ...], list[str]]:
    """TARGET's `(fn, args)`, and, where `record`, the StableHLO of every program its factory ran
    (a TPU keeps their code resident: `xla.tpu.factory`)."""
    from jaxmem.compiler.target import load_target

    if not record:
        return (*load_target(target), [])
    from jaxmem.compiler.jaxpr_adapter import run_recording_programs

    (fn, fn_args), texts = run_recording_programs(lambda: load_target(target))
    return fn, fn_args, texts


def _prepare(fn: Any, fn_args: tuple[Any, ...], donate: tuple[int, ...], target: str) -> Any:
    """The program `jaxmem.api` analyses: `--donate` where given (it must agree with a jitted
    function's own donation), else the function's own."""
    from jaxmem.api.program import prepare

    return prepare(fn, fn_args, None, donate or None)


def _jit_donation(fn: Any, fn_args: tuple[Any, ...]) -> tuple[int, ...]:
    from jaxmem.compiler.target import jit_donation

    return jit_donation(fn, fn_args)


def execute(run: Any, report: AnalysisReport) -> None:
    """`--execute`: the planned program against jax.jit, and eagerly under each allocator."""
    from jaxmem.reports.terminal import busy

    program = run.program
    with busy("executing"):
        result, eager = run.guarded(lambda: run_execute(program.fn, program.fn_args, run.plan,
                                                        program.donated_positions, run.device[1]), "execute")
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


# -- --execute -----------------------------------------------------------------------------

def start_cpu_schedulers(target: str, donate: tuple[int, ...], which: str) -> tuple[list[Any], dict[str, Any]]:
    """XLA:CPU's "dfs" and/or "bfs" scheduler compiles of TARGET (`api.pipeline.start_cpu_schedulers`)."""
    from jaxmem.api.pipeline import start_cpu_schedulers as start

    return start(target, donate, which)


def has_abstract_args(args: Sequence[Any]) -> bool:
    """Whether any argument leaf is a `jax.ShapeDtypeStruct` (shape and dtype, no values)."""
    import jax

    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tuple(args)))


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
