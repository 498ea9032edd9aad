"""Report benchmark: how long each report takes to build, next to the planning it follows.

For GPT training steps (jaxmem.examples.gpt) of several depths: plan time (the peer, measured
in the same run, since CPU timings here are noisy), then the time to build the report data and
to write each report (HTML, pprof, PNG, Chrome trace) and the HTML's size. Then two scale
cases: a synthetic plan with 100,000 buffers over 50,000 steps, and a synthetic trace of
1,000,000 events replayed through bfc. With headless Chromium installed, also the time for the
browser to open the 100,000-buffer report and draw it, and how long a hover takes there.

    .venv/bin/python benchmarks/bench_reports.py                  # markdown on stdout
    .venv/bin/python benchmarks/bench_reports.py --layers 12 --no-scale

Target (issue 8): a 12-layer transformer plan renders in a second or two; a 100,000-buffer
report still opens and responds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxmem.compiler.planner import plan
from jaxmem.examples.gpt import make_train_step
from jaxmem.reports.chrome_trace import write_chrome_trace
from jaxmem.reports.data import from_plan, from_replay
from jaxmem.reports.html import write_html
from jaxmem.reports.png import write_png
from jaxmem.reports.pprof import write_pprof

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reports"))


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def report_times(data, out: Path) -> dict[str, float]:
    times = {}
    _, times["html"] = timed(lambda: write_html(out / "r.html", data))
    _, times["pprof"] = timed(lambda: write_pprof(out / "p.pb.gz", data.live_at(data.peak_x)))
    _, times["png"] = timed(lambda: write_png(out / "t.png", data))
    _, times["chrome"] = timed(lambda: write_chrome_trace(out / "t.json", data))
    times["html_mib"] = (out / "r.html").stat().st_size / 2**20
    return times


def browser_probe(page: Path) -> str:
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        return "chromium not installed"
    start = time.perf_counter()
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
                          "--dump-dom", page.resolve().as_uri() + "#selftest"], capture_output=True, text=True, timeout=300).stdout
    seconds = time.perf_counter() - start
    drawn = re.search(r"in (\d+) ms", dom)
    hover = re.search(r'data-hover-ms="([^"]*)"', dom)
    return (f"browser process {seconds:.1f} s, first draw {drawn.group(1) if drawn else '?'} ms, "
            f"hover {hover.group(1) if hover else '?'} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="6,12", help="GPT depths, comma separated")
    ap.add_argument("--no-scale", action="store_true", help="skip the 100,000-buffer and 1,000,000-event cases")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="jaxmem-bench-reports-"))
    print("| case | plan / replay s | data s | HTML s | pprof s | PNG s | Chrome trace s | HTML MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for layers in [int(x) for x in args.layers.split(",") if x]:
        fn, fargs = make_train_step(n_layers=layers)
        p, t_plan = timed(lambda: plan(fn, *fargs, xla=False))
        data, t_data = timed(lambda: from_plan(p, title=f"gpt {layers} layers"))
        t = report_times(data, out)
        print(f"| GPT train step, {layers} layers ({len(p.schedule)} steps, {len(p.buffers)} buffers) | {t_plan:.2f} | "
              f"{t_data:.2f} | {t['html']:.2f} | {t['pprof']:.3f} | {t['png']:.2f} | {t['chrome']:.2f} | {t['html_mib']:.2f} |")
    probe = ""
    if not args.no_scale:
        from reports_fixtures import synthetic_plan

        from jaxmem.traces.model import Event, Frame, Trace
        from jaxmem.traces.replay import replay

        p = synthetic_plan(100_000, 50_000)
        data, t_data = timed(lambda: from_plan(p, title="100,000 buffers"))
        t = report_times(data, out)
        print(f"| synthetic plan, 100,000 buffers, 50,000 steps | - | {t_data:.2f} | {t['html']:.2f} | {t['pprof']:.3f} | "
              f"{t['png']:.2f} | {t['chrome']:.2f} | {t['html_mib']:.2f} |")
        probe = browser_probe(out / "r.html")

        rng = np.random.default_rng(0)
        events, live, addr = [], [], 0
        frames = (Frame("/w/model.py", 12, "forward"),)
        while len(events) < 1_000_000:
            if live and (rng.random() < 0.5 or len(live) > 2000):
                a, s = live.pop(int(rng.integers(len(live))))
                events.append(Event("free", a, s))
            else:
                s = int(rng.integers(1, 1 << 20)) // 512 * 512 + 512
                events.append(Event("alloc", addr, s, frames=frames))
                live.append((addr, s))
                addr += s
        trace = Trace(events, source="synthetic 1,000,000 events", format="jaxmem")
        report, t_replay = timed(lambda: replay(trace, ["bfc"], capacity=80 << 30, progress=False))
        data, t_data = timed(lambda: from_replay(report, trace))
        t = report_times(data, out)
        print(f"| synthetic trace, 1,000,000 events ({len(data.blocks)} blocks), bfc replay | {t_replay:.2f} | {t_data:.2f} | "
              f"{t['html']:.2f} | {t['pprof']:.3f} | {t['png']:.2f} | {t['chrome']:.2f} | {t['html_mib']:.2f} |")
    if probe:
        print(f"\n100,000-buffer report in headless Chromium: {probe}")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
