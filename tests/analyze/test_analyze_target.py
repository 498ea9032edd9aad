"""TARGET loading and the CLI's error paths: every bad TARGET is one line on stderr and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxmem.cli.main import main as cli_main
from jaxmem.compiler.target import load_target, split_target
from jaxmem.errors import PlanError

GOOD = """
import jax.numpy as jnp

def make():
    return (lambda x: x * 2.0), (jnp.ones((4, 4)),)
"""


def _write(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_analyze_file_and_module_targets_load(tmp_path):
    fn, args = load_target(_write(tmp_path, "good_target.py", GOOD) + ":make")
    assert float(fn(*args).sum()) == 32.0
    fn, args = load_target("jaxmem.examples.suite:while_cond")
    assert callable(fn) and len(args) == 2


def test_analyze_file_target_may_import_its_siblings(tmp_path):
    _write(tmp_path, "sibling_helper_mod.py", "SCALE = 3.0\n")
    path = _write(tmp_path, "uses_sibling.py", """
        import jax.numpy as jnp
        from sibling_helper_mod import SCALE

        def make():
            return (lambda x: x * SCALE), [jnp.ones(2)]
    """)
    fn, args = load_target(path + ":make")
    assert isinstance(args, tuple) and float(fn(*args)[0]) == 3.0


BAD_FILES = {
    "import_error": ("import not_a_real_module_xyz\ndef make():\n    return None\n", "make", "cannot import"),
    "syntax_error": ("def make(:\n", "make", "SyntaxError"),
    "no_attribute": (GOOD, "missing", "no attribute 'missing'"),
    "not_callable": ("make = 3\n", "make", "not a callable"),
    "factory_raises": ("def make():\n    raise RuntimeError('boom\\nsecond line')\n", "make", "RuntimeError: boom second line"),
    "returns_none": ("def make():\n    return None\n", "make", "must return (fn, args)"),
    "returns_three": ("def make():\n    return (abs, (1,), {})\n", "make", "3-tuple"),
    "fn_not_callable": ("def make():\n    return (1, (1,))\n", "make", "callable fn"),
    "args_not_tuple": ("def make():\n    return (abs, 1.0)\n", "make", "args a tuple"),
    "system_exit": ("import sys\nsys.exit(3)\n", "make", "SystemExit"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_analyze_bad_file_targets_raise_one_line_plan_errors(tmp_path, case):
    body, attr, expected = BAD_FILES[case]
    path = _write(tmp_path, f"bad_{case}.py", body)
    with pytest.raises(PlanError) as info:
        load_target(f"{path}:{attr}")
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("target, expected", [
    ("no_colon_here", "must be"),
    (":factory", "must be"),
    ("module:", "must be"),
    ("jaxmem.examples.suite:not a name", "not a Python name"),
    ("does_not_exist_pkg_xyz:make", "cannot import module"),
    ("jaxmem.examples.suite:nothing_here", "no attribute"),
    ("jaxmem.examples.suite:PROGRAMS", "not a callable"),
    ("/no/such/dir/model.py:make", "does not exist"),
])
def test_analyze_bad_target_strings(target, expected):
    with pytest.raises(PlanError, match=expected.replace("(", r"\(")):
        load_target(target)


def test_analyze_split_target_keeps_dotted_attributes():
    assert split_target("pkg.mod:Factory.build") == ("pkg.mod", "Factory.build")


def test_analyze_cli_bad_targets_exit_2_with_one_line(tmp_path, capsys):
    cases = [
        "no_colon_here",
        "does_not_exist_pkg_xyz:make",
        _write(tmp_path, "cli_bad.py", "def make():\n    return 42\n") + ":make",
        _write(tmp_path, "cli_nc.py", "make = 'x'\n") + ":make",
    ]
    for target in cases:
        assert cli_main(["analyze", target]) == 2
        err = capsys.readouterr().err
        assert err.startswith("jaxmem analyze: error:") and err.count("\n") == 1, err
        assert "Traceback" not in err


def test_analyze_cli_bad_options_exit_2(capsys):
    assert cli_main(["analyze", "jaxmem.examples.suite:while_cond", "--donate", "x"]) == 2
    assert "--donate" in capsys.readouterr().err
    assert cli_main(["analyze", "jaxmem.examples.suite:while_cond", "--donate", "5"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert cli_main(["analyze", "jaxmem.examples.suite:while_cond", "--device", "bogus-gpu"]) == 2
    assert "--device" in capsys.readouterr().err


def test_analyze_cli_function_that_fails_to_trace_is_one_line(tmp_path, capsys):
    path = _write(tmp_path, "shape_bug.py", """
        import jax.numpy as jnp

        def make():
            return (lambda a, b: a @ b), (jnp.ones((3, 4)), jnp.ones((5, 6)))
    """)
    assert cli_main(["analyze", path + ":make", "--no-xla"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "TypeError" in err


def test_analyze_real_entry_point_prints_no_traceback(tmp_path):
    """Through a fresh interpreter, as a user runs it."""
    path = _write(tmp_path, "entry_bad.py", "import nope_not_here_xyz\n")
    code = "import sys; from jaxmem.cli.main import entry; sys.argv = ['jaxmem'] + sys.argv[1:]; entry()"
    proc = subprocess.run([sys.executable, "-c", code, "analyze", path + ":make"],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "ModuleNotFoundError" in proc.stderr
