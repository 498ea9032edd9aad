"""What a TPU v5e did with the framework steps: `benchmarks/results/tpu_v5e_frameworks.jsonl`,
recorded on the chip by `benchmarks/tpu_chip_frameworks.py`."""

from __future__ import annotations

import json
from pathlib import Path

CHIP = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tpu_v5e_frameworks.jsonl"


def chip_rows() -> dict[str, dict]:
    """The chip's row for each step it ran: the latest line wins (a step re-run with its objects
    built on the host before they went to the chip replaces the first reading)."""
    rows: dict[str, dict] = {}
    for line in CHIP.read_text().splitlines():
        row = json.loads(line)
        if row.get("ok"):
            rows[row["program"]] = row
    return rows
