"""The recording's views: the HTML page in headless Chromium (no console errors; the chart and the
tables there), the profiles as pprof reads them (read with pprof's own schema by protobuf), and
leaks of the other two kinds found on JAX's CPU backend: programs compiled every step, and
donations JAX could not use.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import pytest

from jaxmem.recording.report import load_recording, render_html

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tpu_v5e_record"
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.classes: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.classes.update((dict(attrs).get("class") or "").split())


@pytest.mark.browser
@pytest.mark.skipif(BROWSER is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_the_page_renders_in_chromium_without_console_errors(tmp_path):
    data = load_recording(RESULTS / "run2" / "gpt2_rec1")
    beside = json.loads((RESULTS / "run2" / "gpt2_beside.json").read_text())
    data["predicted"], data["beside"] = beside["predicted"], beside["beside"]
    page = tmp_path / "gpt2.html"
    page.write_text(render_html(data))
    dom = subprocess.run([BROWSER, *FLAGS, "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=180)
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    tags = _Tags()
    tags.feed(dom.stdout)
    assert tags.tags.get("svg", 0) >= 1 and {"used", "reserved", "predicted"} <= tags.classes
    assert tags.tags.get("table", 0) >= 4
    assert "The device's peak after each step beside jaxmem's pool prediction" in dom.stdout


def test_the_profiles_are_pprof_profiles():
    """Each profile file is read by protobuf with pprof's profile.proto schema."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reports"))
    from test_reports_pprof import SCHEMA  # noqa: F401  (the transcribed schema)
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    import gzip

    from test_reports_pprof import Profile as make_profile
    Profile = make_profile.__wrapped__()
    files = sorted((RESULTS / "run2" / "leak" / "profiles").glob("*.pb.gz"))
    assert files
    for path in files:
        prof = Profile()
        prof.ParseFromString(gzip.decompress(path.read_bytes()))
        strings = prof.string_table
        assert [(strings[t.type], strings[t.unit]) for t in prof.sample_type] == [("allocations", "count"), ("space", "bytes")]


ENV_CODE = """
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: x * 2)
    for n in range(1, 13):
        f(jnp.ones((n, 8))).block_until_ready()         # a new shape every step: a new program
    g = jax.jit(lambda a, b: (a + b).astype(jnp.float16), donate_argnums=(1,))
    for _ in range(3):
        g(jnp.ones((64,)), jnp.ones((64,), jnp.int32)).block_until_ready()   # int32 donated, no int32 output
"""


def test_recompiles_and_unused_donations_are_reported(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text(textwrap.dedent(ENV_CODE))
    out = tmp_path / "rec"
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.run([sys.executable, "-m", "jaxmem", "record", "--out", str(out), "--", sys.executable, str(program)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    leaks = json.loads((out / "recording.json").read_text())["leaks"]
    assert leaks["step_program"] == "<lambda>"
    recompiled = {r["program"]: r for r in leaks["recompiles"]}
    assert recompiled["jit__lambda"]["compiles"] >= 12
    unused = leaks["donations_not_used"]
    assert [(d["program"], d["parameter"]) for d in unused] == [("jit__lambda", 1)]
    assert "s32[64]" in unused[0]["text"]
