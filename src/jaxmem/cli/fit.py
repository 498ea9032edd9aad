"""Rewrite a JAX function to recompute values so it fits a memory budget: `jaxmem fit TARGET --budget 2GiB`.

TARGET is `path/to/file.py:factory` or `package.module:factory`, where `factory()` returns
`(fn, args)`. Prints the peak before and after (jaxmem's plan and XLA:CPU's memory_analysis()),
the extra compute, and the values recomputed.

    jaxmem fit jaxmem.examples.suite:mlp_train --budget 70%
    jaxmem fit my_model.py:make_step --budget 2GiB --donate 0 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxmem.cli import OneLineParser
from jaxmem.errors import ConfigError
from jaxmem.units import format_size, parse_size


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="jaxmem fit",
        description=(__doc__ or "").strip().splitlines()[0],
        epilog="TARGET: 'path/to/file.py:factory' or 'package.module:factory'; factory() returns (fn, args).",
    )
    parser.add_argument("target", metavar="TARGET", help="the function to fit")
    parser.add_argument("--budget", required=True, metavar="SIZE",
                        help="bytes, a size such as 2GiB, a device preset, or a percentage of XLA's "
                             "total for the original function (e.g. 50%%)")
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


def _budget(text: str, fn: Any, args: tuple, donate: tuple[int, ...]) -> int:
    text = text.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise ConfigError(f"cannot read budget {text!r}: use bytes, '2GiB', a preset or '50%'") from None
        if not 0 < share < float("inf"):  # inf% would overflow int() below
            raise ConfigError(f"budget must be a positive, finite share, got {text!r}")
        from jaxmem.xla.cpu import xla_reference

        return max(1, int(share * xla_reference(fn, args, donate_argnums=donate).total_bytes))
    return parse_size(text)


def scheduler_advice(totals: dict[str, int], budget: int, fitted_total: int) -> str | None:
    """What to tell the user first when one of XLA:CPU's own schedulers does as well as the fit:
    it meets the budget, or needs no more than the rewrite does, at no extra FLOPs.

    >>> scheduler_advice({"dfs": 90, "bfs": 120}, 100, 95)
    "XLA's own dfs scheduler meets the budget with no recompute (90 B): XLA_FLAGS=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    """
    from jaxmem.xla.cpu import SCHEDULER_FLAGS

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
        "fits": result.fits,
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
    }


def _render(result: Any, target: str, advice: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    verdict = "[green]fits[/green]" if result.fits else "[red]does not fit[/red]"
    from jaxmem.reports.escape import markup

    if advice:
        console.print(f"[bold yellow]first:[/bold yellow] {markup(advice)}")
    console.print(f"jaxmem fit {markup(target)}: budget {format_size(result.budget_bytes)}: {verdict}")
    table = Table(title="peak memory")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_row("jaxmem plan", format_size(result.planned_peak_bytes_before), format_size(result.planned_peak_bytes))
    table.add_row("XLA:CPU memory_analysis()", format_size(result.xla_total_bytes_before), format_size(result.xla_total_bytes))
    console.print(table)
    console.print(f"recompute: {result.recompute_flops_ratio * 100:.1f}% extra FLOPs "
                  f"({result.extra_flops:,} over {result.original_flops:,})")
    if result.step_seconds_before and result.step_seconds_after:
        console.print(f"step time (jax.jit here, warm): {1e3 * result.step_seconds_before:.1f} ms before, "
                      f"{1e3 * result.step_seconds_after:.1f} ms after "
                      f"({result.step_seconds_after / result.step_seconds_before:.2f}x)")
    console.print(f"smallest reachable budget: {format_size(result.min_reachable_bytes)}")
    if not result.fits:
        console.print(f"the budget cannot be met: ask for at least {format_size(result.min_reachable_bytes)}")
    console.print(f"closest jax.checkpoint policy: {result.policy}: {result.policy_code}")
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


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from jaxmem.compiler.remat import fit
    from jaxmem.compiler.target import load_target

    fn, fn_args = load_target(args.target)
    donate = _donate(args.donate, len(fn_args))
    budget = _budget(args.budget, fn, fn_args, donate)
    # XLA:CPU's schedulers compile in their own processes while the search runs.
    workers, box = ([], {}) if args.no_schedulers else _scheduler_totals(args.target, donate)
    result = fit(fn, *fn_args, budget=budget, donate_argnums=donate, max_rounds=args.rounds)
    for w in workers:
        w.join()
    if not args.no_time and not _abstract(fn_args):
        result.measure(*fn_args)
    totals = {name: ref.total_bytes for name, ref in sorted(box.items()) if not isinstance(ref, BaseException)}
    advice = scheduler_advice(totals, budget, result.xla_total_bytes)
    if args.json:
        json.dump(_summary(result, totals or None, advice), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _render(result, args.target, advice)
    return 0 if result.fits else 1
