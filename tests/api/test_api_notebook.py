"""What a notebook shows: `Analysis._repr_html_()` drawn by headless Chromium with no console
error and user names escaped, and a notebook run end to end whose output holds the table."""

from __future__ import annotations

import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.reports.analysis_html import render_page
from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

pytestmark = pytest.mark.skipif(tpu_reason() is not None, reason="libtpu is not installed here")
BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-extensions", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom"]


def evil_step(w, x):
    """A function whose name would be markup if it were not escaped."""
    return w - 0.1 * (x.T @ jnp.tanh(x @ w))


evil_step.__name__ = "<script>document.title='pwned'</script><b>step"


@pytest.mark.browser
@pytest.mark.skipif(BROWSER is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_repr_html_renders_in_chromium_with_names_escaped(tmp_path):
    w, x = jax.ShapeDtypeStruct((128, 128), jnp.float32), jax.ShapeDtypeStruct((8, 128), jnp.float32)
    result = jaxmem.analyze(evil_step, w, x, device="tpu-v5e-16gb", donate=0, quiet=True)
    fragment = result._repr_html_()
    assert "<script>document" not in fragment and "&lt;script&gt;" in fragment
    assert "http" not in fragment   # self-contained: nothing fetched
    page = tmp_path / "analysis.html"
    page.write_text(render_page(result.data), encoding="utf-8")
    out = subprocess.run([BROWSER, *FLAGS, page.as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    title = out.stdout.split("<title>")[1].split("</title>")[0]
    assert "<table" in out.stdout and title.startswith("jaxmem: &lt;script&gt;")   # the name's script never ran
    assert "fits" in out.stdout and "What XLA:TPU holds at its peak" in out.stdout


NOTEBOOK = [
    "import jax, jax.numpy as jnp, jaxmem",
    "def step(w, x):\n    return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)",
    "w, x = jax.ShapeDtypeStruct((256, 256), jnp.float32), jax.ShapeDtypeStruct((16, 256), jnp.float32)\n"
    "jaxmem.analyze(jax.jit(step, donate_argnums=0), w, x, device='tpu-v5e-16gb')",
]


def test_a_notebook_shows_the_analysis_inline():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK])
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3").execute()
    outputs = notebook.cells[-1].outputs
    shown = [o["data"]["text/html"] for o in outputs if o.get("output_type") == "execute_result"]
    assert shown and "<table" in shown[0] and "XLA:TPU tpu-v5e-16gb" in shown[0]
    assert not [o for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout"]


@pytest.mark.browser
@pytest.mark.skipif(BROWSER is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_a_sharded_analysis_renders_in_chromium_with_names_escaped(tmp_path):
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

    mesh = AbstractMesh((8,), ("data",))
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    result = jaxmem.analyze(evil_step, w, x, device="tpu-v5e-16gb", donate=0, quiet=True)
    fragment = result._repr_html_()
    assert "<script>document" not in fragment and "&lt;script&gt;" in fragment and "http" not in fragment
    page = tmp_path / "sharded.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>sharded</title></head>"
                    f"<body>{fragment}</body></html>", encoding="utf-8")
    out = subprocess.run([BROWSER, *FLAGS, page.as_uri()], capture_output=True, text=True, timeout=120)
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    assert "<title>sharded</title>" in out.stdout   # the name's script never ran
    assert "Per device" in out.stdout and "XLA:TPU (tpu-v5e-16gb, v5e:2x4)" in out.stdout
    assert "on 8 x tpu-v5e-16gb: fits" in out.stdout
