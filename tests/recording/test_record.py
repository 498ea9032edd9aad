"""`jaxmem record` end to end on JAX's CPU backend: the program runs unchanged, a leak is found
with its line and its exact bytes per step, a real RESOURCE_EXHAUSTED (an allocation larger than
the machine) gets a post-mortem whether the program catches it or not, the exit code passes
through, and Ctrl-C leaves a readable recording.

The truths are the programs' own: the array each step keeps (its shape gives its bytes), the size
the failing allocation asked for, the line that made the held arrays.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxmem.recording.report import load_recording, render_html, render_text

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO / "src")}


def record(tmp_path: Path, source: str, *args: str, name: str = "prog.py", extra: list[str] | None = None,
           timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path]:
    program = tmp_path / name
    program.write_text(textwrap.dedent(source))
    out = tmp_path / "rec"
    cmd = [sys.executable, "-m", "jaxmem", "record", "--out", str(out), "--interval", "0.02", *(extra or []), "--",
           sys.executable, str(program), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout), out


LEAK = """
    import sys
    import jax, jax.numpy as jnp

    @jax.jit
    def train_step(w, x):
        h = jnp.tanh(x @ w)
        return w - 0.01 * (x.T @ h), h, (h * h).mean()

    w = jnp.ones((256, 256)) * 0.01
    x = jnp.ones((256, 256))
    kept = []
    for _ in range(int(sys.argv[1])):
        w, h, loss = train_step(w, x)
        kept.append(h)                 # the leak (h made on the line above)
        float(loss)
    print("done", len(kept))
"""


def test_a_leak_is_named_with_its_line_and_exact_bytes_per_step(tmp_path):
    proc, out = record(tmp_path, LEAK, "40")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "done 40\n"  # the program's own output, untouched
    summary = json.loads((out / "recording.json").read_text())
    assert summary["calls"] == {"train_step": 40}
    leaks = summary["leaks"]["arrays"]
    assert leaks, summary["leaks"]
    assert leaks[0]["line"] == "prog.py:14 (<module>)"  # the line that made them: the call
    assert leaks[0]["bytes_per_step"] == 256 * 256 * 4 and leaks[0]["arrays_per_step"] == 1
    assert "keeps 256.00 KiB per step of train_step" in proc.stderr


def test_the_programs_output_is_the_same_with_and_without_recording(tmp_path):
    (tmp_path / "p.py").write_text(textwrap.dedent(LEAK))
    plain = subprocess.run([sys.executable, str(tmp_path / "p.py"), "3"], capture_output=True, text=True, env=ENV)
    proc, _ = record(tmp_path, LEAK, "3")
    assert proc.stdout == plain.stdout == "done 3\n"


OOM = """
    import sys
    import jax, jax.numpy as jnp

    held = [jnp.ones((1024, 1024)) for _ in range(3)]          # 12 MiB, held
    def too_big():
        return jnp.ones((1 << 42,), jnp.uint8)                  # 4 TiB: more than this machine
    if sys.argv[1] == "catch":
        try:
            too_big()
        except jax.errors.JaxRuntimeError as err:
            print("caught", type(err).__name__)
        sys.exit(3)
    too_big()
"""


@pytest.mark.parametrize("mode", ["catch", "raise"])
def test_a_real_resource_exhausted_gets_a_postmortem(tmp_path, mode):
    proc, out = record(tmp_path, OOM, mode)
    assert proc.returncode == (3 if mode == "catch" else 1), proc.stderr[-2000:]
    assert "Traceback" in proc.stderr if mode == "raise" else proc.stdout == "caught JaxRuntimeError\n"
    post = json.loads((out / "postmortem-1.json").read_text())
    assert post["kind"] == "cpu_alloc" and post["requested"] == 1 << 42
    lines = {row["line"]: row for row in post["held"]["by_line"]}
    assert lines["prog.py:5 (<listcomp>)"]["bytes"] == 3 * 1024 * 1024 * 4
    assert lines["prog.py:5 (<listcomp>)"]["arrays"] == 3
    assert (out / post["profile"]).exists()
    assert "out of memory (cpu_alloc)" in proc.stderr
    assert json.loads((out / "recording.json").read_text())["exit_code"] == proc.returncode


def test_exit_codes_pass_through(tmp_path):
    proc, out = record(tmp_path, "import jax.numpy as jnp, sys\njnp.ones(3).block_until_ready()\nsys.exit(7)\n")
    assert proc.returncode == 7
    assert json.loads((out / "recording.json").read_text())["exit_code"] == 7


def test_a_program_that_never_imports_jax_is_run_and_said_so(tmp_path):
    proc, _ = record(tmp_path, "print('hello')\n")
    assert proc.returncode == 0 and proc.stdout == "hello\n"
    assert "did not import JAX" in proc.stderr


def test_ctrl_c_leaves_a_readable_recording(tmp_path):
    program = tmp_path / "forever.py"
    program.write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp
        step = jax.jit(lambda w: w * 0.5 + 1.0)
        w = jnp.ones((128, 128))
        print("started", flush=True)
        while True:
            w = step(w)
            w.block_until_ready()
    """))
    out = tmp_path / "rec"
    # A terminal's Ctrl-C: SIGINT to the whole process group. (Where the test runner ignores
    # SIGINT, as pytest-xdist's workers do, the default is given back to the command first:
    # Python starts without KeyboardInterrupt where SIGINT is ignored, and so would the program.)
    proc = subprocess.Popen([sys.executable, "-m", "jaxmem", "record", "--out", str(out), "--", sys.executable, str(program)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "started\n"
        time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130  # Python ends on an uncaught KeyboardInterrupt by SIGINT: 128 + 2
    data = load_recording(out)
    assert data["summary"]["calls"]["<lambda>"] > 10
    assert data["summary"]["exit_code"] == 130
    assert "<lambda>" in render_text(data)


def test_a_killed_run_is_rebuilt_from_its_files(tmp_path):
    proc, out = record(tmp_path, LEAK, "40")
    assert proc.returncode == 0
    (out / "recording.json").unlink()   # as if the process had been killed before writing it
    data = load_recording(out)
    assert data["rebuilt"] and data["summary"]["leaks"]["arrays"][0]["bytes_per_step"] == 256 * 256 * 4


def test_the_ring_bounds_the_profiles(tmp_path):
    proc, out = record(tmp_path, LEAK, "64", extra=["--max-profiles", "2"])
    assert proc.returncode == 0
    names = sorted(p.name for p in (out / "profiles").iterdir())
    assert sum(1 for n in names if not n.endswith(("-start.pb.gz", "-oom.pb.gz"))) <= 2, names


def test_markup_in_a_line_is_escaped_in_the_page(tmp_path):
    proc, out = record(tmp_path, LEAK, "40", name="<b>evil<b>.py")
    assert proc.returncode == 0
    page = render_html(load_recording(out))
    assert "<b>evil" not in page and "&lt;b&gt;evil&lt;b&gt;.py" in page


def test_report_of_a_folder_that_is_no_recording_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxmem", "record", "--report", str(tmp_path)], capture_output=True,
                          text=True, env=ENV)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not a jaxmem recording" in proc.stderr


def test_record_and_run_compose_either_way(tmp_path):
    """`jaxmem run` (a launcher that never imports JAX) passes the recorder on to its command."""
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent(LEAK))
    out = tmp_path / "rec"
    run = [sys.executable, "-m", "jaxmem", "run", "--memory", "1GiB", "--capacity", "16GiB", "--"]
    cmd = [sys.executable, "-m", "jaxmem", "record", "--out", str(out), "--", *run, sys.executable, str(program), "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "recording.json").read_text())
    assert summary["calls"] == {"train_step": 40}
    assert summary["leaks"]["arrays"][0]["bytes_per_step"] == 256 * 256 * 4
