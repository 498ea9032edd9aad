"""jaxmem's TPU figures, deviceless on this machine, against a real v5e's (the recordings
`benchmarks/tpu_chip.py` made there): XLA:TPU's memory analysis byte for byte, and the pool peak
over 3 training steps against the chip's `peak_bytes_in_use + peak_bytes_reserved`.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_tpu_chip.py
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_tpu_chip.py --recording benchmarks/results/tpu_v5e_chip_compile.jsonl --figures-only

The first recording (`tpu_v5e_chip.jsonl`, 15 programs) ran each step as a training loop holds
it; the second (`tpu_v5e_chip_compile.jsonl`, all 21 programs) is compared on XLA:TPU's figures
only (its loop kept the first step's arguments alive).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import sys

from jaxmem.examples.suite import ALL_PROGRAMS
from jaxmem.xla.tpu import xla_tpu_reference
from jaxmem.xla.tpu_chip import compare, read_recording

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recording", default=os.path.join(HERE, "results", "tpu_v5e_chip.jsonl"))
    parser.add_argument("--figures-only", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'program':28} {'figures':>9} {'code':>10} {'pool peak':>13} {'chip peak':>13} {'ratio':>7}")
    for row in read_recording(args.recording):
        program = ALL_PROGRAMS[row["program"]]
        ref = xla_tpu_reference(program.target, "tpu-v5e-16gb", donate_argnums=program.donate_argnums, top=0)
        if args.figures_only:
            row = {k: v for k, v in row.items() if k != "stats"}
        result = compare(row, ref)
        rows.append(result)
        pool = f"{result['pool_peak_bytes']:13,} {result['chip_peak_bytes']:13,} {result['ratio']:7.4f}" \
            if "ratio" in result else ""
        print(f"{row['program']:28} {'equal' if result['equal'] else 'DIFFER':>9} "
              f"{result['deviceless']['generated_code_bytes']:10,} {pool}", flush=True)
    equal = sum(r["equal"] for r in rows)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(f"figures equal to the chip's: {equal}/{len(rows)}")
    if ratios:
        within = sum(abs(r - 1) <= 0.05 for r in ratios)
        print(f"pool peak within 5% of the chip's: {within}/{len(ratios)} (ratios {min(ratios):.4f}-{max(ratios):.4f})")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
