"""What `jaxmem record` recorded on a TPU v5e (benchmarks/results/tpu_v5e_record/, made by
`bash benchmarks/recording/chip_record.sh` there), read back with this jaxmem: the leak, the two
post-mortems, the compile-time refusal, and the GPT-2 run beside jaxmem's pool prediction.

The truths are the programs' own (benchmarks/recording/*.py): the array a step keeps, the
arrays held, the sizes asked for; and the chip's own memory_stats().
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxmem.recording.explain import explain
from jaxmem.recording.report import load_recording
from jaxmem.recording.summary import summarize_files
from jaxmem.runtime.tpu_pool import RUNTIME_BYTES

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tpu_v5e_record"
GiB, MiB = 1 << 30, 1 << 20


def test_a_the_leak_is_its_line_and_4_mib_per_step():
    leaks = summarize_files(RESULTS / "run2" / "leak")["leaks"]
    assert leaks["step_program"] == "train_step"
    top = leaks["arrays"][0]
    assert top["line"] == "leak_loop.py:26 (main)"          # `w, value, h = train_step(w, x)`
    assert top["bytes_per_step"] == 1024 * 1024 * 4 and top["arrays_per_step"] == 1


def test_b_a_program_that_cannot_load_names_itself_its_reservation_and_the_held_arrays():
    post = load_recording(RESULTS / "run1" / "e0101")["postmortems"][0]
    assert post["kind"] == "tpu_program_load" and post["program"] == "jit_sorted_noise"
    assert post["requested"] == 2 * GiB and post["free"] == int(1.75 * GiB)
    held = {row["line"]: row for row in post["held"]["by_line"]}
    assert held["hold_then_load.py:16 (<listcomp>)"] == {"line": "hold_then_load.py:16 (<listcomp>)",
                                                          "bytes": 14 * GiB, "arrays": 14}
    # The held arrays and the runtime's own buffer are exactly what memory_stats() had in use.
    assert post["held"]["array_bytes"] + RUNTIME_BYTES == post["held"]["bytes_in_use"]
    figures = post["program_figures"]
    assert figures["name"] == "jit_sorted_noise" and figures["temp_size_in_bytes"] >= 2 * GiB


def test_c_an_allocation_past_the_free_memory_says_what_was_asked_and_who_holds_the_rest():
    post = load_recording(RESULTS / "run2" / "e0100")["postmortems"][0]
    assert post["kind"] == "tpu_buffer" and post["verdict"] == "exhaustion"
    assert post["requested"] == GiB and post["free"] < GiB
    assert post["largest_free_block"] < GiB  # memory_stats() of that moment
    held = post["held"]["by_line"][0]
    assert held["line"] == "alloc_until_oom.py:13 (grow)" and held["bytes"] >= 15 * GiB
    code = {e["name"]: e["generated_code_size_in_bytes"] for e in post["executables"]}
    assert post["held"]["bytes_in_use"] == post["held"]["array_bytes"] + RUNTIME_BYTES + code["jit_broadcast_in_dim"]
    assert "jit_broadcast_in_dim" in post["held"]["left_over"]


def test_d_a_compile_time_refusal_is_explained_alike_by_record_and_by_explain():
    post = load_recording(RESULTS / "run2" / "hbm")["postmortems"][0]
    text = (RESULTS / "run2" / "hbm_error.txt").read_text()
    told = explain(text)
    assert post["kind"] == told.kind == "tpu_compile_hbm" and post["program"] == "jit_too_big"
    assert post["requested"] == told.oom.requested.bytes == 40 * GiB
    assert post["limit"] == told.oom.limit.bytes == int(15.75 * GiB)


def test_e_gpt2_each_step_beside_the_pool_prediction():
    beside = json.loads((RESULTS / "run2" / "gpt2_beside.json").read_text())
    summary = summarize_files(RESULTS / "run2" / "gpt2_rec1")
    chip = {r["call"]: r["peak"] for r in summary["per_call"] if r["program"] == "train_step"}
    assert len(beside["beside"]) == 30
    for row in beside["beside"]:
        assert row["device_peak"] == chip[row["step"]]
        assert 0.98 <= row["device_peak"] / row["predicted"] <= 1.05, row
