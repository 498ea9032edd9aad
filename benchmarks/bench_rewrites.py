"""fit's source rewrites on the suite and on models outside it: XLA's total as written and with
each rewrite kept (`fitting.rewrites.rewrite_first`: max pools as strided slices and a pairwise
max, an activation's small scaling factors multiplied first, long attention in blocks of
queries), the rewrite's FLOPs against the step's, and whether its values equal the step's (run
here on XLA:CPU). One row per program and judge; a program with no site is a row that says so
(the rewrites must not touch it).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_rewrites.py                    # every program
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_rewrites.py --programs convnet_bn_train,resnet_flax:make@0,1,2 --judges h100-80gb
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
from jaxmem.examples.suite import ALL_PROGRAMS  # noqa: E402
from jaxmem.fitting.attention import attention_sites  # noqa: E402
from jaxmem.fitting.judge import Judge  # noqa: E402
from jaxmem.fitting.pools import pool_sites  # noqa: E402
from jaxmem.fitting.rewrites import rewrite_first  # noqa: E402
from jaxmem.fitting.scales import scale_sites  # noqa: E402

MiB = 2 ** 20
JUDGES = ("h100-80gb", "a100-40gb", "cpu")


def load(program: str):
    """A suite program by name, or an outside model as module:factory[@donated]."""
    if ":" not in program:
        prog = ALL_PROGRAMS[program]
        fn, args = prog.factory()
        return fn, args, tuple(prog.donate_argnums)
    import importlib

    target, _, donate = program.partition("@")
    module, _, factory = target.partition(":")
    fn, args = getattr(importlib.import_module(module), factory)()
    return fn, args, tuple(int(d) for d in donate.split(",") if d)


def run(program: str, judge_name: str) -> dict:
    fn, args, donate = load(program)
    judge = Judge(None if judge_name == "cpu" else judge_name)
    started = time.perf_counter()
    pools, scales, calls = pool_sites(fn, args), scale_sites(fn, args), attention_sites(fn, args)
    sited = bool(pools or scales or calls)
    before = judge.total(fn, args, donate) if sited else None   # no site: nothing compiled
    kept = rewrite_first(fn, args, donate, judge, before) if sited else []
    base = kept[0].flops - kept[0].extra_flops if kept else 1
    return {"program": program, "judge": judge.name, "pool_lines": len(pools), "scale_lines": len(scales),
            "attention_lines": len(calls),
            "before": before, "kept": [{"kind": k.kind, "total": k.xla_total_bytes, "flops": k.extra_flops / base,
                                        "equal": k.values_equal} for k in kept],
            "seconds": round(time.perf_counter() - started, 1)}


def table(rows: list[dict]) -> str:
    out = ["| program | judge | sites (pools / scales / attention) | XLA total as written | kept: rewrite -> total (FLOPs, values) | after / before |",
           "|---|---|---|---:|---|---:|"]
    for r in rows:
        kept = "; ".join(f"{k['kind']} -> {k['total'] / MiB:.1f} ({100 * k['flops']:+.1f}%, "
                         f"{'equal' if k['equal'] else 'not run' if k['equal'] is None else 'differ'})"
                         for k in r["kept"]) or "none"
        if r["before"] is None:
            out.append(f"| {r['program']} | {r['judge']} | 0 / 0 / 0 | | no site: untouched | |")
            continue
        after = r["kept"][-1]["total"] if r["kept"] else r["before"]
        out.append(f"| {r['program']} | {r['judge']} | {r['pool_lines']} / {r.get('scale_lines', 0)} / {r['attention_lines']} "
                   f"| {r['before'] / MiB:.1f} | {kept} | {after / r['before']:.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--programs", default="", help="comma-separated suite names or module:factory[@donate]")
    parser.add_argument("--judges", default=",".join(JUDGES))
    parser.add_argument("--out", default=None, help="append one JSON line per row")
    parser.add_argument("--table", default=None, metavar="JSONL", help="print the table of a results file")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    # "a:b@0,1,c" splits on commas inside the donation too: rejoin the digits to their model.
    programs: list[str] = []
    for part in args.programs.split(","):
        if part.isdigit() and programs and "@" in programs[-1]:
            programs[-1] += "," + part
        elif part:
            programs.append(part)
    if not programs:
        programs = [n for n, p in ALL_PROGRAMS.items() if p.kind == "training"] + list(MODELS)
    rows = []
    for program in programs:
        for judge in args.judges.split(","):
            try:
                row = run(program, judge)
            except Exception as err:  # noqa: BLE001 - a row says what failed rather than stopping the run
                row = {"program": program, "judge": judge, "error": f"{type(err).__name__}: {str(err)[:200]}"}
                print(json.dumps(row), file=sys.stderr, flush=True)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
