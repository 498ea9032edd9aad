"""jaxmem's pool prediction beside a recorded run: the peak the pool model gives after 1, 2, 3
steps of the same step on the same device preset, against the device's running peak
(`peak_bytes_in_use + peak_bytes_reserved`) after each recorded call of the step.

    peaks = pool_peaks("train.py:make", "tpu-v5e-16gb", donate="0")   # [after 1, 2, 3 steps]
    rows = beside(summary, peaks)      # step, device peak, predicted, ratio

The prediction is `jaxmem analyze TARGET --device PRESET --steps k --json` (its `pool.peak_bytes`),
run as a command so that it compiles as analyze always does. From step 3 on the pool repeats
step 3, so later steps are set beside the 3-step figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from jaxmem.errors import PlanError

PREDICTED_STEPS = 3


def pool_peaks(target: str, device: str, donate: str | None = None, steps: int = PREDICTED_STEPS,
               timeout: float = 1800) -> list[int]:
    """The pool's peak after 1..`steps` steps of TARGET on the preset `device`, in bytes."""
    peaks = []
    for k in range(1, steps + 1):
        cmd = [sys.executable, "-m", "jaxmem", "analyze", target, "--device", device, "--steps", str(k), "--json"]
        if donate is not None:
            cmd += ["--donate", donate]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise PlanError(f"the prediction for {target} on {device} failed: {last}")
        pool = (json.loads(proc.stdout).get("pool") or {})
        if "peak_bytes" not in pool:
            raise PlanError(f"the prediction for {target} on {device} has no pool (is {device} a device preset?)")
        peaks.append(int(pool["peak_bytes"]))
    return peaks


def beside(summary: dict[str, Any], peaks: list[int], device: str | None = None) -> list[dict[str, Any]]:
    """One row per recorded call of the step program: the device's running peak then, the pool's
    prediction for as many steps, and their ratio (device / prediction).

    >>> s = {"leaks": {"step_program": "step"}, "per_call": [
    ...     {"program": "step", "call": 1, "device": "tpu:0", "peak": 110},
    ...     {"program": "step", "call": 4, "device": "tpu:0", "peak": 121}]}
    >>> [(r["step"], r["predicted"], r["ratio"]) for r in beside(s, [100, 110, 120])]
    [(1, 100, 1.1), (4, 120, 1.008333)]
    """
    step = (summary.get("leaks") or {}).get("step_program")
    rows = []
    for r in summary.get("per_call", []):
        if r.get("program") != step or r.get("peak") is None or (device and r.get("device") != device):
            continue
        n = int(r["call"])
        predicted = peaks[min(n, len(peaks)) - 1]
        rows.append({"step": n, "device": r["device"], "device_peak": int(r["peak"]), "predicted": predicted,
                     "ratio": round(int(r["peak"]) / predicted, 6) if predicted else None})
    return rows
