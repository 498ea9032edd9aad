"""What a TPU v5e did with the framework steps: `benchmarks/results/tpu_v5e_frameworks.jsonl`,
recorded on the chip by `benchmarks/tpu_chip_frameworks.py`."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
CHIP = RESULTS / "tpu_v5e_frameworks.jsonl"
LOOP_HOLDS = RESULTS / "tpu_v5e_loop_holds.jsonl"


def chip_rows() -> dict[str, dict]:
    """The chip's row for each step it ran: the latest line wins (a step re-run with its objects
    built on the host before they went to the chip replaces the first reading)."""
    rows: dict[str, dict] = {}
    for line in CHIP.read_text().splitlines():
        row = json.loads(line)
        if row.get("ok"):
            rows[row["program"]] = row
    return rows


def waited_loop_peaks() -> dict[str, int]:
    """The chip's peak (in use + reserved) of a step's loop run with its first state released and
    each step waited for, for the steps whose own loop held more than the step
    (`benchmarks/tpu_chip_loop_holds.py`)."""
    peaks: dict[str, int] = {}
    for line in LOOP_HOLDS.read_text().splitlines():
        row = json.loads(line)
        if row.get("loop") == "released, each step waited for":
            peaks[row["program"]] = row["peak_bytes_in_use"] + row["peak_bytes_reserved"]
    return peaks
