"""The report flags through the real commands: `jaxmem analyze` and `jaxmem replay`."""

from __future__ import annotations

import gzip
import json

from jaxmem.cli.main import main
from jaxmem.traces.jaxmem_format import write_jaxmem_trace
from jaxmem.traces.model import Event, Frame, Trace

FACTORY = '''
import jax, jax.numpy as jnp

def factory():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def step(w, x):
        g = jax.grad(loss)(w, x)
        return w - 0.1 * g
    return step, (jnp.ones((128, 128)), jnp.ones((32, 128)))
'''


def test_analyze_writes_every_report(tmp_path, capsys):
    target = tmp_path / "model.py"
    target.write_text(FACTORY)
    out = {k: tmp_path / name for k, name in
           (("html", "r.html"), ("pprof", "p.pb.gz"), ("png", "t.png"), ("chrome", "t.json"))}
    code = main(["analyze", f"{target}:factory", "--no-xla", "--json", "--html", str(out["html"]),
                 "--pprof", str(out["pprof"]), "--png", str(out["png"]), "--chrome-trace", str(out["chrome"])])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)  # stdout stays one JSON object
    assert summary["peak_bytes"] > 0
    assert "</html>" in out["html"].read_text()
    assert gzip.decompress(out["pprof"].read_bytes())
    assert out["png"].read_bytes()[:4] == b"\x89PNG"
    counters = [e for e in json.loads(out["chrome"].read_text())["traceEvents"] if e["ph"] == "C"]
    assert {"residuals", "gradients"} <= set(counters[0]["args"])
    assert captured.err.count("wrote ") == 4


def test_analyze_bad_step_is_one_line_error(tmp_path, capsys):
    target = tmp_path / "model.py"
    target.write_text(FACTORY)
    code = main(["analyze", f"{target}:factory", "--no-xla", "--pprof", str(tmp_path / "p.pb.gz"), "--step", "100000"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--step 100000 is outside" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_replay_writes_reports(tmp_path, capsys):
    events = []
    for i in range(50):
        events.append(Event("alloc", 4096 * i, 4096, time_us=float(i), frames=(Frame("/w/x.py", i + 1, "f"),)))
        if i % 2:
            events.append(Event("free", 4096 * (i - 1), 4096, time_us=i + 0.5))
    path = tmp_path / "t.jsonl"
    write_jaxmem_trace(Trace(events, source=str(path), format="jaxmem"), path)
    html, prof, chrome = tmp_path / "r.html", tmp_path / "p.pb.gz", tmp_path / "c.json"
    code = main(["replay", str(path), "--allocator", "bfc,platform", "--html", str(html), "--pprof", str(prof),
                 "--step", "10", "--chrome-trace", str(chrome)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "at event 10" in err
    names = {e["name"] for e in json.loads(chrome.read_text())["traceEvents"] if e["ph"] == "C"}
    assert {"bfc memory", "platform memory"} <= names
    assert 'id="lines"' in html.read_text()
