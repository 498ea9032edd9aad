"""`jaxmem explain`: out-of-memory texts read into exact figures, explained, rendered, bounded.

The independent truth for every figure is the number as the fixture's text writes it (the
fixtures are real texts: a TPU v5e's and public reports, see fixtures/README.md): "4.00G" is
4.00 x 2^30 bytes, rounded, and "6291456 bytes" is exact. Where a text gives a size both
rounded and in bytes, the bytes win and the two agree.
"""

from __future__ import annotations

import html.parser
import json
import os
import random
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from jaxmem.errors import OomTextError
from jaxmem.recording.explain import explain
from jaxmem.recording.oom_text import OomText, Size, parse_all, parse_oom, parse_size_text, parse_stream

FIXTURES = Path(__file__).parent / "fixtures"
SRC = Path(__file__).resolve().parents[2] / "src"
G, M, K = 1 << 30, 1 << 20, 1 << 10


def read(name: str) -> OomText:
    oom = parse_oom((FIXTURES / name).read_text(encoding="utf-8"))
    assert oom is not None, name
    return oom


def about(size: Size | None, text: str, value: float, unit: int) -> None:
    """A rounded figure: as printed, and its bytes the printed number (as a decimal) times the unit."""
    assert size is not None
    assert (size.text, size.exact, size.bytes) == (text, False, round(Fraction(repr(value)) * unit))


def exact(size: Size | None, count: int) -> None:
    assert size is not None and size.exact and size.bytes == count


def test_sizes_in_every_form_are_read_exactly():
    cases = {"16.00G": (16 * G, False), "1.50GiB": (3 * G // 2, False), "123456789 bytes": (123456789, True),
             "15.75G": (round(15.75 * G), False), "4.0KiB": (4 * K, False), "512B": (512, True),
             "2.31M": (round(2.31 * M), False), "0B": (0, True), "3.47E": (round(Fraction("3.47") * (1 << 60)), False),
             "1.25TiB": (round(1.25 * (1 << 40)), False), "12.0K": (12 * K, False)}
    for text, (count, is_exact) in cases.items():
        size = parse_size_text(text)
        assert (size.bytes, size.exact, size.text) == (count, is_exact, text), text
    assert "about" in parse_size_text("4.00G").describe() and "about" not in parse_size_text("512B").describe()


def test_tpu_v5e_e0100_buffer():
    for name in ("tpu_v5e_e0100.txt", "tpu_v5e_e0100_device_put.txt"):
        oom = read(name)
        assert (oom.kind, oom.device) == ("tpu_buffer", "0x0x0_HBM0")
        about(oom.requested, "4.00G", 4.00, G)
        about(oom.free, "3.75G", 3.75, G)
        assert "Attempting to allocate 4.00G" in oom.line


def test_tpu_v5e_e0101_program_load():
    oom = read("tpu_v5e_e0101.txt")
    assert (oom.kind, oom.program) == ("tpu_program_load", "jit__lambda")
    about(oom.requested, "9.67G", 9.67, G)
    about(oom.free, "3.75G", 3.75, G)
    exact(oom.reserved, 0)
    about(oom.reservable, "3.75G", 3.75, G)


def test_program_load_without_its_code_or_free_figures():
    oom = read("tpu_program_load_recipes151.txt")
    assert (oom.kind, oom.program, oom.free, oom.reservable) == ("tpu_program_load", "jit__multi_slice", None, None)
    about(oom.requested, "6.14G", 6.14, G)
    assert explain((FIXTURES / "tpu_program_load_recipes151.txt").read_text()).verdict == "reservation"


def test_tpu_v5e_compile_temporaries_and_the_benchmark_rows():
    oom = read("tpu_v5e_compile_temps.txt")
    assert (oom.kind, oom.device) == ("tpu_compile_hbm", "HBM")
    about(oom.requested, "24.56G", 24.56, G)
    about(oom.limit, "15.75G", 15.75, G)
    rows = parse_all((FIXTURES / "tpu_v5e_chip_maxbatch.jsonl").read_text())
    assert [r.requested.text for r in rows] == ["16.54G", "16.69G"]
    assert {r.limit.text for r in rows} == {"15.75G"}


def test_tpu_compile_report_with_largest_allocations():
    oom = read("tpu_hbm_report_flowpm27.txt")
    assert (oom.kind, oom.device) == ("tpu_compile_hbm", "hbm")
    about(oom.requested, "41.74G", 41.74, G)
    about(oom.limit, "16.00G", 16.00, G)
    b = oom.breakdown
    about(b["exceeded"], "25.74G", 25.74, G)
    about(b["usage.reserved"], "528.00M", 528.00, M)
    about(b["usage.program"], "41.22G", 41.22, G)
    about(b["program.reserved"], "4.0K", 4.0, K)
    about(b["program.global"], "29.82M", 29.82, M)
    about(b["program.HLO temp"], "41.19G", 41.19, G)
    (top,) = oom.allocations
    about(top.size, "32.00G", 32.00, G)
    about(top.unpadded, "1.00G", 1.00, G)
    assert (top.rank, top.shape, top.op_name, top.op_type) == (
        1, "s32[8388608,8,4]{2,1,0:T(8,128)}", "slicewise_79/cic_update/FloorMod", "FloorMod")
    assert "32.0x its unpadded size" in explain((FIXTURES / "tpu_hbm_report_flowpm27.txt").read_text()).blame[0]["note"]


def test_tpu_compile_report_from_jax_names_the_source_line():
    oom = read("tpu_hbm_report_easydel166.txt")
    about(oom.requested, "63.80G", 63.80, G)
    about(oom.limit, "30.75G", 30.75, G)
    about(oom.breakdown["usage.reserved"], "1.25G", 1.25, G)
    exact(oom.breakdown["usage.arguments"], 0)
    about(oom.breakdown["program.HLO temp"], "63.79G", 63.79, G)
    (top,) = oom.allocations
    about(top.size, "2.00G", 2.00, G)
    assert top.source == "/home/air/workspace/EasyDel/src/easydel/modules/attention_module.py:1059"
    assert (top.shape, top.allocation_type) == ("f32[32,4096,4096]{1,2,0:T(8,128)}", "HLO temp")
    assert oom.program == "jit(casual_language_model_train_step)"


def test_tpu_compile_aborted_early():
    oom = read("tpu_compile_early_jax7822.txt")
    assert oom.kind == "tpu_compile_hbm"
    about(oom.requested, "3.47E", 3.47, 1 << 60)
    about(oom.limit, "14.49G", 14.49, G)


def test_gpu_xla_out_of_memory_with_peak_buffers():
    oom = read("gpu_xla_oom_jax13428.txt")
    assert (oom.kind, oom.program) == ("gpu_xla_oom", "jit(concatenate)")
    exact(oom.requested, 6291456)
    about(oom.breakdown["parameter allocation"], "6.00MiB", 6.00, M)
    about(oom.breakdown["total allocation"], "12.00MiB", 12.00, M)
    exact(oom.breakdown["preallocated temp allocation"], 0)
    first, second = oom.allocations
    about(first.size, "6.00MiB", 6.00, M)
    assert (first.shape, first.label) == ("f32[4096,128,3]", "concatenate")
    assert first.source == "/media/gccrcv/Data/Opensources/multinerf/internal/models.py:689"
    about(second.size, "384.0KiB", 384.0, K)
    assert (second.shape, second.allocation_type) == ("f32[256,128,3]", "parameter")
    # the bytes and the rounded figure of the one buffer agree
    assert first.size.bytes == oom.requested.bytes


def test_gpu_buffer_assignment_with_log_prefixes_and_colour_escapes():
    oom = read("gpu_xla_oom_alpa759.txt")
    assert oom.kind == "gpu_xla_oom" and oom.requested is None
    about(oom.breakdown["preallocated temp allocation"], "3.83GiB", 3.83, G)
    about(oom.breakdown["maybe_live_out allocation"], "301.25MiB", 301.25, M)
    about(oom.breakdown["total fragmentation"], "5.5KiB", 5.5, K)
    (top,) = oom.allocations
    assert (top.shape, top.source) == ("f32[250880,4096]", "/home/ray/anaconda3/lib/python3.8/site-packages/flax/linen/dtypes.py:97")
    assert "\x1b" not in str(explain((FIXTURES / "gpu_xla_oom_alpa759.txt").read_text()))


def test_bfc_line_bytes_win_over_the_rounded_figure():
    oom = read("gpu_bfc_jax27354.txt")
    assert (oom.kind, oom.device) == ("gpu_bfc", "GPU_0_bfc")
    exact(oom.requested, 1374521760000)
    assert oom.requested.text == "1.25TiB"
    assert abs(parse_size_text("1.25TiB").bytes - oom.requested.bytes) < 0.005 * (1 << 40)


def test_bfc_bins_sum_and_stats():
    oom = read("gpu_bfc_stats_flowdec32.txt")
    assert oom.kind == "gpu_bfc"
    assert oom.stats == {"Limit": 10562958132, "InUse": 4467985408, "MaxInUse": 4467985408, "NumAllocs": 25,
                         "MaxAllocSize": 2233958400}
    exact(oom.limit, 10562958132)
    exact(oom.in_use, 4467985408)
    assert [b.bin_size for b in oom.bins] == [262144, 524288, 1048576, 2097152, 4194304, 8388608]
    second = oom.bins[1]
    assert (second.total_chunks, second.chunks_in_use) == (1, 0)
    about(second.allocated, "956.5KiB", 956.5, K)
    # "Sum Total of in-use chunks: 4.16GiB" agrees with the exact InUse
    assert abs(round(4.16 * G) - oom.in_use.bytes) < 0.005 * G


def test_bfc_bins_old_and_new_formats():
    new = read("gpu_bfc_bins_tf22586.txt")
    assert [(b.bin_size, b.total_chunks, b.chunks_in_use) for b in new.bins][:3] == [(2048, 7, 4), (4096, 6, 2), (8192, 7, 5)]
    about(new.bins[0].allocated, "15.5KiB", 15.5, K)
    about(new.bins[0].in_use, "8.2KiB", 8.2, K)
    about(new.bins[0].requested_in_use, "8.0KiB", 8.0, K)
    old = read("gpu_bfc_old_tfrcnn7.txt")
    about(old.requested, "392.00MiB", 392.00, M)
    assert [b.bin_size for b in old.bins] == [4096, 8192, 16384, 32768, 65536, 131072]
    about(old.bins[-1].allocated, "130.0KiB", 130.0, K)


def test_bfc_stats_block_with_reserved_and_largest_free_block_is_fragmentation():
    # Laid out as TSL's AllocatorStats::DebugString prints it (fixtures/README.md).
    text = ("W bfc_allocator.cc:501] Allocator (GPU_0_bfc) ran out of memory trying to allocate 1.50GiB "
            "(rounded to 1610612736)requested by op fusion.12\nI bfc_allocator.cc:1107] Stats: \n"
            "Limit:                  8000000000\nInUse:                  5000000000\n"
            "MaxInUse:               6000000000\nNumAllocs:                    1234\n"
            "MaxAllocSize:           1073741824\nReserved:                        0\n"
            "PeakReserved:                    0\nLargestFreeBlock:        1073741824\n")
    oom = parse_oom(text)
    exact(oom.requested, 1610612736)
    exact(oom.largest_free_block, 1073741824)
    exact(oom.reserved, 0)
    assert oom.op == "fusion.12" and oom.stats["PeakReserved"] == 0
    e = explain(text)
    assert e.verdict == "fragmentation" and "1,073,741,824 bytes" in e.meaning


def test_verdicts_of_the_chip_texts():
    v = {name: explain((FIXTURES / name).read_text()).verdict for name in
         ("tpu_v5e_e0100.txt", "tpu_v5e_e0101.txt", "tpu_v5e_compile_temps.txt", "gpu_bfc_jax27354.txt")}
    assert v == {"tpu_v5e_e0100.txt": "exhaustion", "tpu_v5e_e0101.txt": "exhaustion",
                 "tpu_v5e_compile_temps.txt": "compile", "gpu_bfc_jax27354.txt": "unknown"}
    reservation = explain("E0101: RuntimeProgramAllocationFailure:\nError loading program 'jit_step': Attempting "
                          "to reserve 2.00G at the bottom of memory. That was not possible. There are 6.00G free, "
                          "0B reserved, and 1.00G reservable.")
    assert reservation.verdict == "reservation" and reservation.oom.program == "jit_step"
    e = explain((FIXTURES / "tpu_v5e_compile_temps.txt").read_text())
    assert e.preset == "tpu-v5e-16gb"
    commands = " ".join(s.command for s in e.steps)
    assert "jaxmem fit TARGET" in commands and "jaxmem maxbatch TARGET --arg batch --device tpu-v5e-16gb" in commands


def test_several_errors_first_and_most_specific():
    log = ((FIXTURES / "gpu_bfc_jax27354.txt").read_text() + "\nsome output\n"
           + (FIXTURES / "gpu_xla_oom_jax13428.txt").read_text() + "\nValueError: RESOURCE_EXHAUSTED: "
           "Out of memory while trying to allocate 6291456 bytes.\n")
    found = parse_all(log)
    assert [o.kind for o in found] == ["gpu_bfc", "gpu_xla_oom", "gpu_xla_oom"]
    best = parse_oom(log)
    assert best is found[1] or (best.kind == "gpu_xla_oom" and len(best.allocations) == 2)
    assert explain(log).others == ("gpu_bfc", "gpu_xla_oom")


def test_an_escaped_message_in_json_is_read():
    row = json.dumps({"error": (FIXTURES / "tpu_v5e_e0101.txt").read_text()})
    oom = parse_oom(row)
    assert oom.kind == "tpu_program_load"
    about(oom.reservable, "3.75G", 3.75, G)


def test_unknown_text_raises_one_line():
    with pytest.raises(OomTextError) as err:
        explain("Traceback: ValueError: something else entirely\n")
    assert "\n" not in str(err.value)
    assert parse_oom("RESOURCE_EXHAUSTED: a form nobody knows") is None


class _Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_markup_in_an_op_name_is_escaped_in_html():
    text = (FIXTURES / "gpu_xla_oom_jax13428.txt").read_text().replace(
        "jit(concatenate)/jit(main)/concatenate", "jit(f)/<script>alert(1)</script><b>x</b>")
    e = explain(text)
    page = e.html()
    assert "<script>" not in page and "<b>x" not in page
    reader = _Text()
    reader.feed(page)
    assert "script" not in reader.tags and "b" not in reader.tags
    assert any("<script>alert(1)</script>" in t for t in reader.text)   # shown, as text
    assert json.loads(json.dumps(e.to_dict()))["blame"][0]["op"].startswith("jit(f)/<script>")


def _log_with_error_at_end(path: Path, megabytes: int) -> None:
    line = b"2024-01-01 12:00:00.000 INFO step 123 loss 0.1234 throughput 1234.5 tokens/s lr 3e-4 padding\n"
    block = line * 10000
    with path.open("wb") as f:
        for _ in range(megabytes * (1 << 20) // len(block)):
            f.write(block)
        f.write((FIXTURES / "tpu_v5e_e0100.txt").read_bytes())


def _timed_parse(path: Path) -> tuple[list[OomText], float]:
    start = time.perf_counter()
    with path.open("rb") as f:
        found = parse_stream(f)
    return found, time.perf_counter() - start


def test_a_100mb_log_with_the_error_at_its_end(tmp_path):
    # About a second here (the file's writing included): run by default.
    path = tmp_path / "train.log"
    _log_with_error_at_end(path, 100)
    found, seconds = _timed_parse(path)
    assert [o.kind for o in found] == ["tpu_buffer"] and seconds < 30


def test_random_bytes_and_one_endless_line_are_bounded(tmp_path):
    noise = tmp_path / "noise.bin"
    noise.write_bytes(random.Random(7).randbytes(5 << 20))
    found, seconds = _timed_parse(noise)
    assert found == [] and seconds < 5
    endless = tmp_path / "endless.log"
    endless.write_bytes(b"Bin (" * (2 << 20) + b"\n" + (FIXTURES / "tpu_v5e_e0101.txt").read_bytes())
    found, seconds = _timed_parse(endless)
    assert found[-1].kind == "tpu_program_load" and seconds < 5


# ---------------------------------------------------------------- the command line

def _cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-m", "jaxmem", "explain", *args], input=stdin, capture_output=True,
                          env=env, timeout=120)


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_explains_a_file_as_text_json_and_html(tmp_path):
    page = tmp_path / "oom.html"
    done = _cli(str(FIXTURES / "tpu_v5e_e0101.txt"), "--html", str(page))
    assert done.returncode == 0 and b"E0101" in done.stdout and b"jit__lambda" in done.stdout
    assert "jit__lambda" in page.read_text()
    data = json.loads(_cli(str(FIXTURES / "tpu_v5e_e0100.txt"), "--json").stdout)
    assert data["parsed"]["requested"] == {"bytes": 4 * G, "text": "4.00G", "exact": False}
    assert data["verdict"] == "exhaustion"


def test_cli_reads_stdin_and_refuses_what_it_cannot_explain(tmp_path):
    done = _cli("-", stdin=(FIXTURES / "gpu_xla_oom_jax13428.txt").read_bytes())
    assert done.returncode == 0 and b"6,291,456 bytes" in done.stdout
    assert "no out-of-memory error" in _one_line_error(_cli("-", stdin=b"all is well\n"))
    assert "no such file" in _one_line_error(_cli(str(tmp_path / "missing.log")))
    assert "directory" in _one_line_error(_cli(str(tmp_path)))
    noise = tmp_path / "noise.bin"
    noise.write_bytes(random.Random(3).randbytes(1 << 20))
    _one_line_error(_cli(str(noise)))
    _one_line_error(_cli(str(FIXTURES / "tpu_v5e_e0100.txt"), "--html", str(tmp_path / "no" / "dir" / "x.html")))


def test_explain_does_not_import_jax():
    code = ("import sys, jaxmem.cli.main as m; m.main(['explain', '--json', sys.argv[1]]); "
            "print('jax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(FIXTURES / "tpu_v5e_e0100.txt")], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert done.stdout.strip().endswith(b"False"), done.stderr
