"""XLA's per-device figures of a sharded program lowered in this process: the StableHLO text
(with its `sdy.sharding`s and `mhlo.num_partitions`) is handed to a deviceless compile child,
which partitions it over N compile-only GPUs, TPU chips or host devices.

A function held in memory (a notebook's, `jaxmem.analyze`'s) cannot be imported by a child by
name, and the user's own JAX has no compile-only devices. So jaxmem traces it here over an
`AbstractMesh` of the arguments' axes (`sharding.trace_sharded`), lowers its tagged copy for the
target platform (no device is needed to lower), and the child compiles the text as `jax.jit`
compiles a partitioned program (N partitions, sharding propagation to the outputs). What
follows is the TARGET path's (`sharding.finish_sharded`): per-device bytes, the buffers at
XLA's peak, jaxmem's per-device plan read off XLA's partitioning dumps, what is replicated.

    traced = trace_sharded(step, (state, batch), abstract_mesh)
    ref = sharded_lowered_reference(traced, xla="tpu", device="tpu-v5e-16gb")

Run as a module it is the child:

    JAX_PLATFORMS=cpu python -m jaxmem.xla.sharding.lowered PROGRAM.json --xla tpu --device tpu-v5e-16gb
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from jaxmem.errors import ShardingError
from jaxmem.xla import sharding

PLATFORMS = {"gpu": "cuda", "tpu": "tpu", "cpu": "cpu"}


@dataclass
class ShardedText:
    """What the compile child needs of a lowered sharded program: its text, the mesh's axis
    sizes and names, how many inputs the module kept (`jax.jit` drops unused ones) and how
    many outputs it has."""

    text: str
    sizes: list[int]
    names: list[str]
    inputs: int
    outputs: int


def spec_json(spec: Sequence[Any]) -> list[Any]:
    """A `PartitionSpec`'s entries as JSON: None, an axis name, or a list of names.

    >>> spec_json((None, "data", ("data", "model")))
    [None, 'data', ['data', 'model']]
    """
    return [list(e) if isinstance(e, (tuple, list)) else e for e in spec]


def spec_from_json(entries: Sequence[Any]) -> tuple[Any, ...]:
    """`spec_json`'s inverse.

    >>> spec_from_json([None, "data", ["data", "model"]])
    (None, 'data', ('data', 'model'))
    """
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


# -- the parent side ---------------------------------------------------------------------------

def sharded_lowered_reference(traced: sharding.Traced, *, xla: str, device: str, top: int = 10,
                              topology: str | None = None, use_cache: bool = True, timeout: float = 1800.0,
                              on_start: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """The sharded reference of `traced` (see `sharding.compile_sharded`) from a deviceless
    compile of its lowered text in a child: XLA's per-device figures for `device` ("gpu": N
    compile-only GPUs of a GPU preset; "tpu": the chips of `topology`, else the smallest slice
    of the preset's chip that holds the mesh; "cpu": N host devices), jaxmem's per-device plan
    and what is replicated. Cached as the TARGET path's results are (`sharding.sharded_cache_key`).

    Raises:
        GpuUnavailable: the device's compiler is not installed here (one line with the command).
        ShardingError, PlanError: one line from the lowering or the child.
    """
    import jax

    from jaxmem.xla.gpu.compile import _kept_arguments, cache_dir, cache_write, run_child

    sharding.check_available(xla)
    flat = jax.tree.leaves(traced.structs)
    try:
        lowered = sharding.lower_traced(traced, PLATFORMS[xla])
    except Exception as err:
        raise sharding._compile_error(err, xla, device, traced.sizes) from None
    text = lowered.as_text(debug_info=True)
    # "collectives": entries cached before the collectives' bytes were kept are not reused.
    key = sharding.sharded_cache_key(text, f"{device} {xla} {topology or ''} {traced.layout} collectives",
                                     traced.sizes, top)
    if use_cache:
        hit = sharding.sharded_cache_read(key)
        if hit is not None:
            return hit
        _raise_cached_refusal(key)
    kept = _kept_arguments(lowered, len(flat))
    outs = jax.tree.leaves(lowered.out_info)
    program = ShardedText(text, list(traced.sizes.values()), list(traced.sizes), len(kept), len(outs))
    devices = max(sharding.MAX_GPU_DEVICES, math.prod(traced.sizes.values()))
    if xla == "cpu" and devices > sharding.MAX_CPU_DEVICES:
        raise ShardingError(f"the mesh has {devices} devices; XLA:CPU here makes at most {sharding.MAX_CPU_DEVICES}")
    work = tempfile.mkdtemp(prefix="jaxmem-sharded-")
    dump_dir = os.path.join(work, "dump")
    try:
        path = os.path.join(work, "program.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(program), f)
        cmd = [sys.executable, "-m", "jaxmem.xla.sharding.lowered", path, "--xla", xla, "--device", device]
        if topology:
            cmd += ["--topology", topology]
        try:
            answer = run_child(cmd, sharding.child_env(xla, devices, dump_dir), "the per-device compile",
                               timeout=timeout, on_start=on_start)
        except ShardingError as err:
            if use_cache and "does not fit" in str(err):
                cache_write(cache_dir(), f"{key}-refused", {"key": key, "refused": str(err)})
            raise
        peak, live = sharding.peak_from_dump(dump_dir, xla, top)
        dumps = sharding.partitioning_dumps(dump_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    aliases = {int(o): kept[p] for o, p in answer["aliases"].items() if p < len(kept)}
    data = sharding.finish_sharded(traced, xla=xla, per=answer["xla"], outs=outs,
                                   out_specs=[spec_from_json(s) for s in answer["out_specs"]], aliases=aliases,
                                   peak=peak, live=live, dumps=dumps, key=key)
    data["collectives"] = answer.get("collectives")
    if use_cache:
        cache_write(cache_dir(), key, data)
    return data


def _raise_cached_refusal(key: str) -> None:
    """Raise the refusal XLA gave `key`'s program before (a program over the device is refused
    the same way each time; maxbatch and fit ask again), marked `cached`; else return."""
    from jaxmem.xla.gpu.compile import cache_dir

    try:
        with open(os.path.join(cache_dir(), f"{key}-refused.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("refused"), str):
        err = ShardingError(data["refused"][:2000])
        err.cached = True   # type: ignore[attr-defined]
        raise err


def trace_on_mesh(fn: Callable[..., Any], args: Sequence[Any], *, donate_argnums: Sequence[int] = (),
                  mesh: str | None = None, layout: str | None = None) -> Any:
    """`xla.sharding.trace_sharded` over an `AbstractMesh` of the arguments' axes (their own
    mesh, or `mesh`'s under `layout`), in a thread of its own (`compiler.jaxpr_adapter.in_own_thread`)."""
    from jax.sharding import AbstractMesh, AxisType

    from jaxmem.compiler.jaxpr_adapter import in_own_thread, traceback_frames_kept
    from jaxmem.xla.sharding import trace_sharded

    def abstract(sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
        return AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))

    def work() -> Any:
        with traceback_frames_kept():
            return trace_sharded(fn, args, abstract, donate_argnums=donate_argnums, mesh_text=mesh, layout=layout)

    return in_own_thread(work)


def reference_of_traced(traced: Any, *, xla: str, device: str, top: int = 10, topology: str | None = None,
                        use_cache: bool = True) -> dict[str, Any]:
    """`sharded_lowered_reference` of a `trace_on_mesh` result, lowered in a
    thread of its own (the caller's frames stay out of the program's text and its cache key)."""
    from jaxmem.compiler.jaxpr_adapter import in_own_thread

    return in_own_thread(lambda: sharded_lowered_reference(traced, xla=xla, device=device, top=top,
                                                            topology=topology, use_cache=use_cache))


# -- the child side ----------------------------------------------------------------------------

def compile_child(program: ShardedText, *, xla: str, device: str, topology: str | None,
                  dump_dir: str | None) -> dict[str, Any]:
    """The child's answer: XLA's per-device figures (`sharding._per_device_figures`), each
    output's `PartitionSpec` as XLA propagated it, and XLA's output -> parameter aliases."""
    from jaxmem.compiler.jaxpr_adapter import compile_partitioned_text, output_partition_specs
    from jaxmem.xla.sharding.collectives import collective_bytes
    from jaxmem.xla.gpu.compile import output_aliases

    sizes, names = tuple(program.sizes), tuple(program.names)
    mesh, target_text = sharding._compile_mesh(sizes, names, xla, device, topology)
    # libtpu reads no XLA_FLAGS: XLA:TPU's dumps are asked for in the compile's options.
    options = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True,
               "xla_dump_hlo_pass_re": sharding.PARTITIONING_PASSES} if xla == "tpu" and dump_dir else None
    started = time.perf_counter()
    try:
        executable = compile_partitioned_text(list(mesh.devices.flat), program.text, options, program.inputs,
                                              program.outputs)
    except Exception as err:
        raise sharding._compile_error(err, xla, device, dict(zip(names, sizes))) from None
    per = sharding._per_device_figures(executable.get_compiled_memory_stats(), xla, device, target_text,
                                       time.perf_counter() - started)
    modules = executable.hlo_modules()
    hlo = modules[0].to_string() if modules else ""
    out_specs = [spec_json(spec) for spec in output_partition_specs(executable, mesh)]
    return {"xla": per, "out_specs": out_specs, "aliases": {str(o): p for o, p in output_aliases(hlo).items()},
            "collectives": collective_bytes(hlo).as_json()}


def main(argv: list[str] | None = None) -> int:
    """The subprocess side: print a sharded program text's per-device figures as one JSON
    object. Exit 3 when the device's compiler is unavailable here, 4 for a sharding error, 2
    for any other."""
    from jaxmem.xla.gpu.compile import child_reply, dump_dir_from_flags
    from jaxmem.xla.start import quiet_jax_start

    parser = argparse.ArgumentParser(prog="python -m jaxmem.xla.sharding.lowered")
    parser.add_argument("program")
    parser.add_argument("--xla", choices=tuple(PLATFORMS), required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--topology", default=None)
    args = parser.parse_args(argv)

    def compile() -> dict[str, Any]:
        quiet_jax_start()
        with open(args.program, encoding="utf-8") as f:
            program = ShardedText(**json.load(f))
        return compile_child(program, xla=args.xla, device=args.device, topology=args.topology,
                             dump_dir=dump_dir_from_flags())

    return child_reply(compile)


if __name__ == "__main__":
    sys.exit(main())
