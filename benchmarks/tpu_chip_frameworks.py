"""What a TPU v5e does with the framework steps (`benchmarks/framework_steps`): the truth
jaxmem's reading of each framework is held to. Runs on a machine with a TPU v5e, never in CI.

Each step in a fresh process (a chip's peak counters only grow, and one process at a time holds
the chip): the user's own loop first, 3 steps on the chip as the framework runs them
(`module.run`: `nnx.jit` calls, `model.fit`, ...), with `memory_stats()` read before, after
the objects are on the chip and after the loop. The objects are made on the host's CPU and put
on the chip (NNX's split and merge for its graph nodes), so that the chip's peak is the loop's,
not that of an initialization run op by op (a Keras model, `BUILD_ON_DEVICE`, is built on the
chip, as Keras makes its variables where it builds); then the program the framework itself compiles (`module.lowered()`, compiled on the
chip) for its `memory_analysis()`; with `--analyze NAME,...`, also `jaxmem.analyze(fn, *args)`
with no device named, on the arrays the step's factory made on the chip. One JSON line per step.

    . benchmarks/tpu_chip_setup.sh
    python3 benchmarks/tpu_chip_frameworks.py --set eval --analyze eval/nnx_cnn_plain --out $OUT/eval.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "framework_steps"))


def _stats(device: Any) -> dict[str, int]:
    return {k: int(v) for k, v in (device.memory_stats() or {}).items() if isinstance(v, (int, float))}


def child(name: str, steps: int, analyze: bool) -> int:
    """One step in this process; prints one `ROW {json}` line."""
    row: dict[str, Any] = {"program": name, "steps": steps}
    try:
        import jax

        from steps import figures, load, user_call

        device = jax.devices()[0]
        row.update({"device_kind": device.device_kind, "jax": jax.__version__, "stats": {"start": _stats(device)}})
        module = load(name)
        row["framework"] = module.FRAMEWORK
        started = time.perf_counter()
        if getattr(module, "BUILD_ON_DEVICE", False):
            module.loop(steps)
        else:
            with jax.default_device(jax.devices("cpu")[0]):
                objects = module.build()
            objects = place(objects, device)
            row["stats"]["placed"] = _stats(device)
            module.run(objects, steps)
            del objects
        row["loop_seconds"] = round(time.perf_counter() - started, 2)
        row["stats"]["loop"] = _stats(device)
        last = row["stats"]["loop"]
        row["chip_peak_bytes"] = last.get("peak_bytes_in_use", 0) + last.get("peak_bytes_reserved", 0)
        gc.collect()
        compiled = module.lowered().compile()
        analysis = compiled.memory_analysis()
        row["memory_analysis"] = {**figures(analysis),
                                  "generated_code_bytes": int(analysis.generated_code_size_in_bytes)}
        del compiled
        if analyze:
            row["analyze"] = _analyze(user_call(module))
        row["ok"] = True
    except Exception as err:  # the chip's own failure is the measurement
        row["ok"] = False
        row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:600]}"
    print("ROW " + json.dumps(row), flush=True)
    return 0


def place(objects: Any, device: Any) -> Any:
    """`objects` (what a step's `build()` made on the host) with every array on `device`: Flax
    NNX objects through NNX's split and merge (Variables they share stay shared), any other
    pytree leaf by leaf (functions and other static leaves as they are)."""
    import jax
    import numpy as np

    if "flax.nnx" in sys.modules:
        from flax import nnx

        nodes = jax.tree.leaves(objects, is_leaf=lambda x: isinstance(x, (nnx.Module, nnx.Optimizer)))
        if any(isinstance(x, (nnx.Module, nnx.Optimizer)) for x in nodes):
            graphdef, state = nnx.split(objects)
            return nnx.merge(graphdef, jax.device_put(state, device))
    return jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, (jax.Array, np.ndarray)) else x, objects)


def _analyze(call: tuple[Any, tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
    """`jaxmem.analyze(fn, *args)` with no device named, its arguments on the chip."""
    import jaxmem

    fn, args, kwargs = call
    started = time.perf_counter()
    result = jaxmem.analyze(fn, *args, kwargs=kwargs, quiet=True)
    data = result.to_dict()
    return {"device": data["device"]["name"], "chosen_because": data["device"].get("chosen_because"),
            "xla": result.xla, "pool_peak_bytes": (result.pool or {}).get("peak_bytes"),
            "framework": data.get("framework"), "seconds": round(time.perf_counter() - started, 1)}


def parent(names: list[str], steps: int, out_path: str, analyze: set[str]) -> int:
    with open(out_path, "a", encoding="utf-8") as out:
        for name in names:
            cmd = [sys.executable, __file__, "--one", name, "--steps", str(steps)] + (["--analyze-one"] if name in analyze else [])
            started = time.perf_counter()
            for _ in range(2):   # the chip can refuse a program started just after another
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
                if rows and "lockfile" not in rows[-1]:
                    break
                time.sleep(5)
            if not rows:
                rows = [json.dumps({"program": name, "ok": False, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"})]
            row = json.loads(rows[-1])
            row["wall_seconds"] = round(time.perf_counter() - started, 1)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(name, row.get("ok"), row.get("chip_peak_bytes"), row.get("memory_analysis"),
                  (row.get("analyze") or {}).get("device"), row.get("error", "")[:300], flush=True)
    return 0


def main() -> int:
    from steps import names as step_names

    parser = argparse.ArgumentParser()
    parser.add_argument("--one", default=None)
    parser.add_argument("--analyze-one", action="store_true")
    parser.add_argument("--set", default="eval", choices=("eval", "tuning", "both"))
    parser.add_argument("--programs", default="", help="step names (eval/<module>), comma-separated; default: the set")
    parser.add_argument("--analyze", default="", help="steps to also run jaxmem.analyze on, with no device named")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="frameworks.jsonl")
    args = parser.parse_args()
    if args.one:
        return child(args.one, args.steps, args.analyze_one)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    names = [n for n in args.programs.split(",") if n] or step_names(args.set)
    return parent(names, args.steps, args.out, {n for n in args.analyze.split(",") if n})


if __name__ == "__main__":
    sys.exit(main())
