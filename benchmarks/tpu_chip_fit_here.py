"""`jaxmem.fit` where the user is: in the process that holds a TPU v5e, on a step that does not
fit the chip as written (a 16-layer tanh MLP, width 4096, batch 98304, float32, SGD, donated
weights). The step is first run on the chip (its refusal is the measurement), then fit judges
its candidates by XLA:TPU (each compiled deviceless in a child, as `jaxmem.analyze` compiles),
and its answer is run for 3 steps right there, with the chip's `memory_stats()`. One JSON line.

    . benchmarks/tpu_chip_setup.sh
    python3 benchmarks/tpu_chip_fit_here.py > $OUT/fit_here.jsonl
    # here, without a chip (the search only, on abstract arguments):
    .venv/bin/python benchmarks/tpu_chip_fit_here.py --abstract
"""

from __future__ import annotations

import argparse
import json
import time

LAYERS, WIDTH, BATCH = 16, 4096, 98304


def step(ws, x):
    import jax
    import jax.numpy as jnp

    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    grads = jax.grad(loss)(ws)
    return [w - 0.01 * g for w, g in zip(ws, grads)]


def arguments(abstract: bool) -> tuple[list, object]:
    import jax
    import jax.numpy as jnp

    if abstract:
        return ([jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * LAYERS,
                jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32))
    keys = jax.random.split(jax.random.key(0), LAYERS + 1)
    ws = [jax.random.normal(k, (WIDTH, WIDTH), jnp.float32) / WIDTH ** 0.5 for k in keys[:-1]]
    return ws, jax.random.normal(keys[-1], (BATCH, WIDTH), jnp.float32)


def run_steps(fn, ws, x, steps: int) -> dict:
    import jax

    jitted = jax.jit(fn, donate_argnums=0)
    try:
        for _ in range(steps):
            ws = jitted(ws, x)
        jax.block_until_ready(ws)
        return {"ran": True, "ws": ws}
    except Exception as err:  # the chip's refusal is the measurement
        return {"ran": False, "error": " ".join(str(err).split())[:300]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--abstract", action="store_true")
    args = parser.parse_args()
    import jax

    import jaxmem

    row: dict = {"step": f"tanh MLP {LAYERS}x{WIDTH}, batch {BATCH}, f32", "jax": jax.__version__,
                 "device_kind": jax.devices()[0].device_kind}
    ws, x = arguments(args.abstract)
    if not args.abstract:
        first = run_steps(step, ws, x, 1)
        row["as_written"] = {k: v for k, v in first.items() if k != "ws"}
        ws, x = arguments(False) if not first["ran"] else (first["ws"], x)
    started = time.perf_counter()
    result = jaxmem.fit(step, ws, x, budget="tpu-v5e-16gb", donate_argnums=0, device="tpu-v5e-16gb",
                        source_rewrites=False, progress=lambda text: print("fit:", text, flush=True))
    row["fit"] = {"seconds": round(time.perf_counter() - started, 1), "fits": result.fits,
                  "budget_bytes": result.budget_bytes, "xla_total_bytes_before": result.xla_total_bytes_before,
                  "xla_total_bytes": result.xla_total_bytes, "policy_code": result.policy_code}
    if not args.abstract:
        stats_before = jax.devices()[0].memory_stats() or {}
        answer = run_steps(result.fn, ws, x, 3)
        stats = jax.devices()[0].memory_stats() or {}
        row["answer"] = {k: v for k, v in answer.items() if k != "ws"}
        row["answer"].update({k: stats.get(k) for k in ("peak_bytes_in_use", "peak_bytes_reserved", "bytes_limit")},
                             in_use_before=stats_before.get("bytes_in_use"))
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
