"""The largest batch a TPU chip compiles and runs for three steps, found on the chip by bisection
(each trial a fresh process of `tpu_chip.py --one TARGET --batch-size B`), within a time budget.

    PYTHONPATH=src python benchmarks/tpu_chip_maxbatch.py TARGET --lo 12 --hi 14 --out $OUT/mb.jsonl

`--lo` is a first guess that fits and `--hi` one that does not; each is tried first, and moved
outward when the chip says otherwise. Every trial is one JSON line (`tpu_chip.py`'s row).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

HERE = __file__.rsplit("/", 1)[0]


def trial(target: str, batch: int, out: str) -> bool:
    cmd = [sys.executable, f"{HERE}/tpu_chip.py", "--one", target, "--batch-size", str(batch), "--steps", "3"]
    for _ in range(2):   # the chip can refuse a process started just after another
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if rows and "lockfile" not in rows[-1]:
            break
        time.sleep(5)
    row = json.loads(rows[-1]) if rows else {"program": target, "batch_size": batch, "ok": False,
                                              "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(target, batch, row.get("ok"), row.get("chip_peak_bytes"), (row.get("error") or "")[:160], flush=True)
    return bool(row.get("ok"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--lo", type=int, required=True)
    parser.add_argument("--hi", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; no trial starts after")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    lo, hi = args.lo, args.hi
    known: dict[int, bool] = {}
    while time.monotonic() < deadline:
        if lo not in known:
            known[lo] = trial(args.target, lo, args.out)
            if not known[lo]:
                hi, lo = lo, max(1, lo - (args.hi - args.lo))
                continue
        if hi not in known:
            known[hi] = trial(args.target, hi, args.out)
            if known[hi]:
                lo, hi = hi, hi + (hi - args.lo)
                continue
        if hi - lo <= 1:
            print(f"{args.target}: largest batch that runs 3 steps: {lo}", flush=True)
            return 0
        mid = (lo + hi) // 2
        known[mid] = trial(args.target, mid, args.out)
        lo, hi = (mid, hi) if known[mid] else (lo, mid)
    print(f"{args.target}: budget spent between {lo} and {hi}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
