"""Held-out evaluation of jaxmem's XLA:GPU memory model: prediction against XLA:GPU on models it was never tuned on.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_heldout.py --set eval --out benchmarks/results/heldout_before.jsonl
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_heldout.py --set tuning --out benchmarks/results/heldout_tuning_before.jsonl
    .venv/bin/python benchmarks/bench_heldout.py --set eval --models moe_top2_scatter:make --devices h100-80gb

Two sets: `eval`, the held-out training steps of `benchmarks/heldout_models/` (every module's
`make`; never used to tune `jaxmem.xla.gpu_model`), and `tuning`, the 23 models of
`benchmarks/outside_models/` the model was tuned on (`bench_outside_models.MODELS`). Each model
and device runs as `bench_outside_models` runs it: one `jaxmem analyze MODEL --device D --xla gpu
--json` process (XLA:GPU deviceless), and the row gives XLA:GPU's total bytes
(`xla_gpu.total_bytes`), jaxmem's prediction of it (`predicted_xla_bytes`), their ratio and
whether it is within 5%. A table per set, a summary line per set and device (how many within
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


def split_models(text: str) -> list[str]:
    """Comma-separated models; "@0,1" holds a comma, so a digits-only piece rejoins the model before it."""
    joined: list[str] = []
    for m in (m for m in text.split(",") if m):
        if joined and "@" in joined[-1] and m.isdigit():
            joined[-1] += "," + m
        else:
            joined.append(m)
    return joined


def run_set(name: str, models: list[str], devices: list[str], models_dir: str, out) -> None:
    print(f"\n== {name} set: {len(models)} models, devices {', '.join(devices)}")
    print(f"{'model':32s} {'device':10s} {'XLA:GPU bytes':>14s} {'predicted':>14s} {'ratio':>7s} "
          f"{'<=5%':>5s} {'s':>6s}", flush=True)
    stats = {d: {"ok": 0, "n": 0, "errors": 0, "worst": None} for d in devices}
    for model in models:
        for device in devices:
            r = run(model, device, models_dir)
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
    parser.add_argument("--set", choices=("eval", "tuning", "both"), default="both")
    parser.add_argument("--devices", default=",".join(DEVICES), help="comma-separated device presets")
    parser.add_argument("--models", default="", help="comma-separated module:factory[@donate] (default: all of the set)")
    parser.add_argument("--out", default="", help="JSON-lines file for the rows")
    args = parser.parse_args()
    devices = [d for d in args.devices.split(",") if d]
    sets = ("eval", "tuning") if args.set == "both" else (args.set,)
    out = open(args.out, "w") if args.out else None
    try:
        for name in sets:
            default = eval_models() if name == "eval" else list(TUNING_MODELS)
            models = split_models(args.models) if args.models else default
            run_set(name, models, devices, EVAL_DIR if name == "eval" else TUNING_DIR, out)
    finally:
        if out is not None:
            out.close()


if __name__ == "__main__":
    main()
