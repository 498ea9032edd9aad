"""The `jaxmem analyze --json` contract, checked against JAX's own numbers."""

from __future__ import annotations

import json
import textwrap

import jax
import numpy as np
import pytest

from jaxmem.cli.main import main as cli_main
from jaxmem.compiler.target import load_target
from jaxmem.units import parse_size

SMALL = """
import jax
import jax.numpy as jnp
import numpy as np

def make():
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((256, 512), dtype=np.float32)),
              "w2": jnp.asarray(rng.standard_normal((512, 128), dtype=np.float32))}
    x = jnp.asarray(rng.standard_normal((64, 256), dtype=np.float32))

    def step(params, x):
        def loss(p):
            return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])
        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value

    return step, (params, x)
"""

REQUIRED = {
    "peak_bytes": int, "lower_bound_bytes": int, "argument_bytes": int, "output_bytes": int,
    "xla_total_bytes": int, "num_eqns": int, "plan_seconds": float, "valid": bool,
    "unknown_primitives": list, "top_buffers": list, "fits": bool, "device": dict,
}


def _analyze_json(argv, capsys) -> dict:
    code = cli_main(["analyze", *argv, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def _nbytes(tree) -> int:
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(tree))


def _xla_total(fn, args, donate=()) -> int:
    stats = jax.jit(fn, donate_argnums=donate).lower(*args).compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


def _check_contract(data: dict, fn, args, donate=()) -> None:
    for key, kind in REQUIRED.items():
        assert key in data, key
        assert isinstance(data[key], kind), (key, type(data[key]))
    assert data["valid"] is True
    assert data["peak_bytes"] >= data["lower_bound_bytes"] > 0
    assert data["num_eqns"] > 0 and data["plan_seconds"] > 0
    # Independent truths: the bytes of the arrays JAX is handed and returns, and XLA's own analysis.
    assert data["argument_bytes"] == _nbytes(args)
    assert data["output_bytes"] == _nbytes(jax.eval_shape(fn, *args))
    assert data["xla_total_bytes"] == _xla_total(fn, args, donate)
    # The fit verdict follows from the device's capacity under JAX's 75% preallocation.
    dev = data["device"]
    assert dev["usable_bytes"] == int(0.75 * parse_size(dev["name"]))
    assert data["fits"] == (data["peak_bytes"] <= dev["usable_bytes"])
    # Top buffers: at most ten, largest first, each no larger than the peak.
    sizes = [row["size_bytes"] for row in data["top_buffers"]]
    assert 0 < len(sizes) <= 10 and sizes == sorted(sizes, reverse=True)
    assert sum(sizes) <= data["peak_bytes"]
    for row in data["top_buffers"]:
        assert set(row) >= {"size_bytes", "shape", "dtype", "kind", "category", "label", "source"}


def test_analyze_json_contract_on_a_file_target(tmp_path, capsys):
    path = tmp_path / "small_step.py"
    path.write_text(textwrap.dedent(SMALL))
    target = f"{path}:make"
    data = _analyze_json([target, "--device", "t4-16gb"], capsys)
    fn, args = load_target(target)
    _check_contract(data, fn, args)
    assert data["fits"] is True


def test_analyze_json_donation_and_a_device_that_does_not_fit(tmp_path, capsys):
    path = tmp_path / "small_step_donated.py"
    path.write_text(textwrap.dedent(SMALL))
    target = f"{path}:make"
    data = _analyze_json([target, "--donate", "0", "--device", "1MiB"], capsys)
    fn, args = load_target(target)
    _check_contract(data, fn, args, donate=(0,))
    assert data["donated"] and data["fits"] is False
    undonated = _analyze_json([target, "--device", "1MiB"], capsys)
    # Donating the parameters lets the new parameters take their storage: the peak drops.
    assert data["peak_bytes"] < undonated["peak_bytes"]


@pytest.mark.slow   # the full default model: compile and plan take ~10 s on a shared CPU
def test_analyze_json_default_example_is_the_gpt_training_step(capsys):
    data = _analyze_json([], capsys)
    from jaxmem.examples.gpt import default_example

    fn, args = default_example()
    _check_contract(data, fn, args)
    assert "default_example" in data["target"]
    assert data["num_eqns"] > 1000


def test_analyze_unknown_primitive_is_planned_and_named(tmp_path, capsys):
    path = tmp_path / "custom_prim.py"
    path.write_text(textwrap.dedent("""
        import jax
        import jax.numpy as jnp
        from jax.extend.core import Primitive
        from jax.interpreters import mlir

        twice_p = Primitive("jaxmem_test_twice")
        twice_p.def_impl(lambda x: x * 2)
        twice_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
        mlir.register_lowering(twice_p, mlir.lower_fun(lambda x: x * 2, multiple_results=False))

        def make():
            def fn(x):
                y = jnp.sin(x)
                return twice_p.bind(y) + y
            return fn, (jnp.ones((128, 128)),)
    """))
    target = f"{path}:make"
    # A bare size: jaxmem's plan is the figure (on a GPU preset XLA:GPU fuses the three ops into
    # one, and the plan, 1.5x its total, is not shown).
    data = _analyze_json([target, "--device", "8GiB"], capsys)
    fn, args = load_target(target)
    _check_contract(data, fn, args)
    assert "jaxmem_test_twice" in data["unknown_primitives"]
    cli_main(["analyze", target, "--device", "8GiB"])
    assert "jaxmem_test_twice" in capsys.readouterr().out


def test_analyze_tables_show_the_headline_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "small_tables.py"
    path.write_text(textwrap.dedent(SMALL))
    assert cli_main(["analyze", f"{path}:make", "--device", "a100-40gb"]) == 0
    out = capsys.readouterr().out
    for text in ("jaxmem peak", "XLA total here", "lower bound", "fits", "Largest buffers live at the peak",
                 "a100-40gb"):
        assert text in out, text


def test_analyze_execute_reports_or_says_why_not(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")   # rich wraps headers at its default 80 columns
    path = tmp_path / "small_exec.py"
    path.write_text(textwrap.dedent(SMALL))
    code = cli_main(["analyze", f"{path}:make", "--json", "--execute", "--no-xla"])
    captured = capsys.readouterr()
    try:
        import jaxmem.execution.verify  # noqa: F401
    except ImportError:
        assert code == 2 and "jaxmem.execution.verify" in captured.err and captured.err.count("\n") == 1
        return
    assert code == 0, captured.err
    data = json.loads(captured.out)
    assert data["execute"]["ok"] is True
    assert {"max_abs_err", "max_rel_err", "seconds", "jax_jit_seconds"} <= set(data["execute"])
    assert data["eager"] and all("peak_bytes_in_use" in row for row in data["eager"])
    # Op by op, each result is allocated when made: never less than the planned peak's lower bound.
    assert all(row["peak_bytes_in_use"] >= data["lower_bound_bytes"] * 0.5 for row in data["eager"])
    assert cli_main(["analyze", f"{path}:make", "--execute", "--no-xla"]) == 0
    out = capsys.readouterr().out
    assert "Planned execution against jax.jit" in out and "Eager (op by op)" in out and "vs planned" in out


def test_analyze_hands_the_plan_to_the_report_writers(tmp_path, capsys):
    path = tmp_path / "small_reports.py"
    path.write_text(textwrap.dedent(SMALL))
    trace = tmp_path / "trace.json"
    html = tmp_path / "report.html"
    assert cli_main(["analyze", f"{path}:make", "--no-xla", "--chrome-trace", str(trace), "--html", str(html)]) == 0
    capsys.readouterr()
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("ph") == "C" for e in events)
    assert html.read_text().lstrip().lower().startswith("<!doctype html")


def test_analyze_json_says_the_batch_is_an_input_and_why(tmp_path, capsys):
    path = tmp_path / "small_inputs.py"
    path.write_text(textwrap.dedent(SMALL))
    assert cli_main(["analyze", f"{path}:make", "--json", "--no-xla", "--top", "50"]) == 0
    rows = {r["label"]: r for r in json.loads(capsys.readouterr().out)["top_buffers"] if r["kind"] == "argument"}
    batch = rows["args[1]"]
    assert batch["category"] == "inputs" and batch["category_reason"].startswith("only read")
    weights = [r for label, r in rows.items() if label.startswith("args[0]")]
    assert weights and all(r["category"] == "parameters" and r["category_reason"] == "its updated value is returned"
                           for r in weights)


def test_analyze_tables_are_whole_when_piped(tmp_path, capsys):
    """Piped (stdout is not a terminal), the report is laid out `PIPED_WIDTH` columns wide:
    no cell of the top-buffers or the allocator tables is cut to '…' (a source path's own
    leading '…/' is the report's, not a cut)."""
    import re

    from jaxmem.cli import PIPED_WIDTH

    path = tmp_path / "small_model.py"
    path.write_text(textwrap.dedent(SMALL))
    assert cli_main(["analyze", f"{path}:make", "--device", "t4-16gb", "--execute", "--no-xla"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "│" in line]
    assert rows and not re.search(r"…\s*[│┃]", out), out
    assert "bfc-growth" in out and "platform" in out and "small_model.py:" in out
    assert max(len(line) for line in rows) <= PIPED_WIDTH
