"""fit's lower bounds on every suite training step against its half-temp budget (XLA:GPU H100,
deviceless): the bound over every checkpoint policy and order, the same bound with offload
policies included (`lower_bound(host_offload=True)`), and whether each proves the budget
infeasible. Budgets and floors (XLA's arguments + outputs - aliases) come from one compile of
each step as written; no candidate is compiled. The step as written is one of the variants
the bounds cover, so each bound must be at or below its XLA total (column `as written`): with
`--outside`, the same over the models of `benchmarks/outside_models`, a check of soundness on
code the bounds were not written against.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_bounds.py
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_bounds.py --programs scanned_checkpoint_train,moe_train --device a100-40gb
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_bounds.py --outside
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: deviceless XLA:GPU compiles

import argparse
import json
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "outside_models"))

from bench_outside_models import MODELS  # noqa: E402
from bench_rewrites import load  # noqa: E402  (a suite program, or an outside model as module:factory[@donated])
from jaxmem.examples.suite import ALL_PROGRAMS  # noqa: E402
from jaxmem.fitting.bound import offload_may_escape, lower_bound  # noqa: E402
from jaxmem.fitting.judge import Judge  # noqa: E402

MiB = 2 ** 20


def training_steps() -> list[str]:
    return [name for name, p in ALL_PROGRAMS.items() if p.kind == "training"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default=",".join(training_steps()))
    ap.add_argument("--outside", action="store_true", help="the models of benchmarks/outside_models instead")
    ap.add_argument("--device", default="h100-80gb")
    ap.add_argument("--out", help="append one JSON row per program to this file")
    args = ap.parse_args()
    judge = Judge(args.device)
    names = args.programs.split(",")
    if args.outside:
        names = list(MODELS)
    print(f"{'program':28s} {'as written':>10s} {'budget':>9s} {'bound':>9s} {'offload':>9s}  verdict "
          f"(MiB; XLA:GPU {args.device})")
    unsound = 0
    for name in names:
        fn, fargs, donate = load(name)
        figures = judge.figures(fn, fargs, donate)
        started = time.perf_counter()
        plain = lower_bound(fn, fargs, donate, figures.floor)
        offload = lower_bound(fn, fargs, donate, figures.floor, host_offload=True)
        seconds = time.perf_counter() - started
        budget = figures.half_temp
        if offload.bytes > budget:
            verdict = "infeasible, host offload included"
        elif plain.bytes > budget:
            verdict = "infeasible without host offload" if offload_may_escape(plain) else "infeasible"
        else:
            verdict = "not proven"
        if plain.bytes > figures.total:   # the step as written is below its own bound: unsound
            unsound += 1
            verdict += f"; UNSOUND: above the step as written ({plain.describe()})"
        print(f"{name:28s} {figures.total / MiB:10.2f} {budget / MiB:9.2f} {plain.bytes / MiB:9.2f} "
              f"{offload.bytes / MiB:9.2f}  {verdict} ({seconds:.1f} s)", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"program": name, "judge": f"XLA:GPU {args.device}", "total": figures.total,
                                    "budget": budget,
                                    "floor": figures.floor, "bound": plain.bytes, "offload_bound": offload.bytes,
                                    "verdict": verdict, "line": offload.describe(), "seconds": round(seconds, 2)}) + "\n")


    print(f"{len(names) - unsound} of {len(names)} bounds at or below the step as written")


if __name__ == "__main__":
    main()
