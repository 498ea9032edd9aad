"""Find the largest batch (or any integer argument) that fits a GPU or TPU: `jaxmem maxbatch TARGET --arg NAME`.

TARGET's factory takes the keyword argument NAME (`batch_size`, a sequence length, ...) and
returns `(fn, args)`. The answer is judged by XLA, compiled deviceless for the device (XLA:GPU
for a GPU preset, XLA:TPU for a TPU preset), and the runtime over N training steps as `jaxmem
analyze` runs it (the GPU client's pool; the TPU runtime's rules): `value` fits and `value + 1`
does not. On a GPU, jaxmem's model of XLA:GPU (`xla.gpu.model.predict.predict`: no compile) finds the
largest value whose predicted total fits, the first guess; XLA's compiles confirm it (and its
neighbour). Elsewhere jaxmem's planner at two small values makes the guess.

    jaxmem maxbatch jaxmem.examples.gpt:batch_example --arg batch_size --device h100-80gb
    jaxmem maxbatch jaxmem.examples.gpt:batch_example --arg batch_size --device tpu-v5e-16gb
    jaxmem maxbatch my_model.py:make_step --arg seq_len --device a100-40gb --donate 0,1 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from jaxmem.cli import OneLineParser, report_console
from jaxmem.cli.analyze import add_pool_arguments, parse_donate, pool_device
from jaxmem.errors import PlanError
from jaxmem.units import format_size


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="jaxmem maxbatch", description=(__doc__ or "").strip().splitlines()[0],
                           epilog="TARGET: 'path/to/file.py:factory' or 'package.module:factory'; "
                                  "factory(NAME=value) returns (fn, args).")
    parser.add_argument("target", metavar="TARGET")
    parser.add_argument("--arg", required=True, metavar="NAME", help="the factory's integer keyword argument to maximize")
    parser.add_argument("--device", default="h100-80gb", metavar="PRESET",
                        help="a GPU or TPU preset (default h100-80gb; tpu-v5e-16gb: judged by XLA:TPU)")
    parser.add_argument("--donate", default="", metavar="0,1",
                        help="positional arguments of fn to donate (default: those its own jax.jit donates)")
    parser.add_argument("--min", type=int, default=1, dest="minimum", help="the smallest value searched (default 1)")
    parser.add_argument("--max", type=int, default=1 << 24, dest="maximum", help="the largest value searched (default 2^24)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_pool_arguments(parser)
    return parser


def target_donation(target: str, name: str, value: int) -> tuple[int, ...]:
    """The `donate_argnums` of a TARGET whose factory returns a function already wrapped in
    `jax.jit(..., donate_argnums=...)` (read from its trace at `name=value`, abstract arguments,
    nothing allocated); () for any other function or a factory that cannot be traced here."""
    from jaxmem.compiler.target import jit_donation
    from jaxmem.xla.gpu.compile import load_abstract

    try:
        fn, args = load_abstract(target, {name: value})
        return jit_donation(fn, args)
    except Exception:  # XLA's compiles report a bad TARGET in one line anyway
        return ()


def planner_guess(target: str, name: str, minimum: int, limit: int, donate: tuple[int, ...]) -> tuple[int | None, float]:
    """A first guess from jaxmem's own planner: its peak at `minimum` and `2 * minimum`
    (abstract arguments, nothing allocated), and the value where the line through them reaches
    `limit`. (None, seconds) when the planner cannot say."""
    from jaxmem.compiler.planner import plan
    from jaxmem.xla.gpu.compile import load_abstract
    from jaxmem.xla.maxbatch import line_guess

    started = time.perf_counter()
    points = []
    try:
        for value in (minimum, 2 * minimum):
            fn, args = load_abstract(target, {name: value})
            points.append((value, plan(fn, *args, donate_argnums=donate, xla=False).peak_bytes))
    except Exception:  # the guess is only a guess: XLA judges every value anyway
        return None, time.perf_counter() - started
    return line_guess(points, limit, minimum), time.perf_counter() - started


def predicted_guess(target: str, name: str, minimum: int, maximum: int, limit: int, donate: tuple[int, ...],
                    device: str) -> tuple[int | None, float, int]:
    """A first guess from jaxmem's model of XLA:GPU (`xla.gpu.model.predict.predict`, no compile): the
    value where the predicted XLA:GPU total reaches `limit`: a line through the predictions at
    `minimum` and `2 * minimum`, then one secant step through a prediction at that value.
    (None, seconds, predictions) when the model cannot say."""
    from jaxmem.compiler import jaxpr_adapter as ja
    from jaxmem.xla.gpu.compile import load_abstract
    from jaxmem.xla.gpu.model.predict import predict
    from jaxmem.xla.maxbatch import Judgement, line_guess

    started = time.perf_counter()
    count = [0]

    def judge(value: int) -> Judgement:
        fn, args = load_abstract(target, {name: value})
        traced = ja.trace(fn, args, {}, donate)
        donated = [k in traced.donated for k in range(len(traced.in_avals))]
        total = predict(traced.closed_jaxpr, donated=donated, device=device).total_bytes
        count[0] += 1
        return Judgement(value, total <= limit, total)

    try:
        first = judge(minimum)
        second = judge(2 * minimum)
        points = [(minimum, first.total_bytes), (2 * minimum, second.total_bytes)]
        guess = line_guess(points, limit, minimum)
        if guess is not None and guess > 2 * minimum:
            # One secant step on the prediction at the guess (tracing a large model dominates).
            third = judge(min(guess, maximum))
            points.append((third.value, third.total_bytes))
            guess = line_guess(points, limit, minimum) or guess
        return (None if guess is None else min(guess, maximum)), time.perf_counter() - started, count[0]
    except Exception:  # the guess is only a guess: XLA judges every value anyway
        return None, time.perf_counter() - started, count[0]


class _Bar:
    """A transient progress line on stderr (terminals only): the compiles made so far."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.progress = None
        if self.console.is_terminal:
            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                     console=self.console, transient=True)
            self.task = self.progress.add_task(label, total=None)
            self.progress.start()

    def update(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def judge_for(args: argparse.Namespace, accelerator: Any, donate: tuple[int, ...], counts: dict[str, int],
              bar: "_Bar") -> Callable[[int], Any]:
    """The judge of one value: XLA's deviceless compile for the device (XLA:GPU or XLA:TPU) and
    its runtime's verdict over `--steps` steps (the GPU client's pool or the TPU runtime's rules)."""
    from jaxmem.runtime.steps import program_from_reference, simulate_steps
    from jaxmem.xla.maxbatch import Judgement

    bracket: dict[str, int] = {}

    def judge(value: int) -> Judgement:
        known = ", ".join(f"{k} {v}" for k, v in (("fits at", bracket.get("lo")), ("not at", bracket.get("hi")))
                          if v is not None)
        bar.update(f"{accelerator.xla_name} compile {counts['compiles'] + counts['cached'] + 1}: {args.arg}={value}"
                   + (f" ({known})" if known else ""))
        if accelerator.is_tpu:
            from jaxmem.runtime.tpu_pool import compile_refused, simulate_tpu_steps
            from jaxmem.xla.tpu.compile import xla_tpu_reference

            ref = xla_tpu_reference(args.target, accelerator, donate_argnums=donate, kwargs={args.arg: value}, top=0)
            verdict = (compile_refused(ref, accelerator, args.steps) if ref.oom else
                       simulate_tpu_steps(program_from_reference(ref), accelerator.capacity_bytes, args.steps,
                                          code_bytes=ref.generated_code_bytes, reserved_bytes=ref.reserved_bytes))
        else:
            from jaxmem.xla.gpu.compile import xla_gpu_reference

            ref = xla_gpu_reference(args.target, device=accelerator.name, donate_argnums=donate,
                                    kwargs={args.arg: value}, top=0)
            verdict = simulate_steps(program_from_reference(ref), pool_device(args, accelerator.capacity_bytes),
                                     args.steps)
        counts["cached" if ref.cached else "compiles"] += 1
        if verdict.fits:
            bracket["lo"] = max(value, bracket.get("lo", value))
        else:
            bracket["hi"] = min(value, bracket.get("hi", value))
        return Judgement(value, verdict.fits, ref.total_bytes, ref.cached)

    return judge


def resolve_device(text: str) -> Any:
    """`--device` as an `Accelerator` whose XLA compiles deviceless here; else one line."""
    from jaxmem.accelerators import find, gpu_presets, tpu_presets

    accelerator = find(text)
    if accelerator is None:
        raise PlanError(f"--device must be a GPU or TPU preset ({', '.join(gpu_presets() + tpu_presets())}), "
                        f"got {text!r}")
    if accelerator.is_tpu:
        from jaxmem.xla.tpu.compile import TpuUnavailable, unavailable_reason as tpu_reason

        reason = tpu_reason()
        if reason:
            raise TpuUnavailable(f"maxbatch needs XLA:TPU for {accelerator.name}, which is not available here: {reason}")
    else:
        from jaxmem.xla.gpu.compile import GpuUnavailable, unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise GpuUnavailable(f"maxbatch needs XLA:GPU, which is not available here: {reason}")
    return accelerator


def main(argv: list[str]) -> int:
    """`jaxmem maxbatch`: see the module docstring. Returns the exit code."""
    args = build_parser().parse_args(argv)
    from jaxmem.compiler.target import resolve_factory
    from jaxmem.xla.maxbatch import search

    if not args.arg.isidentifier():
        raise PlanError(f"--arg takes a keyword argument name, got {args.arg!r}")
    accelerator = resolve_device(args.device)
    device = accelerator.name
    resolve_factory(args.target)   # a bad TARGET fails here, in one line
    if accelerator.is_tpu:
        from jaxmem.runtime.tpu_pool import check_tpu_flags

        check_tpu_flags(args.mem_fraction, args.preallocate, args.allocator, args.steps)
        limit = accelerator.capacity_bytes
    else:
        limit = pool_device(args, accelerator.capacity_bytes).allocator.limit
    # `--donate` wins; else a TARGET already `jax.jit(..., donate_argnums=...)` keeps its own
    donate = parse_donate(args.donate, 1 << 16) or target_donation(args.target, args.arg, args.minimum)
    started = time.perf_counter()
    counts = {"compiles": 0, "cached": 0}
    bar = _Bar(f"planning {args.arg}={args.minimum}, {2 * args.minimum}")
    try:
        guess, plan_seconds, predictions, guess_from = None, 0.0, 0, "planner"
        if accelerator.is_gpu:
            guess, plan_seconds, predictions = predicted_guess(args.target, args.arg, args.minimum, args.maximum,
                                                               limit, donate, device)
            guess_from = "predicted_xla"
        if guess is None:
            guess, plan_seconds = planner_guess(args.target, args.arg, args.minimum, limit, donate)
            guess_from = "planner"
        judge = judge_for(args, accelerator, donate, counts, bar)
        result = search(judge, limit_bytes=limit, guess=guess, minimum=args.minimum, maximum=args.maximum)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    data: dict[str, Any] = {
        "arg": args.arg, "value": result.value, "total_bytes": result.total_bytes,
        "next_total_bytes": result.next_total_bytes, "limit_bytes": int(limit), "seconds": round(seconds, 3),
        "compiles": counts["compiles"], "cached_compiles": counts["cached"], "device": device,
        "steps": args.steps, "at_maximum": result.at_maximum, "planner_guess": guess,
        "planner_seconds": round(plan_seconds, 3), "guess_from": guess_from, "predictions": predictions,
        "judged": [{"value": j.value, "fits": j.fits, "total_bytes": j.total_bytes, "cached": j.cached}
                   for j in sorted(result.judged, key=lambda j: j.value)],
    }
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    console = report_console()
    if result.at_maximum:
        console.print(f"[bold]{args.arg} = {result.value}[/bold] fits {device} (the largest value searched, --max)")
    else:
        console.print(f"[bold green]{args.arg} = {result.value}[/bold green] is the largest that fits {device}: "
                      f"{accelerator.xla_name} total {format_size(result.total_bytes)}; at {result.value + 1}: "
                      f"{format_size(result.next_total_bytes or 0)}, which the "
                      f"{'chip' if accelerator.is_tpu else 'pool'} cannot hold over {args.steps} steps")
    cached = f" + {counts['cached']} cached" if counts["cached"] else ""
    console.print(f"{'chip' if accelerator.is_tpu else 'pool'} limit {format_size(limit)}; "
                  f"{counts['compiles']} {accelerator.xla_name} compiles{cached}, "
                  f"guess {guess if guess is not None else '—'} from "
                  + ("the predicted XLA:GPU total" if guess_from == "predicted_xla" else "jaxmem's planner")
                  + f" ({plan_seconds:.1f} s); {seconds:.1f} s", style="dim")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
