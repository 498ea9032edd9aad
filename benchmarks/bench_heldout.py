"""Held-out evaluation of jaxmem's XLA:GPU memory model: prediction against XLA:GPU on models it was never tuned on.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_heldout.py --set eval --out benchmarks/results/heldout_before.jsonl
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_heldout.py --set tuning --out benchmarks/results/heldout_tuning_before.jsonl
    .venv/bin/python benchmarks/bench_heldout.py --set eval --models moe_top2_scatter:make --devices h100-80gb
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_heldout.py --set both --predict-only   # seconds, no XLA compile

Two sets: `eval`, the held-out training steps of `benchmarks/heldout_models/` (every module's
`make`; never used to tune `jaxmem.xla.gpu.model.predict`), and `tuning`, the 23 models of
`benchmarks/outside_models/` the model was tuned on (`bench_outside_models.MODELS`). Each model
and device runs as `bench_outside_models` runs it: one `jaxmem analyze MODEL --device D --xla gpu
--json` process (XLA:GPU deviceless), and the row gives XLA:GPU's total bytes
(`xla_gpu.total_bytes`), jaxmem's prediction of it (`predicted_xla_bytes`), their ratio and
whether it is within 5%. `--predict-only` runs no XLA: it predicts in this process and takes
XLA:GPU's totals from the recorded rows (`--xla-from`, by default the two files written before
any change to the model; XLA:GPU's figure does not depend on jaxmem). A table per set, a summary line per set and device (how many within
5%, the worst ratio), and every row as a JSON line to `--out`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_outside_models import DEVICES, MODELS as TUNING_MODELS  # noqa: E402

EVAL_DIR = os.path.join(HERE, "heldout_models")
TUNING_DIR = os.path.join(HERE, "outside_models")


def suite_models() -> list[str]:
    """The 21 suite programs as `module:factory@donated`: the model was tuned on them too."""
    from jaxmem.examples.suite import ALL_PROGRAMS

    return [p.target + ("@" + ",".join(map(str, p.donate_argnums)) if p.donate_argnums else "")
            for p in ALL_PROGRAMS.values()]


def eval_models() -> list[str]:
    """Every module of heldout_models/ as `module:make`, sorted."""
    return [os.path.basename(p)[:-3] + ":make" for p in sorted(glob.glob(os.path.join(EVAL_DIR, "*.py")))
            if not os.path.basename(p).startswith("_")]


def run(model: str, device: str, models_dir: str) -> dict:
    """`jaxmem analyze` on `module:factory[@donated]` from `models_dir` for one device preset (the
    equivalent of `bench_outside_models.run` with the models folder as a parameter)."""
    target, _, donate = model.partition("@")
    cmd = [sys.executable, "-m", "jaxmem", "analyze", target, "--device", device, "--xla", "gpu", "--json"]
    if donate:
        cmd += ["--donate", donate]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join(
        [models_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=models_dir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"model": model, "device": device, "seconds": seconds,
                "error": lines[-1] if lines else f"exit {proc.returncode}"}
    data = json.loads(proc.stdout)
    xla = data["xla_gpu"]["total_bytes"]
    return {"model": model, "device": device, "xla": xla, "predicted": data["predicted_xla_bytes"],
            "plan": data["peak_bytes"], "valid": data["valid"], "seconds": seconds}


RECORDED = [os.path.join(HERE, "results", f)
            for f in ("heldout_before.jsonl", "heldout_tuning_before.jsonl", "heldout_suite_before.jsonl")]


def recorded_xla(paths: list[str]) -> dict[tuple[str, str], int]:
    """XLA:GPU's total per (model, device) from earlier rows of this benchmark."""
    totals: dict[tuple[str, str], int] = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if "xla" in row:
                    totals[row["model"], row["device"]] = row["xla"]
    return totals


def predict_only(model: str, device: str, models_dir: str, xla: dict[tuple[str, str], int]) -> dict:
    """The model's prediction in this process, against the recorded XLA:GPU total."""
    from jaxmem.compiler.planner import plan
    from jaxmem.compiler.target import jit_donation, load_target
    from jaxmem.xla.gpu.model.predict import plan_on_gpu, predict_plan

    if (model, device) not in xla:
        return {"model": model, "device": device, "seconds": 0.0, "error": "no recorded XLA:GPU total"}
    target, _, donate = model.partition("@")
    if models_dir not in sys.path:
        sys.path.insert(0, models_dir)
    started = time.perf_counter()
    try:
        fn, args = load_target(target)
        donated = tuple(int(d) for d in donate.split(",")) if donate else jit_donation(fn, args)
        gp = plan_on_gpu(plan(fn, *args, donate_argnums=donated, xla=False))
        pred = predict_plan(gp, device)
    except Exception as err:  # noqa: BLE001 - the row records what failed, the run goes on
        return {"model": model, "device": device, "seconds": time.perf_counter() - started,
                "error": f"{type(err).__name__}: {err}"[:200]}
    return {"model": model, "device": device, "xla": xla[model, device], "predicted": pred.total_bytes,
            "plan": gp.peak_bytes, "valid": gp.valid, "seconds": time.perf_counter() - started}


def split_models(text: str) -> list[str]:
    """Comma-separated models; "@0,1" holds a comma, so a digits-only piece rejoins the model before it."""
    joined: list[str] = []
    for m in (m for m in text.split(",") if m):
        if joined and "@" in joined[-1] and m.isdigit():
            joined[-1] += "," + m
        else:
            joined.append(m)
    return joined


def run_set(name: str, models: list[str], devices: list[str], models_dir: str, out, xla=None) -> None:
    print(f"\n== {name} set: {len(models)} models, devices {', '.join(devices)}")
    print(f"{'model':32s} {'device':10s} {'XLA:GPU bytes':>14s} {'predicted':>14s} {'ratio':>7s} "
          f"{'<=5%':>5s} {'s':>6s}", flush=True)
    stats = {d: {"ok": 0, "n": 0, "errors": 0, "worst": None} for d in devices}
    for model in models:
        for device in devices:
            r = run(model, device, models_dir) if xla is None else predict_only(model, device, models_dir, xla)
            r["set"] = name
            st = stats[device]
            if "error" in r:
                st["errors"] += 1
                print(f"{model:32s} {device:10s} error: {r['error']}", flush=True)
            else:
                ratio = r["predicted"] / r["xla"]
                within = abs(ratio - 1) <= 0.05
                r["ratio"], r["within_5pct"] = ratio, within
                st["ok"] += within
                st["n"] += 1
                if st["worst"] is None or abs(ratio - 1) > abs(st["worst"][0] - 1):
                    st["worst"] = (ratio, model)
                print(f"{model:32s} {device:10s} {r['xla']:14,d} {r['predicted']:14,d} {ratio:7.3f} "
                      f"{'yes' if within else 'NO':>5s} {r['seconds']:6.1f}", flush=True)
            if out is not None:
                out.write(json.dumps(r) + "\n")
                out.flush()
    for device, st in stats.items():
        worst = f"worst ratio {st['worst'][0]:.3f} ({st['worst'][1]})" if st["worst"] else "no ratio"
        err = f", {st['errors']} failed" if st["errors"] else ""
        print(f"summary {name} {device}: within 5% on {st['ok']}/{st['n']}{err}; {worst}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("eval", "tuning", "suite", "both", "all"), default="both",
                        help="both: eval and tuning; all: eval, tuning and suite")
    parser.add_argument("--devices", default=",".join(DEVICES), help="comma-separated device presets")
    parser.add_argument("--models", default="", help="comma-separated module:factory[@donate] (default: all of the set)")
    parser.add_argument("--out", default="", help="JSON-lines file for the rows")
    parser.add_argument("--predict-only", action="store_true",
                        help="no XLA compile: predict in this process, XLA:GPU's totals from --xla-from")
    parser.add_argument("--xla-from", default=",".join(RECORDED),
                        help="comma-separated JSON-lines files of earlier rows (with --predict-only)")
    args = parser.parse_args()
    xla = recorded_xla(args.xla_from.split(",")) if args.predict_only else None
    if xla is not None:
        os.environ.setdefault("KERAS_BACKEND", "jax")
    devices = [d for d in args.devices.split(",") if d]
    sets = {"both": ("eval", "tuning"), "all": ("eval", "tuning", "suite")}.get(args.set, (args.set,))
    out = open(args.out, "w") if args.out else None
    try:
        for name in sets:
            default = {"eval": eval_models, "suite": suite_models}.get(name, lambda: list(TUNING_MODELS))()
            models = split_models(args.models) if args.models else default
            run_set(name, models, devices, {"eval": EVAL_DIR, "suite": HERE}.get(name, TUNING_DIR), out, xla)
    finally:
        if out is not None:
            out.close()


if __name__ == "__main__":
    main()
