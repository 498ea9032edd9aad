"""A TARGET's own code raising anything at all, and report paths of the wrong kind, end as one
line on stderr and exit code 2, through the real command line in a subprocess; Ctrl-C in a
factory still ends as an interruption, exit code 130."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from abuse_helpers import assert_one_line, child_env, jaxmem_argv

FACTORIES = """\
import pathlib
import sys

import jax.numpy as jnp


class Mine(BaseException):
    pass


def base_exception():
    raise Mine("from the\\nfactory")


def system_exit():
    sys.exit(3)


def generator_exit():
    raise GeneratorExit


def ctrl_c():
    raise KeyboardInterrupt


def fn_exits():
    def f(x):
        sys.exit(5)
    return f, (jnp.ones(3),)


def sized(n):
    raise Mine(f"n={n}")


def touches():
    pathlib.Path(__file__).with_name("loaded").touch()
    return (lambda x: x * 2), (jnp.ones(3),)
"""


@pytest.fixture
def target(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


def _run(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=child_env(tmp_path / "state", JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("factory,needle", [("base_exception", "Mine: from the factory"),
                                            ("system_exit", "SystemExit: 3"),
                                            ("generator_exit", "GeneratorExit"),
                                            ("fn_exits", "SystemExit: 5")])
def test_a_factory_raising_any_exception_is_one_line(tmp_path: Path, target: Path, factory: str, needle: str) -> None:
    done = _run(tmp_path, jaxmem_argv("analyze", f"{target}:{factory}", "--no-xla"))
    assert_one_line(done, "jaxmem analyze: error:", needle)


def test_ctrl_c_in_a_factory_is_an_interruption(tmp_path: Path, target: Path) -> None:
    done = _run(tmp_path, jaxmem_argv("analyze", f"{target}:ctrl_c", "--no-xla"))
    assert_one_line(done, "interrupted", code=130)


@pytest.mark.parametrize("child,extra", [("jaxmem.xla.gpu", ["--spec", "h100_sxm", "--kwarg", "n=3"]),
                                         ("jaxmem.xla.tpu", ["--device", "tpu-v5e-16gb", "--kwarg", "n=3"])])
def test_a_compile_child_answers_a_base_exception_in_one_line(tmp_path: Path, target: Path, child: str,
                                                              extra: list[str]) -> None:
    """The children that load a factory report it as their one error line, exit 2, which the
    parent raises again as a `PlanError` (a `SystemExit(3)` must not pass for "unavailable")."""
    done = _run(tmp_path, [sys.executable, "-m", child, f"{target}:sized", *extra])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: TARGET '{target}:sized': the factory(n=3) raised Mine: n=3"


def test_the_cpu_child_answers_system_exit_of_the_function_in_one_line(tmp_path: Path, target: Path) -> None:
    done = _run(tmp_path, [sys.executable, "-m", "jaxmem.xla.cpu", f"{target}:fn_exits"])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("SystemExit: 5")


@pytest.mark.parametrize("flag,name", [("--png", "t.xyz"), ("--html", "t.png"), ("--pprof", "t.json"),
                                       ("--chrome-trace", "t.html")])
def test_a_report_path_of_the_wrong_kind_is_refused_before_any_work(tmp_path: Path, target: Path, flag: str,
                                                                    name: str) -> None:
    out = str(tmp_path / name)
    done = _run(tmp_path, jaxmem_argv("analyze", f"{target}:touches", "--no-xla", flag, out))
    assert_one_line(done, flag, repr(out))
    assert not (tmp_path / name).exists()
    assert not (tmp_path / "loaded").exists()   # refused before the TARGET was even imported
