"""The deviceless compilers in jaxmem's own folder (`xla.compilers`): installed by pip into it
(a stand-in pip here), found there, named by the one-line message when missing, and seen by
jaxmem's compile processes only. `smoke.sh` beside this file installs jaxmem beside JAX 0.8
and 0.9 for real (CI runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxmem.cli.main import main as cli
from jaxmem.xla import compilers


def fake_pip(calls: list[list[str]], returncode: int = 0):
    """A `subprocess.run` that, as pip would, writes each requirement's package and metadata
    into the `--target` folder."""

    def run(cmd, **kwargs):
        calls.append(cmd)
        target = cmd[cmd.index("--target") + 1]
        for req in cmd[cmd.index(target) + 1:]:
            name, version = req.split("==")
            version = version.replace("*", "1")
            module = {"jax-cuda12-plugin": "jax_plugins/xla_cuda12", "libtpu": "libtpu"}.get(name)
            if module:
                os.makedirs(os.path.join(target, module), exist_ok=True)
                open(os.path.join(target, module, "__init__.py"), "w").close()
            info = os.path.join(target, f"{name.replace('-', '_')}-{version}.dist-info")
            os.makedirs(info, exist_ok=True)
            with open(os.path.join(info, "METADATA"), "w") as f:
                f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        return SimpleNamespace(returncode=returncode, stdout="", stderr="ERROR: No matching distribution found")

    return run


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXMEM_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.skipif(compilers.platform_reason() is not None, reason="Linux x86-64 only")
def test_install_puts_the_matching_versions_in_the_folder_once(home):
    calls: list[list[str]] = []
    state = compilers.install_compilers(run=fake_pip(calls))
    jax, jaxlib = compilers.jax_versions()
    assert state["folder"] == str(home / "compilers" / compilers.folder_name(jax, jaxlib, compilers.python_tag()))
    assert state["installed"] == [f"jax-cuda12-plugin=={jaxlib}", f"jax-cuda12-pjrt=={jaxlib}",
                                  f"nvidia-cuda-nvcc-cu12=={compilers.NVCC_VERSION}",
                                  f"libtpu=={compilers.required_libtpu()}"]
    assert "--no-deps" in calls[0]   # JAX, numpy and the rest stay the user's
    assert {kind: row["where"] for kind, row in state["compilers"].items()} == {"gpu": state["folder"],
                                                                               "tpu": state["folder"]}
    assert state["compilers"]["gpu"]["version"] == jaxlib
    assert compilers.install_compilers(run=fake_pip(calls))["installed"] == [] and len(calls) == 1
    assert compilers.install_compilers(("tpu",), force=True, run=fake_pip(calls))["installed"][0].startswith("libtpu==")
    assert not [e for e in os.listdir(home / "compilers") if e.startswith(".install-")]


@pytest.mark.skipif(compilers.platform_reason() is not None, reason="Linux x86-64 only")
def test_a_failed_pip_is_one_line_and_leaves_nothing(home):
    with pytest.raises(compilers.CompilersUnavailable, match="^pip could not install libtpu==.*: ERROR: No matching"):
        compilers.install_compilers(("tpu",), run=fake_pip([], returncode=1))
    assert compilers.where("tpu") != compilers.folder()


def test_missing_compiler_names_the_install_command(home, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("libtpu", "jax_plugins.xla_cuda12") else real(name, *a))
    jax = compilers.jax_versions()[0]
    for kind, name in (("gpu", "XLA:GPU"), ("tpu", "XLA:TPU")):
        reason = compilers.missing_reason(kind)
        assert reason == compilers.platform_reason() or reason == (
            f"the {name} compiler for JAX {jax} is not installed: run `jaxmem compilers install`")
    assert cli(["compilers", "status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"JAX {jax} ") and out[1].endswith("not installed (jaxmem compilers install)")


def test_only_compile_processes_get_the_folder(home):
    os.makedirs(compilers.folder())
    env = compilers.child_env({"PYTHONPATH": "/mine"})
    assert env["PYTHONPATH"] == os.pathsep.join([compilers.folder(), "/mine"])
    assert env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
    from jaxmem.xla.gpu.compile import child_env as gpu_env
    from jaxmem.xla.tpu.compile import child_env as tpu_env

    assert gpu_env("/d", {})["PYTHONPATH"] == tpu_env("/d", {})["PYTHONPATH"] == compilers.folder()


@pytest.mark.skipif(compilers.where("gpu") in (None, "environment"), reason="no compilers in jaxmem's folder")
def test_a_plain_python_sees_no_compilers():
    """The user's own Python (no PYTHONPATH from jaxmem) finds neither the CUDA plugin nor libtpu."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and p != compilers.folder())
    script = ("import importlib.util as u; print(u.find_spec('jax_plugins') is None or "
              "u.find_spec('jax_plugins.xla_cuda12') is None, u.find_spec('libtpu') is None)")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr
