"""jaxmem's TPU figures, deviceless on this machine, against a real v5e's (the recordings
`benchmarks/tpu_chip.py` made on a machine with a TPU v5e): XLA:TPU's memory analysis byte for
byte, and the pool peak over 3 training steps against the chip's `peak_bytes_in_use +
peak_bytes_reserved`.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_tpu_chip.py --set eval
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_tpu_chip.py --set all --out benchmarks/results/tpu_chip_compare.jsonl

Sets: `suite` (`tpu_v5e_chip.jsonl`, 15 of the suite's programs), `tuning`
(`tpu_v5e_tuning.jsonl`, benchmarks/tpu_models/tuning: the cases the TPU rules were checked
and tuned on), `eval` (`tpu_v5e_eval.jsonl`, benchmarks/tpu_models/eval: 20 training steps kept
apart, never tuned on), `all`. `--recording FILE --figures-only` compares another recording on
XLA:TPU's figures only (`tpu_v5e_chip_compile.jsonl`: all 21 suite programs).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import sys

from jaxmem.xla.tpu.compile import xla_tpu_reference
from jaxmem.xla.tpu.chip import compare, loop_programs, read_recording

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = {"suite": "tpu_v5e_chip.jsonl", "tuning": "tpu_v5e_tuning.jsonl", "eval": "tpu_v5e_eval.jsonl"}


def reference(row: dict) -> object:
    """XLA:TPU's figures for a recorded row: a suite program by name, else its TARGET."""
    if ".py:" in row["program"]:
        return xla_tpu_reference(row["program"], "tpu-v5e-16gb", donate_argnums=tuple(row.get("donate", ())), top=0)
    from jaxmem.examples.suite import ALL_PROGRAMS

    program = ALL_PROGRAMS[row["program"]]
    return xla_tpu_reference(program.target, "tpu-v5e-16gb", donate_argnums=program.donate_argnums, top=0)


def run_set(name: str, path: str, figures_only: bool) -> list[dict]:
    rows = []
    print(f"[{name}] {'program':40} {'figures':>9} {'pool peak':>15} {'chip peak':>15} {'ratio':>7}")
    for row in read_recording(path):
        if not row.get("ok") or "memory_analysis" not in row:
            continue
        ref = reference(row)
        if figures_only:
            row = {k: v for k, v in row.items() if k != "stats"}
        result = compare(row, ref, more=loop_programs(row, ref))
        result["set"] = name
        rows.append(result)
        pool = f"{result['pool_peak_bytes']:15,} {result['chip_peak_bytes']:15,} {result['ratio']:7.4f}" \
            if "ratio" in result else ""
        print(f"[{name}] {os.path.basename(row['program']):40} {'equal' if result['equal'] else 'DIFFER':>9} {pool}",
              flush=True)
    equal = sum(r["equal"] for r in rows)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(f"[{name}] figures equal to the chip's: {equal}/{len(rows)}")
    if ratios:
        within = sum(0.98 <= r <= 1.05 for r in ratios)
        print(f"[{name}] pool peak within -2%/+5% of the chip's: {within}/{len(ratios)} "
              f"(ratios {min(ratios):.4f}-{max(ratios):.4f})")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", choices=(*SETS, "all"), default=None)
    parser.add_argument("--recording", default=None)
    parser.add_argument("--figures-only", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.recording:
        todo = [("recording", args.recording)]
    else:
        names = list(SETS) if args.set in (None, "all") else [args.set]
        todo = [(n, os.path.join(HERE, "results", SETS[n])) for n in names]
    rows = [r for name, path in todo for r in run_set(name, path, args.figures_only)]
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
