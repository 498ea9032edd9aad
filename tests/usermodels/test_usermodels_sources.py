"""On models written with Flax (linen and NNX) and Equinox, every source line a report shows is
the user's own line (this folder's `user_models.py`), with the library's frame kept beside it."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from user_models import STEPS

import jaxmem
from jaxmem.cli.main import main as cli_main
from jaxmem.compiler import jaxpr_adapter as ja

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_models.py")
LIBRARY = {"flax_linen": "/flax/linen/", "flax_nnx": "/flax/nnx/", "equinox": "/equinox/"}


def _file(source: str) -> str:
    return source.rsplit(":", 1)[0] if " (" not in source else source.rsplit(" (", 1)[0].rsplit(":", 1)[0]


@pytest.mark.parametrize("name", sorted(STEPS))
def test_analyze_names_the_users_line_and_keeps_the_library_frame(name, capsys):
    assert cli_main(["analyze", f"{HERE}:{STEPS[name].__name__}", "--json", "--no-xla", "--top", "40"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["top_buffers"] if r["source"]]
    assert rows
    assert all(_file(r["source"]) == HERE for r in rows), [r["source"] for r in rows]
    # values made inside a library (a layer's matmul, optax's update) keep its frame beside
    through = [r for r in rows if r["library_source"]]
    assert through and all("/site-packages/" in r["library_source"] for r in through)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_layers_matmuls_are_the_users_lines_made_in_the_library(name):
    step, args = STEPS[name]()
    plan = jaxmem.plan(step, *args, xla=False)
    dots = [s.source for s in plan.schedule if s.primitive == "dot_general"]
    assert dots and all(d is not None and d.file == HERE for d in dots)
    assert any(d.library is not None and LIBRARY[name] in d.library.file for d in dots)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_profiles_start_their_stacks_at_the_users_frame(name):
    step, args = STEPS[name]()
    plan = jaxmem.plan(step, *args, xla=False)
    stacks = [ja.user_frames(s.eqn) for s in plan.schedule if s.eqn is not None and s.primitive == "dot_general"]
    assert stacks and all(stack and stack[0][0] == HERE for stack in stacks)


def test_fit_advice_names_the_users_lines():
    step, args = STEPS["flax_linen"](batch_size=4096)   # activations, not weights, dominate
    result = jaxmem.fit(step, *args, budget=int(0.7 * jaxmem.plan(step, *args).xla.total_bytes), max_rounds=3)
    sources = [v.source for v in result.recomputed]
    assert sources and all(s is not None and s.file == HERE for s in sources)


def test_a_target_installed_among_libraries_is_still_the_users_code(tmp_path, capsys, monkeypatch):
    package = tmp_path / "lib" / "site-packages" / "mymodel"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent("""
        import jax.numpy as jnp

        def make():
            def step(w, x):
                return jnp.tanh(x @ w).sum()      # the user's line
            return step, (jnp.ones((256, 256)), jnp.ones((512, 256)))
    """))
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setattr(ja, "_USER_DIRS", list(ja._USER_DIRS))
    ja._frame_kind.cache_clear()
    try:
        assert cli_main(["analyze", "mymodel:make", "--json", "--no-xla"]) == 0
    finally:
        sys.modules.pop("mymodel", None)
        ja._frame_kind.cache_clear()
    rows = [r for r in json.loads(capsys.readouterr().out)["top_buffers"] if r["source"]]
    assert rows and all(_file(r["source"]) == str(package / "__init__.py") for r in rows)


def test_code_typed_into_a_notebook_cell_is_the_users():
    import jax
    import jax.numpy as jnp

    scope = {"jnp": jnp}
    exec(compile("def cell(x):\n    return jnp.tanh(x) * 2\n", "<ipython-input-3-5f2a>", "exec"), scope)
    eqns = jax.make_jaxpr(scope["cell"])(jnp.ones((4, 4))).jaxpr.eqns
    assert [(s.file, s.line) for s in map(ja.source_line, eqns)] == [("<ipython-input-3-5f2a>", 2)] * 2
