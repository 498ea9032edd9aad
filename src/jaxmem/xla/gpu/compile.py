"""XLA:GPU's own memory figures for a function, compiled for an H100, A100, ... on a machine
with no GPU: a deviceless compile in a subprocess, cached by program and target.

The CUDA PJRT plugin (`jax-cuda12-plugin`, with `nvidia-cuda-nvcc-cu12` for ptxas and
libdevice) gives a compile-only CUDA device from a `GpuTargetConfigProto` (XLA's hardware
description; jaxmem ships XLA's own, see `targets/`). With `JAX_PLATFORMS=cpu` set before
JAX starts, the child process builds a 1-GPU topology, gives every argument a
`jax.ShapeDtypeStruct` with a sharding on it, lowers, compiles and reads
`compiled.memory_analysis()`. XLA's buffer-assignment dumps (`--xla_dump_to`) say which buffers
are live at XLA's peak, with their HLO metadata (op_name, source file and line).

    ref = xla_gpu_reference("jaxmem.examples.suite:mlp_train", device="h100-80gb")
    ref.total_bytes, ref.temp_bytes, ref.peak_buffers[0]

Run as a module, it prints one JSON object (the subprocess side):

    JAX_PLATFORMS=cpu python -m jaxmem.xla.gpu jaxmem.examples.suite:mlp_train --spec h100_sxm
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Sequence

from jaxmem.accelerators import ACCELERATORS
from jaxmem.compiler.plan_types import MemoryAnalysisTotal
from jaxmem.errors import JaxmemError, PlanError, ShardingError

# jaxmem GPU preset -> XLA's target description (targets/<name>.txtpb), from the one table of
# presets (`jaxmem.accelerators`). Capacity always comes from the preset; the description gives
# XLA the compute capability, SM count, shared memory and so on that its fusion and layout
# choices read.
GPU_TARGETS: dict[str, str] = {a.name: a.gpu_spec for a in ACCELERATORS.values() if a.gpu_spec}
CACHE_VERSION = 1
TOP_BUFFERS = 10


class GpuUnavailable(JaxmemError):
    """Deviceless XLA:GPU compiles cannot run here (no CUDA plugin for this platform, or it did
    not load); callers fall back to XLA:CPU and say so in one line."""


@dataclass
class XlaGpuReference(MemoryAnalysisTotal):
    """XLA:GPU's figures for one program on one target (what `--json` prints as `xla_gpu`).

    `arguments` and `outputs` are per flat leaf, in order: `{"bytes", "donated"}` and
    `{"bytes", "aliases"}` (the flat argument whose buffer the output takes, or None), for the
    pool simulation. `peak_buffers` are the largest buffers live at XLA's peak.
    """

    target: str
    spec: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    compile_seconds: float
    generated_code_bytes: int = 0
    cached: bool = False
    key: str = ""
    arguments: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    peak_buffers: list[dict[str, Any]] = field(default_factory=list)
    peak_live_bytes: int = 0
    note: str = ""
    oom: str = ""   # XLA:TPU's out-of-memory message when its compile refused the program
    reserved_bytes: int | None = None   # XLA:TPU: the reservation its runtime holds for the temporaries
    # XLA:TPU: the programs the factory ran before the step (`xla.tpu.factory`): their count,
    # their code (resident on the chip) and their largest temporaries; None when none ran.
    factory: dict[str, int] | None = None

    def summary(self) -> dict[str, Any]:
        """The JSON `xla_gpu` object: target, the byte figures and compile_seconds."""
        return {"target": self.target, "spec": self.spec, "argument_bytes": self.argument_bytes,
                "output_bytes": self.output_bytes, "temp_bytes": self.temp_bytes,
                "alias_bytes": self.alias_bytes, "total_bytes": self.total_bytes,
                "compile_seconds": round(self.compile_seconds, 3), "cached": self.cached, "note": self.note}


# -- targets ---------------------------------------------------------------------------------

def spec_for(device: str) -> str | None:
    """The XLA target description jaxmem uses for a device preset, or None (not a GPU preset).

    >>> spec_for("h100-80gb"), spec_for("tpu-v5e-16gb")
    ('h100_sxm', None)
    """
    return GPU_TARGETS.get(device.strip().lower())


def target_config(spec: str) -> str:
    """The text of a shipped `GpuTargetConfigProto` (`targets/<spec>.txtpb`)."""
    try:
        return resources.files("jaxmem.xla.gpu").joinpath("targets", f"{spec}.txtpb").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        names = sorted(set(GPU_TARGETS.values()))
        raise PlanError(f"no GPU target description {spec!r}; jaxmem ships {', '.join(names)}") from None


def with_memory(text: str, capacity: int) -> str:
    r"""A target description with `device_memory_size` set to `capacity` bytes: XLA:GPU's
    scheduler and rematerialization read it (they try to keep the program within the device),
    so the preset's capacity, not the description's, must be what XLA sees.

    >>> with_memory("gpu_device_info {\n  device_memory_size: 42331013120\n}", 1024)
    'gpu_device_info {\n  device_memory_size: 1024\n}'
    """
    replaced, count = re.subn(r"(?m)^(\s*device_memory_size:\s*)\d+", lambda m: f"{m.group(1)}{int(capacity)}", text, count=1)
    if count:
        return replaced
    return text.replace("gpu_device_info {", f"gpu_device_info {{\n  device_memory_size: {int(capacity)}", 1)


def drop_field(text: str, field: str) -> str:
    r"""A target description without `field` (a line `field: value` or a block `field { ... }`),
    for an XLA older than the description: its parser refuses a field it does not know.

    >>> drop_field("a {\n  b: 1\n  c {\n    d: 2\n  }\n  e: 3\n}", "c")
    'a {\n  b: 1\n  e: 3\n}'
    """
    kept: list[str] = []
    depth = 0
    for line in text.splitlines():
        stripped = line.strip()
        if depth:
            depth += stripped.count("{") - stripped.count("}")
            continue
        if re.match(rf"{re.escape(field)}\s*[:{{]", stripped):
            depth = stripped.count("{") - stripped.count("}")
            continue
        kept.append(line)
    return "\n".join(kept)


_UNKNOWN_FIELD_RE = re.compile(r'has no field named "(\w+)"')


def cuda_topology(text: str, topology: str = "1x1x1") -> tuple[Any, str]:
    """(JAX's compile-only CUDA topology for a target description, the description it took).
    An older XLA (JAX 0.8, 0.9) refuses fields newer than itself, naming each in its log on
    stderr: those are dropped, one at a time, and the description tried again."""
    from jax.experimental import topologies

    while True:
        failure = None
        with _StderrCapture() as log:
            try:
                topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology=topology)
            except Exception as err:
                failure = err
        unknown = _UNKNOWN_FIELD_RE.findall(log.text)
        if failure is None or not unknown or unknown[0] not in text:
            sys.stderr.write(log.text)
            if failure is not None:
                raise failure
            return topo, text
        text = drop_field(text, unknown[0])   # shorter each time: the loop ends


class _StderrCapture:
    """What the process writes to file descriptor 2 inside the `with` (XLA's C++ log), in `.text`."""

    def __enter__(self) -> "_StderrCapture":
        self.text = ""
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._sink = tempfile.TemporaryFile(mode="w+b")
        os.dup2(self._sink.fileno(), 2)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._sink.seek(0)
        self.text = self._sink.read().decode("utf-8", "replace")
        self._sink.close()


def unavailable_reason() -> str | None:
    """Why deviceless CUDA compiles cannot run on this machine, or None when they can: the CUDA
    plugin and ptxas are looked for in jaxmem's folder of compilers, then in this Python
    (`xla.compilers`)."""
    from jaxmem.xla import compilers

    return compilers.missing_reason("gpu")


# -- the cache -------------------------------------------------------------------------------

def cache_dir() -> str:
    """`$JAXMEM_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxmem/xla_gpu`, else `~/.cache/jaxmem/xla_gpu`."""
    explicit = os.environ.get("JAXMEM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxmem", "xla_gpu")


def cache_key(lowered_text: str, spec_text: str, versions: str, flags: str) -> str:
    """sha256 over the lowered StableHLO, the target description, JAX's and the compiler's
    versions and XLA flags.

    >>> len(cache_key("module", "gpu_device_info {}", "0.10.2", ""))
    64
    """
    digest = hashlib.sha256()
    for part in (f"v{CACHE_VERSION}", lowered_text, spec_text, versions, flags):
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


_REQUIRED = ("target", "spec", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "compile_seconds")


def cache_read(directory: str, key: str) -> dict[str, Any] | None:
    """The cached figures for `key`, or None when absent, unreadable or corrupt (ignored)."""
    try:
        with open(os.path.join(directory, f"{key}.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not all(k in data for k in _REQUIRED):
        return None
    if not all(isinstance(data[k], (int, float)) and not isinstance(data[k], bool) for k in _REQUIRED[2:]):
        return None
    return data


def cache_write(directory: str, key: str, data: dict[str, Any]) -> None:
    """Write `data` for `key` atomically; a cache that cannot be written is skipped silently."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(directory, f"{key}.json"))
    except OSError:
        pass


def dump_dir_from_flags(flags: str | None = None) -> str | None:
    """Where XLA writes its dumps: the last `--xla_dump_to=` in `flags` (default: $XLA_FLAGS).

    >>> dump_dir_from_flags("--xla_foo=1 --xla_dump_to=/a --xla_dump_to=/b"), dump_dir_from_flags("")
    ('/b', None)
    """
    found = None
    for token in (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split():
        if token.startswith("--xla_dump_to="):
            found = token.split("=", 1)[1]
    return found


# -- the parent side -------------------------------------------------------------------------

def child_env(dump_dir: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: CPU as JAX's only platform (the CUDA device is compile-only),
    XLA's buffer-assignment dumps written to `dump_dir`, and jaxmem's folder of compilers on
    its path (`xla.compilers.child_env`).

    >>> env = child_env("/tmp/d", {"XLA_FLAGS": "--xla_foo=1"})
    >>> env["JAX_PLATFORMS"], env["XLA_FLAGS"]
    ('cpu', '--xla_foo=1 --xla_dump_to=/tmp/d')
    """
    env = dict(os.environ if base is None else base)
    env["JAX_PLATFORMS"] = "cpu"
    flags = [t for t in env.get("XLA_FLAGS", "").split() if not t.startswith("--xla_dump_to=")]
    flags.append(f"--xla_dump_to={dump_dir}")
    env["XLA_FLAGS"] = " ".join(flags)
    from jaxmem.xla import compilers

    return compilers.child_env(env)


def xla_gpu_reference(target: str, *, device: str = "h100-80gb", donate_argnums: Sequence[int] = (),
                      kwargs: dict[str, int] | None = None, top: int = TOP_BUFFERS, use_cache: bool = True,
                      timeout: float = 1800.0, on_start: Callable[[Any], None] | None = None) -> XlaGpuReference:
    """XLA:GPU's memory analysis of a TARGET for a GPU preset, compiled deviceless in a fresh
    Python (cached by lowered program, target and JAX version).

    >>> ref = xla_gpu_reference("jaxmem.examples.suite:mlp_train", device="a100-40gb")  # doctest: +SKIP
    >>> ref.spec, ref.total_bytes > 0  # doctest: +SKIP
    ('a100_sxm_40', True)

    Args:
        target: `"package.module:factory"` or `"path/to/file.py:factory"`.
        device: a GPU preset (see `GPU_TARGETS`).
        donate_argnums: positional arguments to donate, as `jax.jit`'s.
        kwargs: integer keyword arguments for the factory (`{"batch_size": 64}`).
        top: how many buffers live at XLA's peak to return.
        use_cache: read and write the cache (see `cache_dir`).
        timeout: seconds before the child is killed.
        on_start: called with the child's `subprocess.Popen` once it runs (to kill it early).

    Raises:
        GpuUnavailable: the CUDA plugin is not installed here or failed to load.
        PlanError: the TARGET failed to load, trace or compile (one line from the child).
    """
    spec = spec_for(device)
    if spec is None:
        raise GpuUnavailable(f"{device} is not a GPU preset with an XLA target description "
                             f"({', '.join(sorted(GPU_TARGETS))})")
    reason = unavailable_reason()
    if reason:
        raise GpuUnavailable(reason)
    cmd = [sys.executable, "-m", "jaxmem.xla.gpu", target, "--spec", spec, "--device", device]
    return reference_from_json(run_compile_child(cmd, child_env, f"XLA:GPU compile of {target!r}", top=top,
                                                 donate_argnums=donate_argnums, kwargs=kwargs, use_cache=use_cache,
                                                 timeout=timeout, on_start=on_start))


def run_compile_child(cmd: list[str], env_for: Callable[[str], dict[str, str]], what: str, *, top: int,
                      donate_argnums: Sequence[int], kwargs: dict[str, int] | None, use_cache: bool,
                      timeout: float, on_start: Callable[[Any], None] | None) -> dict[str, Any]:
    """Run a deviceless compile child (`cmd`, the common flags added) with `env_for(dump_dir)`
    as its environment and a fresh dump folder, and return its JSON answer (its error raised
    again as its kind, `child_answer`)."""
    cmd = [*cmd, "--top", str(int(top))]
    if donate_argnums:
        cmd += ["--donate", ",".join(str(int(i)) for i in donate_argnums)]
    for name, value in (kwargs or {}).items():
        cmd += ["--kwarg", f"{name}={int(value)}"]
    if not use_cache:
        cmd.append("--no-cache")
    dump_dir = tempfile.mkdtemp(prefix="jaxmem-xla-")
    try:
        return run_child(cmd, env_for(dump_dir), what, timeout=timeout, on_start=on_start)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)


def run_child(cmd: list[str], env: dict[str, str], what: str, *, timeout: float,
              on_start: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Run a compile child and return its JSON answer (its error raised again as its kind,
    `child_answer`); killed after `timeout` seconds. `on_start` is handed the process (a
    caller that may be interrupted kills it)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if on_start is not None:
        on_start(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise PlanError(f"{what} took more than {timeout:.0f} s") from None
    return child_answer(proc.returncode, stdout, stderr, failed=f"{what} failed: ")


def reference_from_json(data: dict[str, Any]) -> XlaGpuReference:
    """An `XlaGpuReference` from the child's (or the cache's) JSON object."""
    names = XlaGpuReference.__dataclass_fields__
    return XlaGpuReference(**{k: v for k, v in data.items() if k in names})


# -- the child side --------------------------------------------------------------------------

def load_with_kwargs(target: str, kwargs: dict[str, int]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A TARGET's `(fn, args)`, its factory called with `kwargs`."""
    from jaxmem.compiler.target import call_user, check_fn_args, resolve_factory

    factory = resolve_factory(target)
    shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    result = call_user(lambda: factory(**kwargs), f"TARGET {target!r}: the factory{f'({shown})' if shown else ''} raised ")
    return check_fn_args(result, f"TARGET {target!r}")


def load_abstract(target: str, kwargs: dict[str, int]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A TARGET's `(fn, args)` with every argument a `jax.ShapeDtypeStruct`, the factory run
    under `jax.eval_shape` so that a batch of tens of GB is never allocated on the host. A
    factory that cannot run abstractly (it reads array values, or `fn` closes over the arrays it
    makes) is called for real instead."""
    from jaxmem.compiler.target import resolve_factory

    factory = resolve_factory(target)
    return abstract_fn_args(lambda: factory(**kwargs), f"TARGET {target!r}",
                            lambda: load_with_kwargs(target, kwargs))


def abstract_fn_args(make: Callable[[], Any], what: str,
                     concrete: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]
                     ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`make()`'s `(fn, args)` with every argument a `jax.ShapeDtypeStruct` (`make` run under
    `jax.eval_shape`), or `concrete()` where `make` cannot run abstractly."""
    import jax

    from jaxmem.compiler.target import check_fn_args

    box: dict[str, Any] = {}

    def arguments() -> Any:
        fn, args = check_fn_args(make(), what)
        box["fn"] = fn
        return args

    try:
        args = jax.eval_shape(arguments)
        fn = box["fn"]
        jax.eval_shape(fn, *args)   # fn must not hold a tracer of the abstract factory
    except (JaxmemError, KeyboardInterrupt):
        raise
    except BaseException:  # the factory needs concrete values: run it for real (which says
        return concrete()      # in one line what it raises, if it still does)
    return fn, tuple(args)


def abstract_args(args: Sequence[Any], sharding: Any = None) -> tuple[Any, ...]:
    """Every leaf `jax.jit` takes as an argument as a `ShapeDtypeStruct`, with `sharding` on it:
    arrays, `ShapeDtypeStruct`s, and Python and numpy scalars (a Flax `TrainState`'s `step` is
    a Python int; `jax.jit` passes it as a weakly typed int32[], and so does the struct). Other
    leaves are left for `jax.jit` to accept or refuse.

    >>> abstract_args((3, {"lr": 0.5}))
    (ShapeDtypeStruct(shape=(), dtype=int32, weak_type=True), {'lr': ShapeDtypeStruct(shape=(), dtype=float32, weak_type=True)})
    """
    import jax

    def to_struct(leaf: Any) -> Any:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=sharding,
                                        weak_type=bool(getattr(leaf, "weak_type", False)))
        try:
            aval = jax.typeof(leaf)
        except TypeError:   # not an array type: jax.jit's own error says what it is
            return leaf
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type)

    return tuple(jax.tree.map(to_struct, tuple(args)))


def _nbytes(leaf: Any) -> int:
    from jaxmem.compiler.jaxpr_adapter import aval_bytes

    return aval_bytes(leaf)  # typed PRNG keys and packed int4 too, which np.dtype cannot size


def _shape_key(leaf: Any) -> str:
    return f"{getattr(leaf, 'dtype', '')}{list(getattr(leaf, 'shape', ()))}"


_ALIAS_RE = re.compile(r"\{([0-9, ]*)\}: \((\d+), \{[0-9, ]*\}, (?:may|must)-alias\)")


def output_aliases(hlo_text: str) -> dict[int, int]:
    """Output position -> HLO parameter number, from the module's `input_output_alias` header.

    >>> output_aliases("HloModule m, input_output_alias={ {0}: (2, {}, may-alias), {1}: (0, {}, may-alias) }")
    {0: 2, 1: 0}
    """
    head = hlo_text.split("\n", 1)[0]
    start = head.find("input_output_alias={")
    if start < 0:
        return {}
    out = {}
    for m in _ALIAS_RE.finditer(head[start:]):
        index = m.group(1).strip()
        out[int(index.split(",")[0]) if index else 0] = int(m.group(2))
    return out


def compile_for_gpu(fn: Callable[..., Any], args: Sequence[Any], *, spec: str, device: str,
                    donate_argnums: Sequence[int] = (), top: int = TOP_BUFFERS, dump_dir: str | None = None,
                    use_cache: bool = True) -> dict[str, Any]:
    """Compile `fn(*args)` for the GPU `spec` in this process (JAX_PLATFORMS=cpu must have been
    set before JAX started) and return the figures as the child prints them."""
    text, mesh = gpu_target(spec, device)
    structs, lowered, stablehlo = lower_on_one_device(fn, args, mesh, donate_argnums)
    return compile_lowered_for_gpu(lowered, structs, donated_leaves(structs, donate_argnums), stablehlo,
                                   spec=spec, device=device, target_text=text, top=top, dump_dir=dump_dir,
                                   use_cache=use_cache)


def gpu_target(spec: str, device: str) -> tuple[str, Any]:
    """(XLA's target description with the preset's memory, a 1-device mesh of one compile-only
    GPU of it)."""
    from jax.experimental import topologies

    from jaxmem.units import PRESETS

    text = target_config(spec)
    if device in PRESETS:
        text = with_memory(text, PRESETS[device])
    try:
        topo, text = cuda_topology(text)
    except Exception as err:  # the plugin did not load or refused the description
        raise GpuUnavailable(f"the CUDA plugin could not make a compile-only {device}: "
                             f"{type(err).__name__}: {' '.join(str(err).split())[:200]}") from None
    return text, topologies.make_mesh(topo, (1,), ("x",))


def compile_lowered_for_gpu(lowered: Any, structs: Sequence[Any], donated: Sequence[bool], stablehlo: str, *,
                            spec: str, device: str, target_text: str, top: int = TOP_BUFFERS,
                            dump_dir: str | None = None, use_cache: bool = True) -> dict[str, Any]:
    """XLA:GPU's figures of a program lowered for one GPU (`lowered`: JAX's, or a program text's
    `xla.lowered.TextLowered`), its flat arguments `structs` donated per leaf as `donated`; cached
    by `stablehlo`, the target and the versions."""
    import jax
    import jaxlib

    from jaxmem.xla import compilers

    versions = f"jax {jax.__version__} jaxlib {getattr(jaxlib, '__version__', '')} {compilers.versions('gpu')}"
    flags = " ".join(t for t in os.environ.get("XLA_FLAGS", "").split() if not t.startswith("--xla_dump"))
    key = cache_key(stablehlo, target_text, versions, flags)
    directory = cache_dir()
    if use_cache:
        hit = cache_read(directory, key)
        if hit is not None:
            hit["cached"] = True
            return hit
    started = time.perf_counter()
    compiled, note = _compile_gpu(lowered)
    try:
        stats = compiled.memory_analysis()
    except Exception as err:
        raise PlanError(f"XLA:GPU gives no memory analysis: {type(err).__name__}: {' '.join(str(err).split())[:300]}") from None
    seconds = time.perf_counter() - started
    flat = jax.tree.leaves(structs)
    kept = _kept_arguments(lowered, len(flat))
    hlo = compiled.as_text() or ""
    aliases = {out: kept[param] for out, param in output_aliases(hlo).items() if param < len(kept)}
    outs = jax.tree.leaves(lowered.out_info)
    peak, live = peak_buffers_from_dump(dump_dir, top) if dump_dir else ([], 0)
    for row in peak:
        if row.get("parameter") is not None and row["parameter"] < len(kept):
            row["argument"] = kept[row["parameter"]]
    data = {
        "target": device, "spec": spec, "key": key, "cached": False,
        "argument_bytes": int(stats.argument_size_in_bytes), "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes), "alias_bytes": int(stats.alias_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes), "compile_seconds": seconds,
        "arguments": [{"bytes": _nbytes(leaf), "donated": bool(donated[i]) if i < len(donated) else False,
                       "shape": _shape_key(leaf)} for i, leaf in enumerate(flat)],
        "outputs": [{"bytes": _nbytes(leaf), "aliases": aliases.get(i), "shape": _shape_key(leaf)}
                    for i, leaf in enumerate(outs)],
        "peak_buffers": peak, "peak_live_bytes": live, "note": note,
    }
    if use_cache:
        cache_write(directory, key, data)
    return data


def compile_lowered(lowered: Any, options: dict[str, Any] | None = None) -> Any:
    """`lowered.compile(...)` for a compile-only CUDA device. JAX 0.8, once XLA has compiled,
    builds the outputs' shardings from the device's memory kinds, and a compile-only CUDA device
    lists none ("can address the following memory kinds: ."): there the shardings JAX lowered
    with are kept instead (`get_out_shardings_from_executable` answering None, as JAX's own
    fallback does), and nothing else changes."""
    kwargs = {"compiler_options": options} if options else {}
    try:
        return lowered.compile(**kwargs)
    except ValueError as err:
        if "can address the following memory kinds: ." not in str(err):
            raise
    from jaxmem.compiler.jaxpr_adapter import compile_keeping_lowered_shardings

    return compile_keeping_lowered_shardings(lowered, **kwargs)


def _compile_gpu(lowered: Any) -> tuple[Any, str]:
    """XLA:GPU's compile of `lowered`, and a note when it took a second try.

    Without autotuning, XLA takes its default Triton GEMM tiling, which some shapes on some
    targets cannot use ("Couldn't find output tile sizes"); on a GPU the autotuner would pick
    another. Compile again with Triton GEMM fusions off (cuBLAS), and say so."""
    try:
        return compile_lowered(lowered), ""
    except Exception as err:
        first = " ".join(str(err).split())[:200]
        try:
            compiled = compile_lowered(lowered, {"xla_gpu_enable_triton_gemm": False})
        except Exception as again:
            raise PlanError(f"XLA:GPU could not compile the function: {type(again).__name__}: "
                            f"{' '.join(str(again).split())[:300]}") from None
        return compiled, f"compiled with Triton GEMM fusions off: the default compile failed ({type(err).__name__}: {first})"


def donated_leaves(args: Sequence[Any], donate_argnums: Sequence[int]) -> list[bool]:
    """Per flat leaf of `args`, whether its top-level argument is donated."""
    import jax

    wanted = set(donate_argnums)
    donated: list[bool] = []
    for position, arg in enumerate(args):
        donated += [position in wanted] * len(jax.tree.leaves(arg))
    return donated


def lower_on_one_device(fn: Callable[..., Any], args: Sequence[Any], mesh: Any,
                        donate_argnums: Sequence[int]) -> tuple[tuple[Any, ...], Any, str]:
    """`fn` lowered for the one compile-only device of `mesh` (a GPU's or a TPU chip's): the
    arguments as `ShapeDtypeStruct`s placed there, the lowered program and its StableHLO text
    (the cache key's part); a failure to lower is one `PlanError` line."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    structs = abstract_args(args, NamedSharding(mesh, PartitionSpec()))
    try:
        lowered = jax.jit(fn, donate_argnums=tuple(donate_argnums)).trace(*structs).lower()
        stablehlo = lowered.as_text(debug_info=True)
    except Exception as err:  # JAX's own errors are many types; the user needs one line
        raise PlanError(f"JAX could not lower the function: {type(err).__name__}: {' '.join(str(err).split())[:300]}") from None
    return structs, lowered, stablehlo


def _kept_arguments(lowered: Any, count: int) -> list[int]:
    """HLO parameter number -> flat argument index: `jax.jit` drops unused arguments from the
    module. Read from JAX's lowering (private; identity when absent)."""
    own = getattr(lowered, "kept_var_idx", None)   # a program text's (`xla.lowered.TextLowered`)
    if own is not None:
        return list(own)
    try:
        kept = lowered._lowering.compile_args["kept_var_idx"]
        return sorted(int(i) for i in kept)
    except Exception:  # JAX-internal; the identity is right whenever every argument is used
        return list(range(count))


# -- XLA's dumps: what is live at its peak ------------------------------------------------------

_PEAK_HEAD_RE = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_PEAK_ROW_RE = re.compile(r"^\s*(\S+?)(\{[0-9,]*\})?: (\d+) bytes")
_INSTR_RE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? ([\w-]+)\((.*)$")
_OPNAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_RE = re.compile(r"stack_frame_id=(\d+)")
_PARAM_RE = re.compile(r"parameter\((\d+)\)")


def _dump_files(dump_dir: str, live_range: str = "gpu_after_optimizations-live-range.txt"
                ) -> tuple[str | None, str | None, str | None]:
    """(live-range report, optimized HLO text, buffer assignment) of the module in `dump_dir`
    whose live-range report ends in `live_range` (XLA:GPU's; XLA:TPU's names carry no platform),
    the largest module when there are several; None for a file that is missing."""
    try:
        names = os.listdir(dump_dir)
    except OSError:
        return None, None, None
    ranges = [n for n in names if n.endswith(live_range)]
    if not ranges:
        return None, None, None
    ranges.sort(key=lambda n: os.path.getsize(os.path.join(dump_dir, n)), reverse=True)
    found = []
    for suffix in ("-live-range.txt", ".txt", "-buffer-assignment.txt"):
        name = ranges[0].replace("-live-range.txt", suffix)
        found.append(os.path.join(dump_dir, name) if name in names else None)
    return found[0], found[1], found[2]


def parse_peak(live_range_text: str) -> list[tuple[str, int]]:
    """(HLO value, bytes) for every value live at XLA's peak, from a live-range report; a value
    is its instruction's name, with the tuple index when it has one (`fusion.3{1}`).

    >>> parse_peak("  Live ranges at 3 (peak):\\n    fusion.1{}: 64 bytes (cumulative: 64 bytes)\\n  Stack\\n")
    [('fusion.1', 64)]
    """
    rows: list[tuple[str, int]] = []
    inside = False
    for line in live_range_text.splitlines():
        if _PEAK_HEAD_RE.match(line):
            inside = True
            continue
        if inside:
            m = _PEAK_ROW_RE.match(line)
            if not m:
                break
            index = m.group(2) or "{}"
            rows.append((m.group(1) + ("" if index == "{}" else index), int(m.group(3))))
    return rows


_ALLOCATION_RE = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
# a loop's state is written `<7 arg_tuple.1{2} (phi) @0>`: the same buffer as the value the
# body writes there
_VALUE_RE = re.compile(r"^\s*value: <\d+ (\S+)( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): ([a-z0-9]+\[[0-9,]*\])?")


def parse_assignment(text: str, phis: set[str] | None = None) -> dict[str, tuple[int, int, str, str]]:
    """Per HLO value: (allocation, offset, kind, shape), kind being "argument" (a parameter's
    allocation), "output" (live out), "temporary", or "on-chip" (an allocation in another memory
    space than the device's main memory: `color 1` is a TPU's VMEM), shape like `f32[2,3]` (""
    for a tuple), from XLA's buffer-assignment dump. The names of phi values (a loop's state,
    sharing the buffer of what the body writes there) are added to `phis` when given.

    >>> parse_assignment("allocation 0: size 8, parameter 0, shape |f32[2]| at ShapeIndex {}:\\n"
    ...                  " value: <1 p.1 @0> (size=8,offset=0): f32[2]{0}")
    {'p.1': (0, 0, 'argument', 'f32[2]')}
    """
    out: dict[str, tuple[int, int, str, str]] = {}
    allocation, kind = -1, "temporary"
    for line in text.splitlines():
        head = _ALLOCATION_RE.match(line)
        if head:
            allocation = int(head.group(1))
            flags = head.group(3)
            kind = ("on-chip" if re.search(r"\bcolor [1-9]", flags) else "argument" if " parameter " in flags
                    else "output" if "live-out" in flags else "temporary")
            continue
        value = _VALUE_RE.match(line)
        if value and allocation >= 0:
            out.setdefault(value.group(1), (allocation, int(value.group(4)), kind, value.group(5) or ""))
            if value.group(2) and phis is not None:
                phis.add(value.group(1))
    return out


def parse_hlo_metadata(hlo_text: str) -> tuple[dict[str, dict[str, Any]], dict[int, str]]:
    """Per instruction name: shape text, opcode, op_name, source line, parameter number; and the
    source line (`file:line (function)`) of each stack frame id, from optimized HLO text."""
    files: dict[int, str] = {}
    functions: dict[int, str] = {}
    locations: dict[int, tuple[int, int, int]] = {}
    frames: dict[int, int] = {}
    section = ""
    instructions: dict[str, dict[str, Any]] = {}
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if not line.strip():
            section = ""
            continue
        if section:
            head, _, rest = line.partition(" ")
            if not head.isdigit():
                section = ""
            else:
                ident = int(head)
                if section == "FileNames":
                    files[ident] = rest.strip().strip('"')
                elif section == "FunctionNames":
                    functions[ident] = rest.strip().strip('"')
                elif section == "FileLocations":
                    f = re.search(r"file_name_id=(\d+)", rest)
                    fn = re.search(r"function_name_id=(\d+)", rest)
                    ln = re.search(r"\bline=(\d+)", rest)
                    locations[ident] = (int(f.group(1)) if f else 0, int(fn.group(1)) if fn else 0,
                                        int(ln.group(1)) if ln else 0)
                elif section == "StackFrames":
                    loc = re.search(r"file_location_id=(\d+)", rest)
                    frames[ident] = int(loc.group(1)) if loc else 0
                continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        info: dict[str, Any] = {"shape": shape, "opcode": opcode}
        op = _OPNAME_RE.search(rest)
        if op:
            info["op_name"] = op.group(1).replace("\\'", "'").replace('\\"', '"')
        frame = _FRAME_RE.search(rest)
        if frame:
            info["frame"] = int(frame.group(1))
        if opcode == "parameter":
            p = _PARAM_RE.search(line)
            if p:
                info["parameter"] = int(p.group(1))
        instructions.setdefault(name, info)
    sources: dict[int, str] = {}
    for frame_id, loc_id in frames.items():
        if loc_id in locations:
            f, fn, ln = locations[loc_id]
            sources[frame_id] = f"{files.get(f, '?')}:{ln} ({functions.get(fn, '?')})"
    return instructions, sources


_SHAPE_RE = re.compile(r"^([a-z]+[0-9]*)\[([0-9,]*)\]$")


def _split_shape(text: str) -> tuple[str, list[int]]:
    m = _SHAPE_RE.match(text)
    if not m:
        return "", []
    return m.group(1), [int(d) for d in m.group(2).split(",") if d]


def peak_buffers_from_dump(dump_dir: str, top: int, live_range: str = "gpu_after_optimizations-live-range.txt"
                           ) -> tuple[list[dict[str, Any]], int]:
    """The `top` largest buffers live at XLA's peak (and the bytes live there in all), each with
    its HLO name, dtype and shape, kind (argument, output or temporary), op_name and source line.
    Values that share storage (an output written in place of a donated argument) count once;
    values in on-chip memory (a TPU's VMEM) are not device memory and are left out."""
    live_path, hlo_path, assignment_path = _dump_files(dump_dir, live_range)
    if live_path is None:
        return [], 0
    with open(live_path, encoding="utf-8", errors="replace") as f:
        rows = parse_peak(f.read())
    instructions: dict[str, dict[str, Any]] = {}
    sources: dict[int, str] = {}
    if hlo_path:
        with open(hlo_path, encoding="utf-8", errors="replace") as f:
            instructions, sources = parse_hlo_metadata(f.read())
    slices: dict[str, tuple[int, int, str, str]] = {}
    phis: set[str] = set()
    if assignment_path:
        with open(assignment_path, encoding="utf-8", errors="replace") as f:
            slices = parse_assignment(f.read(), phis)

    def instruction(value: str) -> dict[str, Any]:
        return instructions.get(value.split("{", 1)[0], {})

    # The buffer assignment writes a tuple's own value as `name{}`, the live-range report `name`.
    slices = {**{k[:-2]: v for k, v in slices.items() if k.endswith("{}")}, **slices}

    # Largest first; of values sharing a slice, the argument (the donated buffer) is shown, and
    # never a loop state's phi where the value the body writes there has a name and a shape.
    rows.sort(key=lambda r: (-r[1], r[0] in phis, instruction(r[0]).get("opcode") != "parameter"))
    seen: set[tuple[int, int]] = set()
    unique = []
    for value, size in rows:
        where = slices.get(value)
        if where is not None:
            if where[:2] in seen or where[2] == "on-chip":
                continue
            seen.add(where[:2])
        unique.append((value, size))
    out = []
    for value, size in unique[:top]:
        info = instruction(value)
        shape_text = slices[value][3] if value in slices and slices[value][3] else info.get("shape", "")
        dtype, shape = _split_shape(shape_text) if "[" in shape_text else ("", [])
        kind = slices[value][2] if value in slices else ("argument" if info.get("opcode") == "parameter" else "temporary")
        out.append({
            "name": value, "size_bytes": size, "dtype": dtype, "shape": shape, "kind": kind,
            "parameter": info.get("parameter"), "op_name": info.get("op_name", ""),
            "source": sources.get(info.get("frame", -1), ""),
        })
    return out, sum(size for _, size in unique)


# -- the subprocess entry ----------------------------------------------------------------------

def _parse_kwargs(items: Sequence[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name.isidentifier():
                raise ValueError
            out[name] = int(value)
        except ValueError:
            raise PlanError(f"--kwarg takes NAME=INTEGER, got {item!r}") from None
    return out


# The compile children (`python -m jaxmem.xla.gpu`, `python -m jaxmem.xla.sharding`) answer with
# one JSON object on stdout, or with one error line on stderr and an exit code naming its kind
# (2: any other error a user can cause).
CHILD_ERRORS: tuple[tuple[int, type[JaxmemError]], ...] = ((3, GpuUnavailable), (4, ShardingError))


def child_reply(compile: Callable[[], dict[str, Any]]) -> int:
    """The child's side: run `compile` and print its figures as one JSON line (exit 0), or its
    error as one line on stderr with the exit code of its kind (2 for any exception not
    jaxmem's, a `SystemExit` or other `BaseException` of the user's code included; Ctrl-C
    goes through)."""
    from jaxmem.compiler.target import _one_line

    try:
        data = compile()
    except JaxmemError as err:
        print(f"error: {err}", file=sys.stderr)
        return next((code for code, kind in CHILD_ERRORS if isinstance(err, kind)), 2)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # user code the compile ran (SystemExit too: its code is not ours)
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    print(json.dumps(data))
    return 0


def child_answer(returncode: int, stdout: str, stderr: str, failed: str = "") -> dict[str, Any]:
    """The parent's side: the child's JSON object, or its error raised again as its kind (a
    `PlanError` for any other, its message after `failed`)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode == 0 and lines:
        return json.loads(lines[-1])
    from jaxmem.xla.start import filter_noise

    tail = [line for line in filter_noise(stderr).splitlines() if line.strip()]
    last = tail[-1].strip() if tail else f"exit {returncode}"
    last = last[len("error: "):] if last.startswith("error: ") else last
    kind = dict(CHILD_ERRORS).get(returncode)
    raise kind(last) if kind is not None else PlanError(failed + last)


def main(argv: list[str] | None = None) -> int:
    """The subprocess side: print TARGET's XLA:GPU figures as one JSON object. Exit 3 when the
    CUDA plugin is unavailable, 2 for any other error a user can cause."""
    from jaxmem.xla.cpu.compile import _parse_donate
    from jaxmem.xla.start import quiet_jax_start

    parser = argparse.ArgumentParser(prog="python -m jaxmem.xla.gpu")
    parser.add_argument("target")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--device", default="")
    parser.add_argument("--donate", default="")
    parser.add_argument("--kwarg", action="append", default=[])
    parser.add_argument("--top", type=int, default=TOP_BUFFERS)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    dump_dir = dump_dir_from_flags()

    def compile() -> dict[str, Any]:
        quiet_jax_start()
        kwargs = _parse_kwargs(args.kwarg)
        fn, fn_args = load_abstract(args.target, kwargs) if kwargs else load_with_kwargs(args.target, kwargs)
        return compile_for_gpu(fn, fn_args, spec=args.spec, device=args.device or args.spec,
                               donate_argnums=_parse_donate(args.donate), top=args.top, dump_dir=dump_dir,
                               use_cache=not args.no_cache)

    return child_reply(compile)


if __name__ == "__main__":
    sys.exit(main())
