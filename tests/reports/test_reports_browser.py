"""The HTML report opened in headless Chromium: charts drawn, hover answers, no console errors.

Chromium runs the page's own script; the script writes what it drew (and, with #selftest in
the address, what hovering the peak showed and how long it took) into the #status element,
which `--dump-dom` prints after load. Console messages come from `--enable-logging=stderr`.
Screenshots are saved under the test's tmp dir, and also in $JAXMEM_SCREENSHOT_DIR when set.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxmem.compiler.planner import plan as jaxmem_plan
from jaxmem.reports.data import from_plan, from_replay
from jaxmem.reports.html import write_html
from reports_fixtures import naive_plan, synthetic_plan

pytestmark = pytest.mark.browser

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(b)), None)
if BROWSER is None:
    pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)", allow_module_level=True)

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--no-first-run", "--disable-extensions", "--allow-file-access-from-files"]


class _Status(HTMLParser):
    def __init__(self):
        super().__init__()
        self.attrs, self.text, self._in = {}, "", False
        self.canvases, self.rows, self._tag_stack, self.title = {}, [], [], None
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id") == "status":
            self.attrs, self._in = a, True
        if tag == "canvas":
            self.canvases[self._host] = self.canvases.get(self._host, 0) + 1
        if tag == "div" and a.get("class") == "chart":
            self._host = a.get("id")
        if tag == "title":
            self._in_title = True

    _host = None

    def handle_endtag(self, tag):
        if tag == "div":
            self._in = False
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in:
            self.text += data
        if self._in_title:
            self.title = (self.title or "") + data


def open_page(path: Path, shots: Path, name: str, selftest: bool = True, height: int = 1500):
    url = path.resolve().as_uri() + ("#selftest" if selftest else "")
    start = time.perf_counter()
    dom = subprocess.run([BROWSER, *FLAGS, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000",
                          "--dump-dom", url], capture_output=True, text=True, timeout=180)
    seconds = time.perf_counter() - start
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    shot = shots / f"{name}.png"
    subprocess.run([BROWSER, *FLAGS, f"--window-size=1300,{height}", f"--screenshot={shot}", path.resolve().as_uri()],
                   capture_output=True, text=True, timeout=180)
    assert shot.exists() and shot.stat().st_size > 10_000, "no screenshot"
    keep = os.environ.get("JAXMEM_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)
    parsed = _Status()
    parsed.feed(dom.stdout)
    return parsed, console, seconds


def assert_clean(parsed, console):
    assert console == [], f"console messages: {console}"
    assert parsed.attrs.get("data-errors") == "0", parsed.text


def test_gpt_report_renders(tmp_path):
    from jaxmem.examples.gpt import make_train_step

    fn, args = make_train_step(n_layers=2, d_model=64, n_heads=2, seq=32, batch=4, vocab=256)
    data = from_plan(jaxmem_plan(fn, *args, xla=False), title="gpt 2 layers")
    page = tmp_path / "gpt.html"
    write_html(page, data)
    parsed, console, _ = open_page(page, tmp_path, "report_gpt")
    assert_clean(parsed, console)
    rendered = parsed.attrs["data-rendered"].split(",")
    assert {"stacked", "map"} <= set(rendered) and "top:0" not in rendered
    assert parsed.canvases.get("stacked") == 2 and parsed.canvases.get("map") == 2
    # Hovering the peak: the timeline names the step; the map names the largest buffer there.
    # (Mouse coordinates are whole pixels, so the hover lands within a pixel's worth of steps.)
    hovered = int(re.match(r"step (-?\d+):", parsed.attrs["data-tip-stacked"]).group(1))
    assert abs(hovered - data.peak_x) <= max(1, (data.x_max - data.x_min) // 900)
    # Dragging across the middle half zooms both charts to it; a double-click zooms back out.
    zoom = re.match(r"(-?\d+)\.\.(-?\d+) in [\d.]+ ms; reset (-?\d+)\.\.(-?\d+)", parsed.attrs["data-zoom"])
    lo, hi, rlo, rhi = map(int, zoom.groups())
    span = data.x_max - data.x_min + 1
    assert abs(lo - (data.x_min + span // 4)) <= 2 and abs(hi - (data.x_min + 3 * span // 4)) <= 2
    assert (rlo, rhi) == (data.x_min, data.x_max)
    biggest = data.live_at(data.peak_x)[0]
    tip = parsed.attrs["data-tip-map"]
    assert biggest.dtype in tip and biggest.category in tip and "source:" in tip


def test_replay_report_renders_lines_and_oom(tmp_path):
    from jaxmem.traces.model import Event, Frame, Trace
    from jaxmem.traces.replay import replay

    events, addr = [], 0
    for i in range(60):
        size = (1 + i % 7) << 20
        events.append(Event("alloc", addr, size, time_us=float(2 * i), frames=(Frame("/w/train.py", 10 + i, "layer"),), label="dot"))
        if i % 3 == 2:
            events.append(Event("free", addr - (1 + (i - 1) % 7 << 20), (1 + (i - 1) % 7) << 20, time_us=2.0 * i + 1))
        addr += size
    trace = Trace(events, source="synthetic.jsonl", format="jaxmem")
    report = replay(trace, ["bfc", "platform"], capacity=128 << 20, progress=False)
    assert any(r.oom for r in report.runs.values())
    data = from_replay(report, trace)
    page = tmp_path / "replay.html"
    write_html(page, data)
    parsed, console, _ = open_page(page, tmp_path, "report_replay")
    assert_clean(parsed, console)
    assert {"lines", "stacked", "map"} <= set(parsed.attrs["data-rendered"].split(","))
    assert "bfc: in use" in parsed.attrs["data-tip-lines"]
    # Without the trace (only the replay's figures) the page still draws its lines, and only them.
    bare = tmp_path / "replay_bare.html"
    write_html(bare, from_replay(report))
    parsed, console, _ = open_page(bare, tmp_path, "report_replay_bare", height=700)
    assert_clean(parsed, console)
    assert parsed.attrs["data-rendered"] == "lines,top:0"


def test_hostile_names_stay_text(tmp_path):
    hostile = '</script><script>document.title="pwned";throw 1</script><img src=x onerror="document.title=1">'
    scope = {"jnp": jnp}
    exec(compile("def f(x):\n    return jnp.tanh(x) * 2\n", hostile + ".py", "exec"), scope)
    fn = scope["f"]
    fn.__code__ = fn.__code__.replace(co_name="<script>alert(2)</script>")
    data = from_plan(naive_plan(fn, jnp.ones((64, 64))), title=hostile)
    page = tmp_path / "hostile.html"
    write_html(page, data)
    parsed, console, _ = open_page(page, tmp_path, "report_hostile")
    assert_clean(parsed, console)
    assert parsed.title == "jaxmem: " + hostile
    tip = parsed.attrs["data-tip-map"]
    assert hostile in tip and "<script>alert(2)</script>" in tip


def test_hundred_thousand_buffers_open_and_respond(tmp_path):
    plan = synthetic_plan(100_000, 50_000)
    start = time.perf_counter()
    data = from_plan(plan, title="100,000 buffers")
    page = tmp_path / "big.html"
    size = write_html(page, data)
    build = time.perf_counter() - start
    assert size < 12 << 20, size
    parsed, console, seconds = open_page(page, tmp_path, "report_100k", height=1100)
    assert_clean(parsed, console)
    text = parsed.text
    drawn_ms = int(re.search(r"in (\d+) ms", text).group(1))
    hover = dict(p.split("=") for p in parsed.attrs["data-hover-ms"].split(","))
    print(f"100k buffers: data+html {build:.2f}s, {size / 2**20:.1f} MiB, browser {seconds:.1f}s, "
          f"first draw {drawn_ms} ms, hover {hover}")
    zoom_ms = float(re.search(r"in ([\d.]+) ms", parsed.attrs["data-zoom"]).group(1))
    print(f"zoom redraw {zoom_ms} ms")
    assert drawn_ms < 5000 and all(float(v) < 250 for v in hover.values()) and zoom_ms < 5000
    assert "aggregates" in text and parsed.attrs["data-tip-map"]
