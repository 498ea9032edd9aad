"""Figures and seconds of the GPU planning path, for checking a speed change and timing it.

    PYTHONPATH=src .venv/bin/python benchmarks/check_gpu_planner.py --out figures.json
    PYTHONPATH=src .venv/bin/python benchmarks/check_gpu_planner.py --compare a.json b.json
    .venv/bin/python benchmarks/check_gpu_planner.py --ab OLD_SRC NEW_SRC --programs transformer_train_12

Per program of `jaxmem.examples.suite.ALL_PROGRAMS`: the CPU-model plan's peak and validity,
the GPU plan's (`xla.gpu.model.predict.plan_on_gpu`) and, per device, every field of `xla.gpu.model.predict.predict`'s
`Prediction` but its seconds. A speed change must leave these byte-for-byte equal (`--compare`).

With `--repeat N` it also times the path the planning bench counts, apart from JAX's trace:
CPU-model plan + GPU plan + one prediction per device, each repeat on a freshly traced jaxpr
(no cache from an earlier repeat helps), the minimum of N kept; wall seconds per stage and CPU
seconds of the whole (steadier on a shared machine). `--ab` runs this script on two
source trees in alternation, in fresh processes, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEVICES = ("h100-80gb", "a100-40gb")


def figures_and_seconds(name: str, repeat: int) -> dict:
    """One program's figures (from the first repeat) and its best seconds per stage."""
    from jaxmem.compiler import jaxpr_adapter as ja
    from jaxmem.compiler.planner import plan_jaxpr
    from jaxmem.examples.suite import ALL_PROGRAMS
    from jaxmem.xla.gpu.model.predict import plan_on_gpu, predict

    program = ALL_PROGRAMS[name]
    out: dict = {}
    best: dict[str, float] = {}
    for k in range(max(1, repeat)):
        # a new function object: JAX's trace cache (per function) and jaxmem's caches (per
        # jaxpr object) miss, so each repeat does all the work
        fn, args = program.factory()
        traced = ja.trace(fn, args, {}, program.donate_argnums)
        donated = [i in traced.donated for i in range(len(traced.in_avals))]
        t0, c0 = time.perf_counter(), time.process_time()
        cpu_plan = plan_jaxpr(traced.closed_jaxpr, donated=donated)
        t1 = time.perf_counter()
        gpu_plan = plan_on_gpu(cpu_plan)
        t2 = time.perf_counter()
        preds = {}
        for device in DEVICES:
            preds[device] = predict(traced.closed_jaxpr, donated=donated, device=device)
        t3, c3 = time.perf_counter(), time.process_time()
        # wall seconds per stage; and the CPU seconds of all of it, which another job on a
        # shared machine disturbs less than the wall clock
        times = {"cpu_plan": t1 - t0, "gpu_plan": t2 - t1, "predict": t3 - t2, "total": t3 - t0,
                 "cpu_seconds": c3 - c0}
        for key, s in times.items():
            best[key] = min(best.get(key, s), s)
        if k == 0:
            out = {"cpu_plan": cpu_plan.peak_bytes, "cpu_valid": bool(cpu_plan.valid),
                   "gpu_plan": gpu_plan.peak_bytes, "gpu_valid": bool(gpu_plan.valid),
                   "gpu_scheduler": gpu_plan.scheduler}
            for device, p in preds.items():
                out[device] = {"argument": p.argument_bytes, "output": p.output_bytes, "temp": p.temp_bytes,
                               "alias": p.alias_bytes, "total": p.total_bytes, "scheduler": p.scheduler,
                               "fused_values": p.fused_values, "arguments": p.arguments, "outputs": p.outputs}
    return {"figures": out, "seconds": best}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p))["figures"] for p in (a_path, b_path))
    bad = [n for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
    for n in bad:
        print(f"DIFFERENT {n}:\n  {a.get(n)}\n  {b.get(n)}")
    print(f"{len(set(a) & set(b)) - len(bad)} programs equal, {len(bad)} different")
    return 1 if bad else 0


def ab(old_src: str, new_src: str, names: list[str], rounds: int, repeat: int) -> None:
    """Old and new in alternation, `rounds` processes each; min over all their repeats."""
    best: dict[str, dict[str, dict[str, float]]] = {"old": {}, "new": {}}
    for _ in range(rounds):
        for label, src in (("old", old_src), ("new", new_src)):
            env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu")
            cmd = [sys.executable, __file__, "--repeat", str(repeat), "--programs", ",".join(names), "--out", "-"]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            for n, r in res["seconds"].items():
                mine = best[label].setdefault(n, {})
                for key, s in r.items():
                    mine[key] = min(mine.get(key, s), s)
    print("| program | old wall s | new wall s | old CPU s | new CPU s | old wall: CPU-model plan / GPU plan / "
          "2 predictions | new |")
    print("|---|---:|---:|---:|---:|---|---|")
    for n in names:
        o, w = best["old"][n], best["new"][n]
        parts = lambda d: f"{d['cpu_plan']:.3f} / {d['gpu_plan']:.3f} / {d['predict']:.3f}"
        print(f"| {n} | {o['total']:.3f} | {w['total']:.3f} | {o.get('cpu_seconds', float('nan')):.3f} | "
              f"{w.get('cpu_seconds', float('nan')):.3f} | {parts(o)} | {parts(w)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="", help="comma-separated names (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="timed repeats per program (min kept)")
    parser.add_argument("--out", default="", help="write the JSON here ('-': stdout)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files' figures")
    parser.add_argument("--ab", nargs=2, metavar=("OLD_SRC", "NEW_SRC"), help="time two source trees")
    parser.add_argument("--rounds", type=int, default=3, help="with --ab: processes per tree")
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.ab:
        from jaxmem.examples.suite import ALL_PROGRAMS  # only the names

        names = [n for n in args.programs.split(",") if n] or list(ALL_PROGRAMS)
        ab(args.ab[0], args.ab[1], names, args.rounds, args.repeat)
        return
    from jaxmem.examples.suite import ALL_PROGRAMS

    names = [n for n in args.programs.split(",") if n] or list(ALL_PROGRAMS)
    result = {"figures": {}, "seconds": {}}
    for name in names:
        r = figures_and_seconds(name, args.repeat)
        result["figures"][name] = r["figures"]
        result["seconds"][name] = r["seconds"]
        if args.out != "-":
            print(f"{name}: {r['seconds']['total']:.3f} s", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1, sort_keys=True, default=str)
    if args.out == "-":
        print(text)
    elif args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
