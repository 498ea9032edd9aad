"""Models outside the suite: `jaxmem analyze --xla gpu` on each of `benchmarks/outside_models/`.

    .venv/bin/python benchmarks/bench_outside_models.py                      # every model, both devices
    .venv/bin/python benchmarks/bench_outside_models.py --models kv_decode:make,decode_loop:make@1

Each model is a training or inference step written as users write them (Flax, optax, Equinox,
KV-cache decoding, loops, 8-bit dots), none of them in the suite or the tests; `module:factory`
returns `(fn, args)`, `@0,1` the arguments donated. Each runs as a user runs it, one
`jaxmem analyze MODEL --device D --xla gpu --json` process per model and device (XLA:GPU
deviceless, its figures cached), and the table gives XLA:GPU's total, jaxmem's prediction of it
(`predicted_xla_bytes`) and jaxmem's own GPU-target plan (`peak_bytes`), each over XLA's, whether
the plan was checked valid, and the command's wall seconds. A model whose command fails is a row
with its one-line error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS_DIR = os.path.join(HERE, "outside_models")
# module:factory[@donated arguments]
MODELS = (
    "vit_adamw:make", "unet:make", "kv_decode:make", "kv_decode:make_inplace@1", "lstm_fori:make",
    "perexample_customvjp:make", "int8_fp8:make", "int8_fp8:make_int4", "fft_model:make", "eqx_mlp:make",
    "dropout_typedkey:make", "nnx_mlp:make", "gpt_scan_remat:make", "cond_switch_topk:make", "while_data:make",
    "gpt2_vocab:make@0,1", "resnet_flax:make@0,1,2", "decode_loop:make@1", "grad_accum:make@0,1",
    "gqa_attention:make", "ensemble_vmap:make@0", "prefill_bf16:make", "fp16_loss_scale:make@0",
)
DEVICES = ("h100-80gb", "a100-40gb")


def run(model: str, device: str) -> dict:
    target, _, donate = model.partition("@")
    cmd = [sys.executable, "-m", "jaxmem", "analyze", target, "--device", device, "--xla", "gpu", "--json"]
    if donate:
        cmd += ["--donate", donate]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [MODELS_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=MODELS_DIR, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"model": model, "device": device, "error": lines[-1] if lines else f"exit {proc.returncode}"}
    data = json.loads(proc.stdout)
    xla = data["xla_gpu"]["total_bytes"]
    return {"model": model, "device": device, "xla": xla, "predicted": data["predicted_xla_bytes"],
            "plan": data["peak_bytes"], "valid": data["valid"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated module:factory[@donate] (default: all)")
    parser.add_argument("--devices", default=",".join(DEVICES))
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m] if args.models else list(MODELS)
    # "@0,1" holds a comma: rejoin a piece that is only digits with the model before it
    joined: list[str] = []
    for m in models:
        if joined and "@" in joined[-1] and m.isdigit():
            joined[-1] += "," + m
        else:
            joined.append(m)
    print(f"{'model':28s} {'device':10s} {'XLA:GPU MiB':>11s} {'predicted':>9s} {'plan':>6s} valid {'s':>5s}")
    within = {d: [0, 0] for d in args.devices.split(",")}
    for model in joined:
        for device in args.devices.split(","):
            r = run(model, device)
            if "error" in r:
                print(f"{model:28s} {device:10s} error: {r['error']}", flush=True)
                continue
            ratio = r["predicted"] / r["xla"]
            within[device][0] += abs(ratio - 1) <= 0.05
            within[device][1] += 1
            print(f"{model:28s} {device:10s} {r['xla'] / 2**20:11.1f} {ratio:9.3f} {r['plan'] / r['xla']:6.3f} "
                  f"{str(r['valid']):5s} {r['seconds']:5.1f}", flush=True)
    for device, (ok, n) in within.items():
        print(f"{device}: prediction within 5% on {ok}/{n}")


if __name__ == "__main__":
    main()
