"""The deviceless compilers jaxmem compiles with, kept out of the user's JAX.

JAX's CUDA plugin (with ptxas and libdevice from `nvidia-cuda-nvcc-cu12`) and libtpu give
compile-only GPUs and TPUs on a machine with neither, but installed into an environment they
start in every JAX process of it (and print a traceback and warnings there on a machine
without a GPU). So jaxmem keeps them in a folder of its own, one per JAX version and Python,
`~/.cache/jaxmem/compilers/jax-0.10.2-cp311` (`$JAXMEM_HOME/compilers/...` where that is set),
installed with `pip install --target` at the versions that match the installed JAX: the plugin
of jaxlib's version, the libtpu JAX's `tpu` extra pins. Only the processes that compile for a
GPU or a TPU put that folder on their path (`child_env`, `activate`); JAX finds the plugin
there by its entry point and the `jax_plugins` namespace, the plugin finds ptxas beside it, and
JAX finds libtpu as the `libtpu` package.

    install_compilers()             # what `jaxmem compilers install` runs
    missing_reason("gpu")           # None, or the one line that names that command
    status()["compilers"]["tpu"]    # {"package": "libtpu", "version": ..., "where": ...}
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxmem.errors import ConfigError, JaxmemError

# ptxas and libdevice for the CUDA plugin: the release jaxmem's GPU figures were checked with
# (any CUDA 12 ptxas new enough for the plugin would do).
NVCC_VERSION = "12.9.86"
INSTALL_COMMAND = "jaxmem compilers install"
KINDS = ("gpu", "tpu")
# What the compile processes set: the CUDA plugin of JAX 0.8 and 0.9 refuses to start where no
# CUDA runtime loads (a machine with no GPU) unless told to skip that check; a compile-only
# device needs none.
CHILD_SETTINGS = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


@dataclass(frozen=True)
class Compiler:
    """One deviceless compiler: the package that holds it and the module JAX loads it from."""

    kind: str
    name: str
    package: str
    module: str


COMPILERS: dict[str, Compiler] = {
    "gpu": Compiler("gpu", "XLA:GPU", "jax-cuda12-plugin", "jax_plugins/xla_cuda12"),
    "tpu": Compiler("tpu", "XLA:TPU", "libtpu", "libtpu"),
}


class CompilersUnavailable(JaxmemError):
    """The deviceless compilers cannot be installed here (another platform, no pip, no JAX)."""


# -- versions and places -----------------------------------------------------------------------

def dist_version(name: str, path: Sequence[str] | None = None) -> str | None:
    """The installed version of distribution `name`, in `path`'s folders only when given (else
    this Python's); None when it is not there.

    >>> dist_version("no-such-distribution-jaxmem") is None
    True
    """
    from importlib import metadata

    if path is None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    wanted = _normal(name)
    for dist in metadata.distributions(path=list(path)):
        if _normal(dist.metadata["Name"] or "") == wanted:
            return dist.version
    return None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def jax_versions() -> tuple[str, str]:
    """(jax, jaxlib) as installed in this Python, from their metadata (JAX is not imported).

    Raises:
        CompilersUnavailable: JAX is not installed.
    """
    jax, jaxlib = dist_version("jax"), dist_version("jaxlib")
    if not jax or not jaxlib:
        raise CompilersUnavailable("JAX is not installed in this Python (pip install jax)")
    return jax, jaxlib


def python_tag() -> str:
    """This Python's wheel tag, as the plugin's wheels are built per Python (`cp311`)."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def home() -> str:
    """`$JAXMEM_HOME`, else `$XDG_CACHE_HOME/jaxmem`, else `~/.cache/jaxmem`."""
    explicit = os.environ.get("JAXMEM_HOME")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxmem")


def folder_name(jax: str, jaxlib: str, tag: str) -> str:
    """The folder of one JAX's compilers (jaxlib named too where it differs from JAX).

    >>> folder_name("0.10.2", "0.10.2", "cp311"), folder_name("0.10.2", "0.10.1", "cp312")
    ('jax-0.10.2-cp311', 'jax-0.10.2-jaxlib-0.10.1-cp312')
    """
    return f"jax-{jax}-{tag}" if jax == jaxlib else f"jax-{jax}-jaxlib-{jaxlib}-{tag}"


def folder() -> str:
    """Where the compilers matching this Python's JAX live (whether or not installed yet)."""
    jax, jaxlib = jax_versions()
    return os.path.join(home(), "compilers", folder_name(jax, jaxlib, python_tag()))


def _managed() -> str | None:
    """The managed folder when it exists, else None (also when JAX is missing)."""
    try:
        path = folder()
    except CompilersUnavailable:
        return None
    return path if os.path.isdir(path) else None


def platform_reason() -> str | None:
    """Why the compilers cannot run on this platform, or None (Linux x86-64)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"JAX's CUDA plugin and libtpu are only published for Linux x86-64, not {sys.platform} {platform.machine()}"
    return None


# -- what is needed and what is there ----------------------------------------------------------

def required_libtpu(requires: Sequence[str] | None = None) -> str | None:
    """The libtpu version JAX's `tpu` extra pins, from the installed JAX's metadata.

    >>> required_libtpu(['libtpu==0.0.42.*; extra == "tpu"', 'numpy>=2.0'])
    '0.0.42.*'
    """
    if requires is None:
        from importlib.metadata import PackageNotFoundError, requires as read

        try:
            requires = read("jax") or []
        except PackageNotFoundError:
            return None
    for line in requires:
        m = re.match(r"\s*libtpu\s*==\s*([0-9.*]+)", line)
        if m:
            return m.group(1)
    return None


def version_matches(have: str, wanted: str) -> bool:
    """Whether version `have` satisfies `==wanted` as pip reads it (`0.0.37.*` takes 0.0.37).

    >>> version_matches("0.0.37", "0.0.37.*"), version_matches("0.0.42.1", "0.0.42.*"), version_matches("0.0.420", "0.0.42.*")
    (True, True, False)
    """
    if not wanted.endswith(".*"):
        return have == wanted
    prefix = wanted[:-2]
    return have == prefix or have.startswith(prefix + ".")


def requirements(kind: str, jaxlib: str, libtpu: str | None) -> list[str]:
    """What pip installs for one compiler, every version fixed.

    >>> requirements("gpu", "0.10.2", None)
    ['jax-cuda12-plugin==0.10.2', 'jax-cuda12-pjrt==0.10.2', 'nvidia-cuda-nvcc-cu12==12.9.86']
    >>> requirements("tpu", "0.10.2", "0.0.42.*")
    ['libtpu==0.0.42.*']
    """
    if kind == "gpu":
        return [f"jax-cuda12-plugin=={jaxlib}", f"jax-cuda12-pjrt=={jaxlib}", f"nvidia-cuda-nvcc-cu12=={NVCC_VERSION}"]
    if kind == "tpu":
        if not libtpu:
            raise CompilersUnavailable("the installed JAX names no libtpu version in its `tpu` extra")
        return [f"libtpu=={libtpu}"]
    raise ConfigError(f"unknown compiler {kind!r}; one of: {', '.join(KINDS)}")


def _present(compiler: Compiler, path: str) -> bool:
    return os.path.isfile(os.path.join(path, compiler.module, "__init__.py"))


def where(kind: str) -> str | None:
    """Where compiler `kind` is found: the managed folder, "environment" (installed into this
    Python, as a GPU user's `jax[cuda12]` is), or None."""
    compiler = COMPILERS[kind]
    managed = _managed()
    if managed and _present(compiler, managed):
        return managed
    import importlib.util

    try:
        found = importlib.util.find_spec(compiler.module.replace("/", ".")) is not None
    except (ImportError, ValueError):
        found = False
    return "environment" if found else None


def installed_version(kind: str) -> str | None:
    """The version of compiler `kind`'s package where it is found, or None."""
    place = where(kind)
    if place is None:
        return None
    return dist_version(COMPILERS[kind].package, None if place == "environment" else [place])


def missing_reason(kind: str) -> str | None:
    """One line saying that compiler `kind` is missing and the command that installs it, or None."""
    reason = platform_reason()
    if reason:
        return reason
    if where(kind) is not None:
        return None
    try:
        jax, _ = jax_versions()
    except CompilersUnavailable as err:
        return str(err)
    return f"the {COMPILERS[kind].name} compiler for JAX {jax} is not installed: run `{INSTALL_COMMAND}`"


def versions(kind: str) -> str:
    """The compiler's package versions, for cache keys: figures of another compiler are others.

    >>> isinstance(versions("gpu"), str)
    True
    """
    if kind == "gpu":
        names = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12")
    else:
        names = ("libtpu",)
    return " ".join(f"{name} {dist_version(name) or '-'}" for name in names)


# -- the processes that compile ----------------------------------------------------------------

def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the managed folder first on PYTHONPATH (where it exists): for the processes
    that compile for a GPU or TPU, and for no other."""
    managed = _managed()
    env = {**env, **{k: v for k, v in CHILD_SETTINGS.items() if k not in env}}
    return with_path(env, managed) if managed else env


def with_path(env: dict[str, str], path: str) -> dict[str, str]:
    """A copy of `env` with `path` first on PYTHONPATH (once).

    >>> with_path({"PYTHONPATH": "/a:/c"}, "/c")["PYTHONPATH"], with_path({}, "/c")["PYTHONPATH"]
    ('/c:/a', '/c')
    """
    out = dict(env)
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != path]
    out["PYTHONPATH"] = os.pathsep.join([path, *rest])
    return out


def activate() -> str | None:
    """Put the managed folder on this process's path (a process that compiles in itself: `jaxmem
    fit --device`); the folder, or None where it does not exist. Before JAX starts its backends,
    JAX finds the plugin there."""
    managed = _managed()
    for name, value in CHILD_SETTINGS.items():
        os.environ.setdefault(name, value)
    if managed and managed not in sys.path:
        sys.path.insert(1 if sys.path else 0, managed)
    return managed


# -- installing --------------------------------------------------------------------------------

def install_compilers(kinds: Sequence[str] = KINDS, *, force: bool = False,
                      pip: Sequence[str] | None = None,
                      run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    """Install the deviceless compilers matching this Python's JAX into the managed folder.

    >>> install_compilers(("gpu",))["compilers"]["gpu"]["version"]   # doctest: +SKIP
    '0.10.2'

    Args:
        kinds: "gpu" (JAX's CUDA plugin, ptxas), "tpu" (libtpu), or both.
        force: install again even where the right versions are there.
        pip: the pip command (default: this Python's `-m pip`).
        run: how to run it (`subprocess.run`'s signature).

    Returns:
        `status()` after the install, with `installed`: the requirements pip installed.

    Raises:
        CompilersUnavailable: not Linux x86-64, no JAX, or pip failed (its last line).
    """
    reason = platform_reason()
    if reason:
        raise CompilersUnavailable(reason)
    for kind in kinds:
        if kind not in COMPILERS:
            raise ConfigError(f"unknown compiler {kind!r}; one of: {', '.join(KINDS)}")
    _, jaxlib = jax_versions()
    target = folder()
    wanted = [r for kind in kinds if force or not _up_to_date(kind, target)
              for r in requirements(kind, jaxlib, required_libtpu())]
    if wanted:
        _pip_install(wanted, target, list(pip) if pip else [sys.executable, "-m", "pip"], run)
    return {**status(), "installed": wanted}


def _up_to_date(kind: str, target: str) -> bool:
    """Whether `target` holds compiler `kind` at the versions this JAX needs."""
    if not _present(COMPILERS[kind], target):
        return False
    have = dist_version(COMPILERS[kind].package, [target]) or ""
    if kind == "gpu":
        return have == jax_versions()[1]
    return version_matches(have, required_libtpu() or have)


def _pip_install(wanted: list[str], target: str, pip: list[str], run: Callable[..., Any]) -> None:
    """pip-install `wanted` (no dependencies: JAX, numpy and the rest are the user's) into a new
    folder beside `target`, then move each of its entries into `target`, replacing the old."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".install-", dir=os.path.dirname(target))
    try:
        cmd = [*pip, "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
               "--target", staging, *wanted]
        done = run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
            last = lines[-1].strip() if lines else f"exit {done.returncode}"
            raise CompilersUnavailable(f"pip could not install {' '.join(wanted)}: {last[:300]}")
        _merge(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _merge(staging: str, target: str) -> None:
    """Move every top-level entry of `staging` into `target`, replacing an entry of that name
    (and, for a package's `*.dist-info`, its older versions)."""
    os.makedirs(target, exist_ok=True)
    for entry in sorted(os.listdir(staging)):
        if entry.endswith(".dist-info"):
            stem = entry.split("-", 1)[0].lower()
            for old in os.listdir(target):
                if old.endswith(".dist-info") and old.split("-", 1)[0].lower() == stem:
                    shutil.rmtree(os.path.join(target, old), ignore_errors=True)
        dest = os.path.join(target, entry)
        if os.path.isdir(dest) and not os.path.islink(dest):
            shutil.rmtree(dest)
        elif os.path.lexists(dest):
            os.remove(dest)
        shutil.move(os.path.join(staging, entry), dest)


def status() -> dict[str, Any]:
    """What is installed, for which JAX, and where.

    >>> sorted(status())   # doctest: +SKIP
    ['compilers', 'folder', 'jax', 'jaxlib', 'python']
    """
    jax, jaxlib = jax_versions()
    libtpu = required_libtpu()
    compilers = {}
    for kind, compiler in COMPILERS.items():
        compilers[kind] = {"name": compiler.name, "package": compiler.package, "where": where(kind),
                           "version": installed_version(kind),
                           "needs": jaxlib if kind == "gpu" else libtpu}
    return {"jax": jax, "jaxlib": jaxlib, "python": python_tag(), "folder": folder(), "compilers": compilers}
