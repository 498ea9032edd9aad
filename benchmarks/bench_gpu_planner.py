"""Planning for the GPU: jaxmem's model of XLA:GPU and its GPU-target plan against XLA:GPU.

    .venv/bin/python benchmarks/bench_gpu_planner.py                    # every suite program
    .venv/bin/python benchmarks/bench_gpu_planner.py --programs moe_train,mlp_train

For each program of `jaxmem.examples.suite.ALL_PROGRAMS` (with its donation), on h100-80gb and
a100-40gb: XLA:GPU's total (`jaxmem.xla.gpu.compile`, deviceless; the compile seconds are those of the
compile that filled the cache, or of this run's), `predicted_xla_bytes` (`xla.gpu.model.predict.predict`)
and its ratio to XLA:GPU's, jaxmem's GPU-target plan (`xla.gpu.model.predict.plan_on_gpu`: the lower of the
CPU-model and GPU-model plans, checked) and its ratio, and the seconds of the plans and
predictions against the compile's (`lowered.compile()` alone).

ours s: jaxmem's own work for both devices, JAX's trace apart: the CPU-model plan, the GPU plan
and the predictions for both devices (they share their device-independent work, so the whole is
set against each device's compile), the least of `--repeat` runs (3), each on a freshly traced
jaxpr so that no cache carries over. trace s: JAX's trace to a jaxpr (`jax.make_jaxpr`), which
XLA's path needs too, the least of the same runs; the summary also counts the programs within
10% with it added. Beside them, the same against XLA:CPU (compiled here): its total and
jaxmem's CPU-model plan over it. Geometric means of plan/XLA over the training steps at the end.
Wall seconds on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import math
import time

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.planner import plan_jaxpr
from jaxmem.examples.suite import ALL_PROGRAMS
from jaxmem.xla.cpu.compile import xla_reference
from jaxmem.xla.gpu.compile import xla_gpu_reference
from jaxmem.xla.gpu.model.predict import plan_on_gpu, predict

DEVICES = ("h100-80gb", "a100-40gb")


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def row(name: str, repeat: int) -> dict:
    program = ALL_PROGRAMS[name]
    best: dict[str, float] = {}
    for k in range(max(1, repeat)):
        # a new function object each run: JAX's trace cache and jaxmem's caches (both per
        # object) miss, so every run traces, plans and predicts from scratch
        fn, args = program.factory()
        started = time.perf_counter()
        traced = ja.trace(fn, args, {}, program.donate_argnums)
        donated = [i in traced.donated for i in range(len(traced.in_avals))]
        traced_at = time.perf_counter()
        cpu_plan = plan_jaxpr(traced.closed_jaxpr, donated=donated)
        gpu_plan = plan_on_gpu(cpu_plan)    # the GPU-model plan (the CPU one is reused)
        preds = {device: predict(traced.closed_jaxpr, donated=donated, device=device) for device in DEVICES}
        done = time.perf_counter()
        for key, seconds in (("trace", traced_at - started), ("ours", done - traced_at)):
            best[key] = min(best.get(key, seconds), seconds)
        if k == 0:
            out = {"name": name, "kind": program.kind, "cpu_plan": cpu_plan.peak_bytes,
                   "gpu_plan": gpu_plan.peak_bytes, "valid": bool(gpu_plan.valid and cpu_plan.valid)}
            for device in DEVICES:
                ref = xla_gpu_reference(program.target, device=device, donate_argnums=program.donate_argnums, top=0)
                out[device] = {"xla": ref.total_bytes, "pred": preds[device].total_bytes,
                               "compile": ref.compile_seconds}
            out["xla_cpu"] = xla_reference(fn, args, donate_argnums=program.donate_argnums).total_bytes
    # both plans and both devices' predictions, against each device's compile alone: the
    # predictions share their device-independent work, so the whole is counted for each
    out["trace"], out["ours"] = best["trace"], best["ours"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="", help="comma-separated names (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of trace + plans + predictions (min kept)")
    args = parser.parse_args()
    names = [n for n in args.programs.split(",") if n] or list(ALL_PROGRAMS)
    rows = []
    print("| program | XLA:GPU H100 | predicted (ratio) | plan (ratio) | ours s / compile s | XLA:GPU A100 | "
          "predicted (ratio) | plan (ratio) | ours s / compile s | trace s | XLA:CPU | CPU plan (ratio) | valid |")
    print("|---|" + "---:|" * 12 + "---|")
    for name in names:
        r = row(name, args.repeat)
        rows.append(r)
        cells = [name]
        for device in DEVICES:
            d = r[device]
            cells += [mib(d["xla"]), f"{mib(d['pred'])} ({d['pred'] / d['xla']:.3f})",
                      f"{mib(r['gpu_plan'])} ({r['gpu_plan'] / d['xla']:.3f})",
                      f"{r['ours']:.2f} / {d['compile']:.1f}"]
        cells += [f"{r['trace']:.2f}", mib(r["xla_cpu"]), f"{mib(r['cpu_plan'])} ({r['cpu_plan'] / r['xla_cpu']:.3f})",
                  "yes" if r["valid"] else "NO"]
        print("| " + " | ".join(cells) + " |", flush=True)

    def geomean(values):
        values = list(values)
        return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")

    training = [r for r in rows if r["kind"] == "training"]
    for device in DEVICES:
        within = sum(1 for r in rows if abs(r[device]["pred"] / r[device]["xla"] - 1) <= 0.05)
        below = sum(1 for r in rows if r["gpu_plan"] <= r[device]["xla"])
        fast = sum(1 for r in rows if r["ours"] <= 0.1 * r[device]["compile"])
        # JAX traces before XLA compiles too, and compile s counts the compile alone
        traced = sum(1 for r in rows if r["ours"] + r["trace"] <= 0.1 * r[device]["compile"])
        print(f"{device}: prediction within 5% on {within}/{len(rows)}; plan at or below XLA:GPU on "
              f"{below}/{len(rows)}; plans + predictions within 10% of the compile's time on {fast}/{len(rows)} "
              f"({traced}/{len(rows)} with JAX's trace added); "
              f"geomean plan/XLA:GPU over {len(training)} training steps "
              f"{geomean(r['gpu_plan'] / r[device]['xla'] for r in training):.3f}")
    print(f"XLA:CPU: geomean CPU plan/XLA:CPU over training steps "
          f"{geomean(r['cpu_plan'] / r['xla_cpu'] for r in training):.3f}")


if __name__ == "__main__":
    main()
