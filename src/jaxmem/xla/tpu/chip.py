"""jaxmem's TPU verdicts against what a real chip did: the recordings of `benchmarks/tpu_chip.py`
(run on a machine with a TPU v5e) read back and compared with XLA:TPU's deviceless
figures and the TPU runtime's rules, program by program. The benchmark and the tests share it.

    rows = read_recording("benchmarks/results/tpu_v5e_chip.jsonl")
    compare(rows[0], xla_tpu_reference(target, "tpu-v5e-16gb", donate_argnums=...), steps=3)
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from jaxmem.errors import ConfigError

FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes")


def read_recording(path: str) -> list[dict[str, Any]]:
    """The chip's rows (one JSON object a line); a malformed file is one `ConfigError` line."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or "program" not in row:
                    raise ConfigError(f"{path}:{number}: not a chip recording row")
                rows.append(row)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read the chip recording {path}: {err}") from None
    return rows


def chip_peak(row: dict[str, Any]) -> int:
    """`peak_bytes_in_use + peak_bytes_reserved` after the recorded steps."""
    last = row["stats"][f"step{row['steps']}"]
    return int(last.get("peak_bytes_in_use", 0)) + int(last.get("peak_bytes_reserved", 0))


def compare(row: dict[str, Any], ref: Any, steps: int | None = None,
            more: Sequence[tuple[Any, dict[int, int]]] = ()) -> dict[str, Any]:
    """One program: XLA:TPU's deviceless figures against the chip's `memory_analysis()`, field by
    field, and jaxmem's pool peak over the recorded number of steps against the chip's. `more`:
    the other programs of a loop the row ran (a train + eval loop), each with its arguments
    that are the first program's state (`runtime.steps.shared_state`)."""
    from jaxmem.accelerators import resolve
    from jaxmem.runtime.steps import program_from_reference
    from jaxmem.runtime.tpu_pool import simulate_tpu_loop

    chip = row["memory_analysis"]
    deviceless = {k: int(getattr(ref, k)) for k in FIELDS}
    out: dict[str, Any] = {"program": row["program"], "deviceless": deviceless, "chip": chip,
                           "equal": all(deviceless[k] == int(chip[k]) for k in FIELDS)}
    for other, _ in more:
        figures = {k: int(getattr(other, k)) for k in FIELDS}
        out["equal"] = out["equal"] and figures == {k: int(v) for k, v in row["eval_memory_analysis"].items()}
    if "stats" in row and row.get("ok"):
        n = steps or int(row["steps"])
        refs = [ref] + [r for r, _ in more]
        verdict = simulate_tpu_loop([program_from_reference(r) for r in refs], resolve("tpu-v5e-16gb").capacity_bytes,
                                    n, shared=[{}] + [s for _, s in more],
                                    code_bytes=[r.generated_code_bytes for r in refs],
                                    reserved_bytes=[r.reserved_bytes for r in refs])
        out.update(pool_peak_bytes=verdict.peak_bytes, chip_peak_bytes=chip_peak(row),
                   ratio=verdict.peak_bytes / chip_peak(row), fits=verdict.fits,
                   reserved_bytes=verdict.reserved_bytes,
                   chip_reserved_bytes=int(row["stats"][f"step{n}"].get("peak_bytes_reserved", 0)))
    return out


def loop_programs(row: dict[str, Any], ref: Any) -> list[tuple[Any, dict[int, int]]]:
    """The eval program of a train + eval loop row (`tpu_chip.py` ran TARGET's module's
    `make_eval` beside it), as `compare`'s `more`: its XLA:TPU figures and the arguments that
    are the train step's state. Empty for a row of one program."""
    if row.get("loop") != "train+eval":
        return []
    from jaxmem.compiler.target import argument_signatures
    from jaxmem.runtime.steps import program_from_reference, shared_state
    from jaxmem.xla.gpu.compile import load_abstract
    from jaxmem.xla.tpu.compile import xla_tpu_reference

    target = row["program"]
    evaluate = target.rsplit(":", 1)[0] + ":make_eval"
    eval_ref = xla_tpu_reference(evaluate, "tpu-v5e-16gb", top=0)
    first = argument_signatures(load_abstract(target, {})[1])
    other = argument_signatures(load_abstract(evaluate, {})[1])
    return [(eval_ref, shared_state(first, program_from_reference(ref), other))]
