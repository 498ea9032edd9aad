"""Fit a JAX function to a memory budget: a jax.checkpoint policy to paste, or a rewrite: `jaxmem fit TARGET --budget 2GiB`.

TARGET is `path/to/file.py:factory` or `package.module:factory`, where `factory()` returns
`(fn, args)`. Prints the `jax.checkpoint` policy to write (which scan body, layer, loop body
or differentiated function to wrap, and XLA's total for each alternative), the peak before and after the
rewriting search (jaxmem's plan and XLA's memory_analysis(): XLA:GPU for `--device PRESET`,
compiled deviceless, else XLA:CPU), the extra compute, and the values recomputed.

    jaxmem fit jaxmem.examples.suite:mlp_train --budget 70%
    jaxmem fit jaxmem.examples.suite:scanned_transformer_train --donate 0,1 --budget half-temp --device h100-80gb
    jaxmem fit my_model.py:make_step --budget 2GiB --donate 0 --json
    jaxmem fit tests/api/mesh_steps.py:make160 --budget tpu-v5e-16gb --device tpu-v5e-16gb

Where the factory's arguments are sharded over a mesh, the answer is per device: the cheapest
`jax.checkpoint` policy or standard layout that fits each device (`fitting/mesh.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxmem.cli import OneLineParser, report_console
from jaxmem.errors import ConfigError
from jaxmem.units import format_size


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="jaxmem fit",
        description=(__doc__ or "").strip().splitlines()[0],
        epilog="TARGET: 'path/to/file.py:factory' or 'package.module:factory'; factory() returns (fn, args).",
    )
    parser.add_argument("target", metavar="TARGET", help="the function to fit")
    parser.add_argument("--budget", required=True, metavar="SIZE",
                        help="bytes, a size such as 2GiB, a device preset, a percentage of XLA's "
                             "total for the original function (e.g. 50%%), or half-temp (XLA's arguments + "
                             "outputs - aliases + half of its temporaries)")
    parser.add_argument("--device", default=None, metavar="PRESET",
                        help="judge every candidate by XLA:GPU or XLA:TPU for this preset (e.g. h100-80gb, "
                             "tpu-v5e-16gb), compiled deviceless; default XLA:CPU. Needed where the factory's "
                             "arguments are sharded over a mesh: then judged per device")
    parser.add_argument("--policy-only", action="store_true",
                        help="judge jax.checkpoint policies only; skip the rewriting search")
    parser.add_argument("--rewrite", action="store_true",
                        help="run the rewriting search even when a policy meets the budget")
    parser.add_argument("--all-policies", action="store_true",
                        help="compile every policy alternative (default: stop at the first that fits)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--time-limit", type=float, default=240.0, metavar="S",
                        help="seconds for the whole search: the policy search stops at half, the rewriting "
                             "search at the end, each answering with the best judged so far (default 240; 0: no limit)")
    parser.add_argument("--donate", default="", metavar="0,1",
                        help="positional arguments of fn to donate, as jax.jit's donate_argnums")
    parser.add_argument("--rounds", type=int, default=8, metavar="N",
                        help="at most N rewrites compiled by XLA to find the cheapest that fits (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--no-time", action="store_true",
                        help="skip timing one step of the original and of the rewrite (jax.jit, warm)")
    parser.add_argument("--no-schedulers", action="store_true",
                        help="skip compiling with XLA:CPU's two schedulers first (each in a fresh process) "
                             "to see whether one alone meets the budget with no recompute")
    return parser


def _donate(text: str, num_args: int) -> tuple[int, ...]:
    if not text.strip():
        return ()
    out = set()
    for part in text.split(","):
        try:
            k = int(part)
        except ValueError:
            raise ConfigError(f"--donate {text!r}: {part!r} is not an integer") from None
        if not -num_args <= k < num_args:
            raise ConfigError(f"--donate {text!r}: {k} is not a positional argument index (0..{num_args - 1})")
        out.add(k % num_args)
    return tuple(sorted(out))


def scheduler_advice(totals: dict[str, int], budget: int, fitted_total: int) -> str | None:
    """What to tell the user first when one of XLA:CPU's own schedulers does as well as the fit:
    it meets the budget, or needs no more than the rewrite does, at no extra FLOPs.

    >>> scheduler_advice({"dfs": 90, "bfs": 120}, 100, 95)
    "XLA's own dfs scheduler meets the budget with no recompute (90 B): XLA_FLAGS=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    """
    from jaxmem.xla.cpu.compile import SCHEDULER_FLAGS

    if not totals:
        return None
    best = min(sorted(totals), key=totals.__getitem__)
    if totals[best] > budget and totals[best] > fitted_total:
        return None
    what = "meets the budget" if totals[best] <= budget else f"needs less than the rewrite ({format_size(fitted_total)})"
    return (f"XLA's own {best} scheduler {what} with no recompute ({format_size(totals[best])}): "
            f"XLA_FLAGS=--xla_cpu_scheduler_type={SCHEDULER_FLAGS[best]}")


def _scheduler_totals(target: str, donate: tuple[int, ...]) -> tuple[list[Any], dict[str, Any]]:
    from jaxmem.cli.analyze import start_cpu_schedulers

    return start_cpu_schedulers(target, donate, "both")


def _abstract(args: tuple) -> bool:
    import jax

    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(args))


def _summary(result: Any, totals: dict[str, int] | None = None, advice: str | None = None) -> dict[str, Any]:
    return {
        "xla_cpu_schedulers": totals,
        "scheduler_advice": advice,
        # The budget is met by what fit prints (a policy, or the rewritten function): the exit
        # status. `rewrite_fits` is the rewriting search's own verdict, `policy_fits` the policy's.
        "fits": bool(result.fits or result.policy_fits),
        "rewrite_fits": result.fits if result.rewrite_ran else None,
        "budget_bytes": result.budget_bytes,
        "planned_peak_bytes": result.planned_peak_bytes,
        "planned_peak_bytes_before": result.planned_peak_bytes_before,
        "xla_total_bytes_before": result.xla_total_bytes_before,
        "xla_total_bytes_after": result.xla_total_bytes,
        "recompute_flops_ratio": result.recompute_flops_ratio,
        "extra_flops": result.extra_flops,
        "step_seconds_before": result.step_seconds_before,
        "step_seconds_after": result.step_seconds_after,
        "original_flops": result.original_flops,
        "min_reachable_bytes": result.min_reachable_bytes,
        "policy": result.policy,
        "policy_code": result.policy_code,
        "policy_xla_total_bytes": result.policy_xla_total_bytes,
        "recomputed": [
            {"shape": list(v.shape), "dtype": v.dtype, "bytes": v.nbytes, "primitive": v.primitive,
             "source": str(v.source) if v.source else None,
             "library_source": str(v.source.library) if v.source and v.source.library else None,
             "chain": list(v.chain), "flops": v.flops}
            for v in result.recomputed
        ],
        "rounds": result.rounds,
        "rewrite_ran": result.rewrite_ran,
        "rewrite_skipped": result.rewrite_skipped,
        "judge": result.judge,
        "device": result.device,
        "policy_fits": result.policy_fits,
        "floor_bytes": result.floor_bytes,
        "infeasible": result.infeasible,
        "policies": _policies(result),
        "rewrites": [{"kind": r.kind, "xla_total_bytes": r.xla_total_bytes, "values_equal": r.values_equal,
                      "extra_flops": r.extra_flops, "code": r.lines} for r in result.rewrites],
    }


def _policies(result: Any) -> list[dict[str, Any]] | None:
    found = result.policies
    if found is None:
        return None
    return [{"kind": c.kind, "policy": c.policy, "sites": [str(s) for s in c.sites], "keys": c.keys,
             "but_last": c.but_last, "first": c.first or None, "grouped": c.grouped,
             "rest": c.rest if c.first and c.rest != "none" else None,
             "tagged_dots": [f"{d.file}:{d.line}" for d in c.dots] or None, "order": c.order or None,
             "micro_batches": c.micro_batches or None,
             "xla_total_bytes": c.xla_total_bytes if not c.error else None,
             "planned_peak_bytes": c.planned_peak_bytes,
             "extra_flops": c.extra_flops, "extra_flops_ratio": c.extra_flops_ratio,
             "fits": None if c.error or c.xla_total_bytes is None else c.xla_total_bytes <= result.budget_bytes,
             "chosen": c is found.best, "code": c.code, "error": c.error or None}
            for c in found.candidates]


def _render(result: Any, target: str, advice: str | None = None) -> None:
    from rich.table import Table

    # piped into a file or a log, each policy name stays on one line, as it is pasted
    console = report_console(highlight=False)
    best = result.policies.best if result.policies is not None else None
    if result.policy_fits and not (result.fits and result.fn is not result.original_fn):
        verdict = ("[green]fits with the source rewrites below, no jax.checkpoint[/green]"
                   if result.rewrites and best is not None and best.policy == "none" and not best.order
                   else "[green]fits with gradient accumulation below[/green]"
                   if best is not None and best.micro_batches
                   else "[green]fits with the jax.checkpoint policy below[/green]")
    else:
        verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
    from jaxmem.reports.escape import markup

    if advice:
        console.print(f"[bold yellow]first:[/bold yellow] {markup(advice)}")
    console.print(f"jaxmem fit {markup(target)}: budget {format_size(result.budget_bytes)}: {verdict}")
    table = Table(title="peak memory")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_row(_plan_label(result.judge), format_size(result.planned_peak_bytes_before),
                  format_size(result.planned_peak_bytes))
    table.add_row(f"{result.judge} memory_analysis()", format_size(result.xla_total_bytes_before),
                  format_size(result.xla_total_bytes))
    console.print(table)
    _render_rewrites(console, result.rewrites, result.judge, result.xla_total_bytes_before)
    _render_policies(console, result)
    if result.rewrite_ran:
        console.print(f"rewrite: {result.recompute_flops_ratio * 100:.1f}% extra FLOPs "
                      f"({result.extra_flops:,} over {result.original_flops:,})")
    else:
        console.print(f"rewrite: not run ({result.rewrite_skipped})")
    if result.step_seconds_before and result.step_seconds_after:
        console.print(f"step time (jax.jit here, warm): {1e3 * result.step_seconds_before:.1f} ms before, "
                      f"{1e3 * result.step_seconds_after:.1f} ms after "
                      f"({result.step_seconds_after / result.step_seconds_before:.2f}x)")
    console.print(f"smallest reachable budget: {format_size(result.min_reachable_bytes)}")
    if result.infeasible:
        console.print(f"the budget cannot be met: {result.infeasible}")
    elif not result.fits and not result.policy_fits:
        console.print(f"the budget cannot be met: ask for at least {format_size(result.min_reachable_bytes)}")
    if result.policies is None or result.policies.best is None:
        console.print(f"closest jax.checkpoint policy: {result.policy}: {markup(result.policy_code)}")
        if result.policy_xla_total_bytes is not None:
            console.print(f"that policy, applied by jaxmem's rewriter: XLA total {format_size(result.policy_xla_total_bytes)}")
    if result.recomputed:
        rows = Table(title=f"recomputed values ({len(result.recomputed)})")
        for name in ("value", "bytes", "made by", "chain", "source"):
            rows.add_column(name)
        for v in sorted(result.recomputed, key=lambda v: -v.nbytes):
            rows.add_row(f"{v.dtype}{list(v.shape)}", format_size(v.nbytes), v.primitive,
                         " > ".join(v.chain), str(v.source) if v.source else "")
        console.print(rows)


def _progress(enabled: bool) -> Any:
    """A rich progress bar on stderr that counts XLA compiles (the total is not known ahead)."""
    from contextlib import nullcontext

    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("jaxmem fit: {task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True), transient=True)


def _plan_label(judge: str) -> str:
    """What the plan column is: jaxmem's own plan, as its executor runs it on the host (the
    CPU model), which ranks the candidates; beside an XLA:GPU judge it is not a GPU figure
    (`jaxmem analyze --device` gives that)."""
    return "jaxmem plan (CPU model)" if judge.startswith("XLA:GPU") else "jaxmem plan"


def _render_rewrites(console: Any, rewrites: Any, judge: str, before: int) -> None:
    """The source rewrites kept (`fitting.rewrites`), each with XLA's total and what to write;
    the policy and the order below start from them."""
    from jaxmem.reports.escape import markup

    flops = None
    for k, r in enumerate(rewrites):
        same = {True: "equal", False: "not equal", None: "not run"}[r.values_equal]
        base = r.flops - r.extra_flops          # the step as written
        # Each rewrite's own FLOPs, against the step it rewrote (the first: the step as written).
        own = r.flops - (base if flops is None else flops)
        console.print(f"[bold]{'then' if k else 'first'}, {r.kind}[/bold] ({judge} total {format_size(before)} -> "
                      f"{format_size(r.xla_total_bytes)}, {100 * own / max(base, 1):+.1f}% FLOPs, values "
                      f"{same}; what follows starts from it):")
        for line in r.lines:  # one print per line, unbroken, so it pastes as printed
            console.print(f"    {markup(line)}", soft_wrap=True)
        before, flops = r.xla_total_bytes, r.flops


def _render_policies(console: Any, result: Any) -> None:
    """The policy answer first (what to paste), then every alternative XLA judged."""
    from rich.table import Table

    from jaxmem.fitting.accumulate import ACCUMULATE
    from jaxmem.reports.escape import markup

    found = result.policies
    if found is None or found.best is None:
        return
    table = Table(title=f"jax.checkpoint alternatives, judged by {result.judge} (budget {format_size(result.budget_bytes)})")
    plan = _plan_label(result.judge)
    for name in ("wrap", "policy", plan, "XLA total", "extra FLOPs", "fits"):
        # In a narrow terminal a name wraps rather than ending in "...": cut short, it could not be pasted.
        table.add_column(name, justify="right" if name in (plan, "XLA total", "extra FLOPs") else "left",
                         overflow="fold")
    for c in found.candidates:
        where = _wrapped(c, found.base_label)
        judged = not c.error and c.xla_total_bytes is not None
        total = "error" if c.error else (format_size(c.xla_total_bytes) if judged else "not compiled")
        fits = ("yes" if c.xla_total_bytes <= result.budget_bytes else "no") if judged else ""
        mark = " *" if c is found.best else ""
        plan = format_size(c.planned_peak_bytes) if c.planned_peak_bytes else ""
        table.add_row(where + mark, c.policy, plan, total, f"{100 * c.extra_flops_ratio:.1f}%", fits)
    console.print(table)
    for c in found.candidates:
        if c.policy == ACCUMULATE and c.error:
            console.print(f"gradient accumulation at {markup(str(c.sites[0]))}: not tried: {markup(c.error)}")
    best = found.best
    if best.policy == "none" and not best.order and best.xla_total_bytes is not None \
            and best.xla_total_bytes > result.budget_bytes:
        console.print("no jax.checkpoint policy on the sites found (scan bodies, layers, the differentiated function) "
                      "lowers XLA's total; see the rewrite")
        return
    verdict = "meets the budget" if best.xla_total_bytes <= result.budget_bytes else "is the smallest, over the budget"
    what = "policy and order" if best.order else "change" if best.micro_batches else "policy"
    console.print(f"[bold]{what} to write[/bold] ({verdict}: {result.judge} total {format_size(best.xla_total_bytes)}, "
                  f"{100 * best.extra_flops_ratio:.1f}% extra FLOPs):")
    for line in best.code.splitlines():  # one print per line: markup escapes a newline
        console.print(markup(line), soft_wrap=True)   # unbroken, so it pastes as printed
    free = _least_at_no_extra_flops(found, result.budget_bytes)
    if free is not None:
        policy = f" under {free.policy}" if free.policy != "none" else ""
        console.print(f"at no extra FLOPs the least is {_wrapped(free, found.base_label)}{policy}: "
                      f"{result.judge} total {format_size(free.xla_total_bytes)} "
                      f"({format_size(free.xla_total_bytes - best.xla_total_bytes)} more)")


def _wrapped(c: Any, base_label: str) -> str:
    """What a candidate wraps in jax.checkpoint, as the table's first column says it."""
    where = {"none": f"({base_label or 'original'})", "scan": "each lax.scan body",
             "grad": "the differentiated function", "layer": "each layer call", "loop": "each loop iteration",
             "own": "your own jax.checkpoint"}[c.kind]
    if c.micro_batches:
        where = "the gradient call"
    elif c.grouped:
        where = "the loop"
    elif c.kind == "layer" and c.keys is not None:
        where = ", ".join(f"{s.function} at line {s.call.line}" for s in c.sites)
    where += c.where
    if c.order:
        where += f", run in jaxmem's {c.order}"
    return where


def _least_at_no_extra_flops(found: Any, budget: int) -> Any:
    """Where nothing meets the budget and the smallest total costs FLOPs: the smallest of the
    alternatives that cost none, for a user who would rather not pay for the difference
    (mlp_train_donated on H100: +7.2% FLOPs for 1 KiB less than the reordered step). None
    otherwise."""
    best = found.best
    if best.xla_total_bytes is None or best.xla_total_bytes <= budget or best.extra_flops <= 0:
        return None
    free = [c for c in found.candidates
            if not c.error and c.xla_total_bytes is not None and c.extra_flops <= 0]
    return min(free, key=lambda c: c.xla_total_bytes, default=None)


def _on_mesh(args: argparse.Namespace, fn: Any, fn_args: tuple, budget: str, donate: tuple[int, ...]) -> int:
    """A factory whose arguments are sharded over a mesh: the cheapest change that fits each device."""
    from jaxmem.fitting.fit import fit
    from jaxmem.fitting.mesh import summary

    if args.device is None:
        raise ConfigError("the factory's arguments are sharded over a mesh: give --device, the preset each device is")
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    with _progress(show) as bar:
        task = bar.add_task("compiling", total=None) if bar is not None else None

        def step(label: str) -> None:
            if bar is not None:
                bar.update(task, description=label, advance=1)

        result = fit(fn, *fn_args, budget=budget, donate_argnums=donate, device=args.device, progress=step,
                     time_limit=args.time_limit or None)
    if args.json:
        json.dump(summary(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(result.text())
    return 0 if result.fits else 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from jaxmem.fitting.fit import fit
    from jaxmem.compiler.target import jit_donation, load_target
    from jaxmem.fitting.judge import Figures, Judge, resolve_budget

    if args.device is not None:
        Judge(args.device)  # an unknown preset is one line before anything compiles
    budget = args.budget.strip()
    resolve_budget(budget, Figures(1, 1, 2, 0))  # a budget that cannot be read is one line, before any compile
    fn, fn_args = load_target(args.target)
    donate = _donate(args.donate, len(fn_args)) or jit_donation(fn, fn_args)
    from jaxmem.xla.sharding import find_mesh

    if find_mesh(fn_args) is not None:
        return _on_mesh(args, fn, fn_args, budget, donate)
    # XLA:CPU's schedulers compile in their own processes while the search runs.
    cpu_schedulers = not args.no_schedulers and args.device is None
    workers, box = _scheduler_totals(args.target, donate) if cpu_schedulers else ([], {})
    with _progress(not args.no_progress and not args.json and sys.stderr.isatty()) as bar:
        task = bar.add_task("compiling", total=None) if bar is not None else None

        def step(label: str) -> None:
            if bar is not None:
                bar.update(task, description=label, advance=1)

        result = fit(fn, *fn_args, budget=budget, donate_argnums=donate, max_rounds=args.rounds,
                     device=args.device, rewrite=False if args.policy_only else (True if args.rewrite else "auto"),
                     progress=step, exhaustive=args.all_policies, time_limit=args.time_limit or None)
    for w in workers:
        w.join()
    if not args.no_time and not _abstract(fn_args):
        result.measure(*fn_args)
    totals = {name: ref.total_bytes for name, ref in sorted(box.items()) if not isinstance(ref, BaseException)}
    advice = scheduler_advice(totals, result.budget_bytes, result.xla_total_bytes)
    if args.json:
        json.dump(_summary(result, totals or None, advice), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _render(result, args.target, advice)
    if result.infeasible and args.json:  # the text report already says it, in its place
        print(f"jaxmem fit: {result.infeasible}", file=sys.stderr)
    return 0 if (result.fits or result.policy_fits) else 1
