"""What a real TPU chip does with the suite's programs: the truth jaxmem's TPU verdicts are checked
against. Runs on the machine with the chip (the `device` tool), never in CI.

For each program, in a fresh process (a TPU's peak counters only grow, and one process at a time
holds the chip): the arguments are put on the chip, the step is compiled as `jax.jit` compiles it
(with the program's donation), `compiled.memory_analysis()` is read, and the step runs `--steps`
times as a training loop runs it (`params, opt = step(params, opt, batch)`: an output whose dtype
and shape match an argument's replaces it, in order, as `jaxmem.runtime.steps.match_state` pairs
them), with `device.memory_stats()` read before anything, after the arguments, after the compile
and after every step. One JSON line per program.

    PYTHONPATH=src python benchmarks/tpu_chip.py --out $OUT/chip.jsonl
    PYTHONPATH=src python benchmarks/tpu_chip.py --batch-sizes 16,17,18 --out $OUT/maxbatch.jsonl

`--batch-sizes` runs `jaxmem.examples.gpt:batch_example` at each batch size instead (the maxbatch
check): whether it compiles and runs the steps, and XLA:TPU's message where it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

PROGRAMS = ("mlp_forward", "mlp_train", "mlp_train_donated", "mlp_deep_train", "transformer_forward",
            "transformer_train", "transformer_train_donated", "transformer_wide_train", "transformer_train_12",
            "cnn_forward", "cnn_train", "rnn_scan_grad", "while_cond", "parallel_branches", "moe_train",
            "attention_train", "scanned_transformer_train", "scanned_checkpoint_train", "convnet_bn_train",
            "bf16_train", "long_seq_train")


def _stats(device: Any) -> dict[str, int]:
    return {k: int(v) for k, v in (device.memory_stats() or {}).items() if isinstance(v, (int, float))}


def _materialize(args: Any, device: Any) -> Any:
    """Arrays on the chip, one buffer each; a `ShapeDtypeStruct` becomes zeros there (token ids
    0 are valid)."""
    import jax
    import jax.numpy as jnp

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))()
        return jax.device_put(x, device)

    return jax.tree.map(leaf, args)


def _state_pairs(args: Any, outs: Any) -> dict[int, int]:
    """flat output index -> flat argument index it replaces: first unclaimed argument leaf with the
    same dtype and shape, in output order."""
    import jax

    keys_in = [(str(x.dtype), tuple(x.shape)) for x in jax.tree.leaves(args)]
    claimed: set[int] = set()
    pairs = {}
    for i, out in enumerate(jax.tree.leaves(outs)):
        key = (str(out.dtype), tuple(out.shape))
        for j, k in enumerate(keys_in):
            if j not in claimed and k == key:
                pairs[i] = j
                claimed.add(j)
                break
    return pairs


def run_one(fn: Any, args: Any, donate: tuple[int, ...], steps: int) -> dict[str, Any]:
    """One program on the chip: memory_analysis and memory_stats at each stage."""
    import jax

    device = jax.devices()[0]
    row: dict[str, Any] = {"device_kind": device.device_kind, "jax": jax.__version__, "stats": {}}
    try:
        from importlib.metadata import version

        row["libtpu"] = version("libtpu")
    except Exception:  # the machine's own install may not be a distribution
        row["libtpu"] = ""
    row["stats"]["start"] = _stats(device)
    args = _materialize(args, device)
    jax.block_until_ready(args)
    row["stats"]["arguments"] = _stats(device)
    started = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    row["compile_seconds"] = round(time.perf_counter() - started, 3)
    m = compiled.memory_analysis()
    row["memory_analysis"] = {
        "argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
        "generated_code_bytes": int(m.generated_code_size_in_bytes)}
    row["stats"]["compiled"] = _stats(device)
    flat, tree = jax.tree.flatten(args)
    del args   # the loop holds only the current state, as `params, opt = step(params, opt, batch)` does
    out = None
    for step in range(1, steps + 1):
        out = compiled(*jax.tree.unflatten(tree, flat))
        jax.block_until_ready(out)
        outs = jax.tree.leaves(out)
        for i, j in _state_pairs(flat, outs).items():
            flat[j] = outs[i]
        row["stats"][f"step{step}"] = _stats(device)
    last = row["stats"][f"step{steps}"]
    row["chip_peak_bytes"] = last.get("peak_bytes_in_use", 0) + last.get("peak_bytes_reserved", 0)
    del out
    return row


def child(name: str, steps: int, batch_size: int | None) -> int:
    """One program in this process; prints one JSON line."""
    row: dict[str, Any] = {"program": name, "steps": steps}
    try:
        import jax

        # The factory runs on the host CPU, so that the chip's counters (whose peaks only grow)
        # hold nothing but the step's arguments when the measurement starts.
        with jax.default_device(jax.devices("cpu")[0]):
            if batch_size is not None:
                from jaxmem.examples.gpt import batch_example

                row["batch_size"] = batch_size
                fn, args = batch_example(batch_size)
                donate: tuple[int, ...] = (0, 1)
            else:
                from jaxmem.examples.suite import ALL_PROGRAMS

                program = ALL_PROGRAMS[name]
                fn, args = program.factory()
                donate = program.donate_argnums
        row["donate"] = list(donate)
        row.update(run_one(fn, args, donate, steps))
        row["ok"] = True
    except Exception as err:  # the chip's own failure is the measurement
        row["ok"] = False
        row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:600]}"
    print("ROW " + json.dumps(row), flush=True)
    return 0


def parent(names: list[str], steps: int, out_path: str, batch_sizes: list[int]) -> int:
    jobs = [(n, None) for n in names] if not batch_sizes else [("batch_example", b) for b in batch_sizes]
    with open(out_path, "w", encoding="utf-8") as out:
        for name, batch in jobs:
            cmd = [sys.executable, __file__, "--one", name, "--steps", str(steps)]
            if batch is not None:
                cmd += ["--batch-size", str(batch)]
            for attempt in range(2):   # the chip can refuse a program started just after another
                started = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
                if rows and "lockfile" not in rows[-1]:
                    break
                time.sleep(5)
            if not rows:
                rows = [json.dumps({"program": name, "batch_size": batch, "ok": False,
                                    "error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"})]
            row = json.loads(rows[-1])
            row["wall_seconds"] = round(time.perf_counter() - started, 1)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(name, batch, row.get("ok"), row.get("chip_peak_bytes"), row.get("memory_analysis"),
                  row.get("error", "")[:200], flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", default=None)
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--batch-sizes", default="")
    parser.add_argument("--out", default="chip.jsonl")
    args = parser.parse_args()
    if args.one:
        return child(args.one, args.steps, args.batch_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return parent([n for n in args.programs.split(",") if n], args.steps, args.out, sizes)


if __name__ == "__main__":
    sys.exit(main())
