"""Memory for free: run a function in jaxmem's planned order, no recompute, and report XLA's total: `jaxmem optimize TARGET`.

TARGET is `path/to/file.py:factory` or `package.module:factory`, where `factory()` returns
`(fn, args)`. First, three patterns of the source are rewritten where XLA's total drops and the
values stay (`fitting.rewrites`: differentiated max pools as strided slices and a pairwise max,
an activation's small scaling factors multiplied together first, long
`jax.nn.dot_product_attention` in blocks of queries), each printed as plain JAX to paste;
the order then starts from them. Each stored step is chained after the one before it with
`lax.optimization_barrier`, so XLA follows jaxmem's order; for a GPU preset the orders of
jaxmem's GPU plan and CPU-model plan are both judged and the lower kept (the original when
neither is lower). Prints XLA's total before and after
(XLA:GPU for `--device PRESET`, compiled deviceless; else XLA:CPU, which drops barriers before
its last CSE pass), jaxmem's planned peak, and whether the values are unchanged (run here).

    jaxmem optimize jaxmem.examples.suite:transformer_train --device h100-80gb
    jaxmem optimize my_model.py:make_step --donate 0,1 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxmem.cli import OneLineParser, report_console
from jaxmem.units import format_size


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="jaxmem optimize", description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("target", metavar="TARGET", help="the function to reorder")
    parser.add_argument("--donate", default="", metavar="0,1",
                        help="positional arguments of fn to donate, as jax.jit's donate_argnums")
    parser.add_argument("--device", default=None, metavar="PRESET",
                        help="judge by XLA:GPU for this GPU preset (e.g. h100-80gb), deviceless; default XLA:CPU")
    parser.add_argument("--no-check", action="store_true", help="skip running both to compare values")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _same_values(fn: Any, new: Any, args: tuple) -> bool:
    """As fit judges values (`judge.values_equal`): at f32's tolerance, or at the narrower dtype's
    where the step computes in one (an order with values held in host memory can move where XLA
    rounds a bfloat16 step's values, as a checkpoint can: bf16_train's GPU-plan order)."""
    import jax

    from jaxmem.fitting.judge import compute_dtype, values_equal

    return values_equal(jax.jit(fn)(*args), jax.jit(new)(*args), compute_dtype(fn, args))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from jaxmem.cli.fit import _abstract, _donate, _progress, _render_rewrites
    from jaxmem.compiler.target import jit_donation, load_target
    from jaxmem.fitting.judge import Judge
    from jaxmem.fitting.rewrites import rewrite_first
    from jaxmem.fitting.reorder import reorder, reordered_line

    judge = Judge(args.device)   # an unknown preset is one line before anything is traced
    fn, fn_args = load_target(args.target)
    donate = _donate(args.donate, len(fn_args)) or jit_donation(fn, fn_args)
    with _progress(not args.json and sys.stderr.isatty()) as bar:
        task = bar.add_task("optimize", total=9) if bar is not None else None

        def step(label: str) -> None:
            if bar is not None:
                bar.update(task, description=label, advance=1)

        # First the rewrites of the source that lower XLA's total (max pools whose gradient XLA
        # expands into index arrays, a batch norm's factors, long attention in blocks), each kept only where the values
        # stay; then the order.
        step("original")
        original = judge.total(fn, fn_args, donate)
        rewrites = rewrite_first(fn, fn_args, donate, judge, original, progress=step)
        base = rewrites[-1].fn if rewrites else fn
        result = reorder(base, *fn_args, donate_argnums=donate, device=args.device, progress=step,
                         before=rewrites[-1].xla_total_bytes if rewrites else original)
    same = None if args.no_check or _abstract(fn_args) else _same_values(fn, result.fn, fn_args)
    saved = original - result.xla_total_bytes_after
    gap = original - result.planned_peak_bytes
    data = {"target": args.target, "judge": result.judge, "planned_peak_bytes": result.planned_peak_bytes,
            "xla_total_bytes_before": original,
            "rewrites": [{"kind": r.kind, "xla_total_bytes": r.xla_total_bytes, "values_equal": r.values_equal,
                          "extra_flops": r.extra_flops, "code": r.lines} for r in rewrites],
            "xla_total_bytes_after": result.xla_total_bytes_after, "saved_bytes": saved,
            "share_of_gap": round(saved / gap, 4) if gap > 0 else 0.0, "chained_steps": result.chained_steps,
            "steps": result.steps, "order": result.order, "candidates": result.candidates,
            "offloaded_bytes": result.offloaded_bytes,
            "extra_flops": rewrites[-1].extra_flops if rewrites else 0,
            "values_unchanged": same, "apply": None if result.order == "original" else
            reordered_line(getattr(fn, "__name__", "step"), result.order, donate, args.device)}
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    from jaxmem.reports.escape import markup
    console = report_console(highlight=False)
    what = "reordering alone" if not rewrites else "source rewrites, then reordering"
    if result.offloaded_bytes:
        what += ", with values held in host memory between uses"
    console.print(f"jaxmem optimize {markup(args.target)}: {what}, judged by {result.judge}")
    console.print(f"  jaxmem's plan:        {format_size(result.planned_peak_bytes)}")
    console.print(f"  XLA total, original:  {format_size(original)}")
    _render_rewrites(console, rewrites, result.judge, original)
    # jaxmem's plan holds every value on the device; an order with host copies can go below it
    share = (f"{100 * data['share_of_gap']:.0f}% of the gap to the plan"
             if result.xla_total_bytes_after >= result.planned_peak_bytes
             else "below the plan, which holds every value on the device")
    console.print(f"  XLA total, reordered: {format_size(result.xla_total_bytes_after)} "
                  f"({format_size(saved)} saved, {share}; "
                  f"0 extra FLOPs for the order; {result.chained_steps} of {result.steps} steps chained)")
    tried = ", ".join(f"{name} {format_size(total)}" for name, total in result.candidates.items())
    console.print(f"  order kept: {result.order} (XLA total per order tried: {tried})")
    if result.offloaded_bytes:
        console.print(f"  held in pinned host memory between uses: {format_size(result.offloaded_bytes)} "
                      f"(copied out and back, tied into the order)")
    if same is not None:
        console.print(f"  values unchanged: {'yes' if same else '[red]no[/red]'}")
    if data["apply"]:
        console.print(f"  to run it in this order in your code: {markup(data['apply'])}")
    if result.judge == "XLA:CPU":
        console.print("  note: XLA:CPU removes optimization barriers before its last CSE pass, so the order "
                      "is not enforced there; use --device for a GPU")
    return 0
