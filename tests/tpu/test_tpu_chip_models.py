"""jaxmem's TPU verdicts against a TPU v5e on training steps the suite does not hold.

Recordings (data these tests read; made on a machine with a TPU v5e, JAX 0.10.2, libtpu
0.0.42.1, flax 0.12.8, optax 0.2.8, equinox 0.13.8, with `. benchmarks/tpu_chip_setup.sh` then
`python3 benchmarks/tpu_chip.py --programs ... --out $OUT/....jsonl`):

- `tpu_v5e_layouts.jsonl`: 24 shapes and dtypes made by `jnp` and by `jax.device_put`, their
  layout and buffer bytes on the chip, the layout a program compiled for them expects, and four
  calls of it (`--programs layouts`);
- `tpu_v5e_tuning.jsonl`: `benchmarks/tpu_models/tuning/` (the cases the rules were checked on);
- `tpu_v5e_eval.jsonl`: `benchmarks/tpu_models/eval/`, 20 steps kept apart and never tuned on,
  a train + eval loop among them;
- `tpu_v5e_maxbatch_models.jsonl`: the near-limit GPT-2-small and ViT-B/16 steps at the batch
  sizes tried there (`benchmarks/tpu_chip_maxbatch.py`).
"""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import pytest

from jaxmem.xla.tpu.compile import tiled_bytes, xla_tpu_reference
from jaxmem.xla.tpu.chip import chip_peak, compare, loop_programs, read_recording

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
LAYOUTS = read_recording(os.path.join(RESULTS, "tpu_v5e_layouts.jsonl"))[0]["cases"]
TUNING = read_recording(os.path.join(RESULTS, "tpu_v5e_tuning.jsonl"))
EVAL = read_recording(os.path.join(RESULTS, "tpu_v5e_eval.jsonl"))
MAXBATCH = read_recording(os.path.join(RESULTS, "tpu_v5e_maxbatch_models.jsonl"))
# Each compiles deviceless in seconds; the rest of the sets with -m slow.
FAST = {"odd_mlp.py:make", "bf16_int8_bool.py:make", "eqx_mlp_filter.py:make", "linen_vae_mlp.py:make",
        "train_eval_mlp.py:make"}
_LAYOUT_RE = re.compile(r"major_to_minor=\(([0-9, ]*)\), tiling=\((.*)\), sub_byte")


def _parse_layout(text: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    m = _LAYOUT_RE.search(text)
    assert m, text
    order = tuple(int(d) for d in m.group(1).replace(" ", "").split(",") if d)
    tiles = tuple(tuple(int(d) for d in t.split(",") if d.strip()) for t in re.findall(r"\(([0-9, ]+)\)", m.group(2)))
    return order, tiles


@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: f"{c['dtype']}{c['shape']}")
def test_arrays_sit_on_the_chip_in_the_programs_layout(case):
    """An array made by `jnp` or put by `jax.device_put` has the layout a program compiled for
    it expects, and its buffer is the tiled bytes that layout gives: the runtime converts
    nothing, and the argument figure is the array as the user's code made it."""
    made, put = case["jnp"], case["device_put"]
    assert made["layout"] == put["layout"] == case["program_in_layout"]
    assert made["bytes"] == put["bytes"] == made["in_use_delta"] == case["memory_analysis"]["argument_bytes"]
    order, tiles = _parse_layout(made["layout"])
    itemsize = jnp.dtype(case["dtype"]).itemsize
    assert tiled_bytes(tuple(case["shape"]), itemsize, order, tiles) == made["bytes"]
    # The first call loads the program's code, exactly XLA:TPU's `generated_code_size_in_bytes`
    # (34 KiB for `x + 1`), resident from then on; every call leaves its output, nothing else.
    first = case["calls"][0]
    assert first["in_use_after"] - first["in_use_before"] == \
        first["out"]["bytes"] + case["memory_analysis"]["generated_code_bytes"]
    for call in case["calls"][1:]:
        assert call["in_use_after"] - call["in_use_before"] == call["out"]["bytes"]


def _reference(row):
    return xla_tpu_reference(row["program"] if os.path.isabs(row["program"]) else os.path.join(ROOT, row["program"]),
                             "tpu-v5e-16gb", donate_argnums=tuple(row.get("donate", ())), top=0)


def _cases(rows):
    return [pytest.param(row, id=os.path.basename(row["program"]),
                         marks=() if os.path.basename(row["program"]) in FAST else pytest.mark.slow) for row in rows]


def test_the_recordings_cover_what_the_evaluation_needs():
    names = {os.path.basename(r["program"]).split(".")[0] for r in EVAL}
    assert len(EVAL) >= 16 and all(r["ok"] and r["device_kind"] == "TPU v5 lite" for r in EVAL + TUNING)
    assert sum(n.startswith("linen") for n in names) >= 4 and sum(n.startswith("nnx") for n in names) >= 2
    assert sum(n.startswith("eqx") for n in names) >= 2 and any(r.get("loop") for r in EVAL)
    assert not names & {os.path.basename(r["program"]).split(".")[0] for r in TUNING}


@pytest.mark.usefixtures("needs_libtpu")
@pytest.mark.parametrize("row", _cases(TUNING) + _cases(EVAL))
def test_pool_peak_is_the_chips(row):
    """XLA:TPU's deviceless figures equal the chip's, and the pool peak over 3 steps is within
    -2%/+5% of the chip's `peak_bytes_in_use + peak_bytes_reserved` (-0.5% and -1.6% on the two
    steps of hundreds of tiny arrays, whose runtime reserves memory XLA:TPU's dumps do not name)."""
    ref = _reference(row)
    result = compare(row, ref, more=loop_programs(row, ref))
    assert result["equal"], (result["deviceless"], result["chip"])
    assert 0.98 <= result["ratio"] <= 1.05, result["ratio"]
    if result["chip_reserved_bytes"] == result["reserved_bytes"]:
        assert 0 <= result["pool_peak_bytes"] - chip_peak(row) <= 4096


def test_near_limit_steps_ran_on_the_chip():
    """The near-limit steps at every batch tried there compiled and ran 3 steps, with XLA:TPU's
    temporaries growing less than the batch (it rematerializes near the chip's limit)."""
    gpt2 = sorted((r["batch_size"], r) for r in MAXBATCH if "gpt2" in r["program"] and r["batch_size"] <= 16)
    assert [b for b, _ in gpt2] == [13, 14, 15, 16] and all(r["ok"] for _, r in gpt2)
    assert all(chip_peak(r) <= r["stats"]["start"]["bytes_limit"] for _, r in gpt2)
    vit = [r for r in MAXBATCH if "vit" in r["program"] and r["batch_size"] <= 411]
    assert {r["batch_size"] for r in vit} == {160, 168, 411} and all(r["ok"] for r in vit)


with open(os.path.join(RESULTS, "tpu_v5e_maxbatch_answers.jsonl"), encoding="utf-8") as _f:
    ANSWERS = [json.loads(line) for line in _f if line.strip()]


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: a["target"].rsplit("/", 1)[-1])
def test_maxbatch_is_the_largest_batch_the_chip_runs(answer):
    """maxbatch's answer (a deviceless search, minutes: benchmarks/results) ran 3 steps on the
    chip, and the batch one past it was refused there."""
    runs = {r["batch_size"]: r for r in MAXBATCH if r["program"] == answer["target"]}
    n = answer["answer"]
    assert runs[n]["ok"] and runs[n]["steps"] == 3
    assert not runs[n + 1]["ok"] and "RESOURCE_EXHAUSTED" in runs[n + 1]["error"]
    assert answer["compiles"] >= 1


@pytest.mark.usefixtures("needs_libtpu")
def test_analyze_with_a_second_program_is_the_chips_loop():
    """`analyze TRAIN --with EVAL` on the plain-JAX train + eval loop: the pool verdict is the
    chip's for the loop (its peak, 49,913,856 B on the v5e, within 4 KiB), the eval step's
    parameters counted once."""
    import json
    import subprocess
    import sys

    row = next(r for r in TUNING if r.get("loop"))
    target = os.path.join(ROOT, row["program"])
    proc = subprocess.run([sys.executable, "-m", "jaxmem", "analyze", target, "--with", target.replace(":make", ":make_eval"),
                           "--device", "tpu-v5e-16gb", "--json"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-400:]
    data = json.loads(proc.stdout)
    assert [p["shared_arguments"] for p in data["loop"]] == [0, 3]
    # The chip's loop made its arrays on the host, so the programs the factory would run on a
    # chip (their code, their reservation) are left out of the comparison.
    pool = data["pool"]
    own_reservation = max(p["reserved_bytes"] or 0 for p in data["loop"])
    peak = pool["peak_bytes"] - pool["factory_code_bytes"] - pool["reserved_bytes"] + own_reservation
    assert pool["factory_programs"] > 0 and pool["reserved_bytes"] >= own_reservation
    assert 0 <= peak - chip_peak(row) <= 4096
