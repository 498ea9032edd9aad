"""Every framework's step against the program the framework itself compiles, and against a TPU
v5e: the evaluation set and the tuning set of `benchmarks/framework_steps`, each read by jaxmem
from what a user hands `jaxmem.analyze`.

Per step: XLA:CPU's figures of jaxmem's program against XLA:CPU's `memory_analysis()` of the
framework's own compile (here); jaxmem's deviceless XLA:TPU figures against the chip's
`memory_analysis()`, and the TPU runtime's peak over 3 steps against the chip's
`peak_bytes_in_use + peak_bytes_reserved` (from `benchmarks/results/tpu_v5e_frameworks.jsonl`,
recorded by `benchmarks/tpu_chip_frameworks.py`; the last row of a step wins); where the user's
loop held more than the step (`results/tpu_v5e_loop_holds.jsonl`, `benchmarks/tpu_chip_loop_holds.py`),
also against the peak of the same loop with the first state released and each step waited for.
One JSON line per step, then a table.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_framework_steps.py --out benchmarks/results/framework_steps_compare.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "framework_steps"))
os.environ.setdefault("KERAS_BACKEND", "jax")
FIGURES = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


def chip_rows(path: str) -> dict[str, dict]:
    rows = {}
    for line in open(path, encoding="utf-8"):
        row = json.loads(line)
        if row.get("ok"):
            rows[row["program"]] = row
    return rows


def waited_loop_peaks(path: str) -> dict[str, int]:
    """The chip's peak (in use + reserved) of each step's loop that released its first state and
    waited for each step, where one was recorded."""
    peaks = {}
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            row = json.loads(line)
            if row.get("loop") == "released, each step waited for":
                peaks[row["program"]] = row["peak_bytes_in_use"] + row["peak_bytes_reserved"]
    return peaks


def compare(name: str, chip: dict | None, waited: int | None = None) -> dict:
    from jaxmem.xla.cpu.compile import reference_from_lowered
    from steps import figures, jaxmem_program, load, tpu_figures_and_pool

    started = time.perf_counter()
    module = load(name)
    truth = figures(module.lowered().compile().memory_analysis())
    program = jaxmem_program(name)
    ref = reference_from_lowered(program.lower_for("cpu"))
    row = {"step": name, "set": name.split("/")[0], "framework": module.FRAMEWORK, "read_as": program.framework,
           "cpu_equal": {k: int(getattr(ref, k)) for k in FIGURES} == truth, "cpu_truth": truth}
    if chip is not None:
        tpu, pool = tpu_figures_and_pool(name, factory_on_chip="placed" not in chip["stats"])
        mine = {k: int(getattr(tpu, k)) for k in (*FIGURES, "generated_code_bytes")}
        row.update({"tpu_equal": mine == chip["memory_analysis"], "tpu": mine, "chip": chip["memory_analysis"],
                    "pool_peak_bytes": pool.peak_bytes, "chip_peak_bytes": chip["chip_peak_bytes"],
                    "pool_over_chip": round(pool.peak_bytes / chip["chip_peak_bytes"], 4),
                    "objects_made": "on the host" if "placed" in chip["stats"] else "on the chip"})
        if waited:
            row.update({"chip_waited_loop_peak_bytes": waited, "pool_over_waited_loop": round(pool.peak_bytes / waited, 4)})
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main() -> int:
    from steps import names

    parser = argparse.ArgumentParser()
    parser.add_argument("--set", default="both", choices=("eval", "tuning", "both"))
    parser.add_argument("--recording", default=os.path.join(HERE, "results", "tpu_v5e_frameworks.jsonl"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    chip = chip_rows(args.recording)
    waited = waited_loop_peaks(os.path.join(os.path.dirname(args.recording), "tpu_v5e_loop_holds.jsonl"))
    rows = []
    for name in names(args.set):
        row = compare(name, chip.get(name), waited.get(name))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'step':38s} {'read as':9s} {'XLA:CPU':8s} {'XLA:TPU':8s} {'pool/chip':>9s}  objects made; pool / the waited loop's peak")
    for r in rows:
        tpu = "" if "tpu_equal" not in r else ("equal" if r["tpu_equal"] else "DIFFERS")
        print(f"{r['step']:38s} {r['read_as']:9s} {'equal' if r['cpu_equal'] else 'DIFFERS':8s} {tpu:8s} "
              f"{r.get('pool_over_chip', ''):>9}  {r.get('objects_made', '')}  {r.get('pool_over_waited_loop', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
