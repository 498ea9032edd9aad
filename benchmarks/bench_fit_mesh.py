"""`jaxmem.fit` on a mesh, held to JAX's own AOT compile. Per program: the smallest batch (doubling
from one per device) whose per-chip program XLA:TPU refuses on 8 v5e chips, then `jaxmem.fit`'s
answer at that batch; the truth is `jax.jit(...).lower(...).compile()` in this process (JAX's own
path, on a `v5e:2x4` topology's compile-only chips) of the step as written and of the answer (the
step re-traced with the answer's `jax.checkpoint`, or laid out by the answer's layout).

Sets: "tuning" (tests/api/mesh_steps.py, what the search was built on) and "evaluation"
(benchmarks/mesh_fit_programs.py, never tuned on).

With `--half-temp`, each program at half that batch (the largest doubling that fits) and the
budget of half its temporaries: what fit answers where the step fits but must shrink (checkpoint
policies, gradient accumulation, layouts). An answer that accumulates gradients is compiled as the
user gets it: fit's printed lines pasted into the program's file (tests/fit/pasted.py).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_fit_mesh.py --out benchmarks/results/fit_mesh.jsonl
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_fit_mesh.py --half-temp --only mesh_steps,decoder,moe,loop,tensor_parallel,gpu64_decoder --out benchmarks/results/fit_mesh_half_temp.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "api"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "fit"))


def programs() -> list[tuple[str, str, object]]:
    import mesh_fit_programs as mp
    import mesh_steps

    rows = [("tuning", "mesh_steps", (mesh_steps.step, lambda mesh, b: mesh_steps.structs(b, mesh), (8,), ("data",), (0,)))]
    rows += [("evaluation", name, spec) for name, spec in mp.PROGRAMS.items()]
    rows += [("evaluation", name, spec) for name, spec in mp.BIG.items()]
    return rows


def abstract(sizes, names):
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))


def concrete(sizes, names, device="tpu-v5e-16gb"):
    """A mesh of JAX's own compile-only devices: v5e chips (v5e:2x4 for 8, v5e:16x16 for 256) or
    H100s (8 nodes of 8, XLA:GPU's target description with the preset's memory)."""
    import math

    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    n = math.prod(sizes)
    if device.startswith("tpu"):
        name = {8: "v5e:2x4", 256: "v5e:16x16"}[n]
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=(2, 2, 1))
        return Mesh(np.array(topology.devices[:n]).reshape(sizes), names)
    from jaxmem.units import PRESETS
    from jaxmem.xla.gpu.compile import spec_for, target_config, with_memory

    text = with_memory(target_config(spec_for(device)), PRESETS[device])   # the GPU's description, not a compile
    topology = topologies.get_topology_desc(platform="cuda", target_config=text, topology=f"{max(1, n // 8)}x1x8")
    return Mesh(np.array(topology.devices[:n]).reshape(sizes), names)


def aot_total(fn, args, donate) -> dict:
    """JAX's own AOT compile: XLA:TPU's per-chip total and code, or its refusal."""
    import jax

    try:
        m = jax.jit(fn, donate_argnums=donate).lower(*args).compile().memory_analysis()
    except Exception as err:  # XLA:TPU's refusal
        return {"refused": "RESOURCE_EXHAUSTED" in str(err), "error": " ".join(str(err).split())[:160]}
    return {"total": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes,
            "code": m.generated_code_size_in_bytes}


def first_refused(step, structs, sizes, names, donate, limit, device) -> int:
    from jaxmem.fitting.mesh import MeshJudge

    judge = MeshJudge(device)
    batch = sizes[0]
    while batch <= 4096:
        compiled = judge.compiled(step, structs(abstract(sizes, names), batch), donate)
        if compiled.refused or compiled.figures.total > limit:
            return batch
        batch *= 2
    raise SystemExit(f"nothing up to batch 4096 is refused for {step.__name__}")


def as_pasted(step, code: str):
    """The step from its file with fit's printed lines pasted in (JAX's own trace of the text)."""
    import inspect
    import tempfile

    from pasted import load, paste

    source = inspect.getsourcefile(step)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(paste(code, open(source).read()))
    return getattr(load(f.name, f"pasted_{step.__name__}"), step.__name__)


def one(step, structs, sizes, names, donate, device: str, half_temp: bool = False) -> dict:
    import jaxmem
    from jaxmem.accelerators import find
    from jaxmem.xla.sharding import layout_specs, with_specs

    limit = find(device).capacity_bytes
    batch = first_refused(step, structs, sizes, names, donate, limit, device)
    if half_temp:
        batch = max(sizes[0], batch // 2)
    budget = "half-temp" if half_temp else device
    began = time.perf_counter()
    result = jaxmem.fit(step, *structs(abstract(sizes, names), batch), budget=budget, device=device,
                        donate_argnums=donate, time_limit=900)
    limit = result.budget_bytes if half_temp else limit
    row = {"batch": batch, "budget_bytes": result.budget_bytes, "fits": result.fits, "seconds": round(time.perf_counter() - began, 1),
           "compiles": result.compiles, "cached": result.cached, "before_bytes": result.before.total_bytes,
           "candidates": len(result.candidates), "left_out": result.left_out}
    best = result.best
    if best is None:
        row["closest"] = result.closest.label
        row["closest_bytes"] = result.closest.total_bytes
        return row
    row.update(answer=best.label, answer_bytes=best.total_bytes, extra_flops_ratio=round(best.extra_flops_ratio, 4),
               collective_bytes=best.collective_bytes, collective_bytes_before=result.before.collective_bytes,
               code=best.code)
    mesh = concrete(sizes, names, device)
    args = structs(mesh, batch)
    accumulated = getattr(best.policy, "micro_batches", 0)
    row["micro_batches"] = accumulated or None
    fn = step if best.policy is None else as_pasted(step, best.code) if accumulated else best.policy.apply(step)
    if best.layout is not None:
        laid = tuple(best.mesh.values())
        mesh = concrete(laid, tuple(best.mesh), device)
        shaped = structs(concrete(sizes, names, device), batch)   # the shapes; the layout's specs replace it
        args = with_specs(shaped, layout_specs(shaped, best.layout, best.mesh), mesh)
    row["jax_aot_written"] = aot_total(step, structs(concrete(sizes, names, device), batch), donate)
    row["jax_aot_answer"] = aot_total(fn, args, donate)
    truth = row["jax_aot_answer"]
    row["answer_equals_jax_aot"] = truth.get("total") == best.total_bytes
    row["answer_fits_by_jax_aot"] = "total" in truth and truth["total"] + truth["code"] <= limit
    return row


def maxbatch_row(step, structs, sizes, names, donate, device: str) -> dict:
    """`jaxmem.maxbatch` over the mesh, held to JAX's own AOT compile of its answer and the next
    multiple: the answer within each chip with its code, the next one not."""
    import jax

    import jaxmem
    from jaxmem.accelerators import find

    def make(batch):
        return jax.jit(step, donate_argnums=donate), structs(abstract(sizes, names), batch)

    began = time.perf_counter()
    try:
        result = jaxmem.maxbatch(make, arg="batch", device=device, quiet=True)
    except jaxmem.JaxmemError as err:   # the smallest batch the mesh lays out does not fit
        return {"maxbatch": None, "maxbatch_error": str(err)[:300], "maxbatch_seconds": round(time.perf_counter() - began, 1)}
    row = {"maxbatch": result.value, "multiple": result.multiple, "maxbatch_seconds": round(time.perf_counter() - began, 1),
           "maxbatch_bytes": result.total_bytes, "maxbatch_compiles": result.compiles}
    limit = result.limit_bytes   # the chip's, or the GPU pool's
    mesh = concrete(sizes, names, device)
    here = aot_total(step, structs(mesh, result.value), donate)
    above = aot_total(step, structs(mesh, result.value + result.multiple), donate)
    row["maxbatch_equals_jax_aot"] = here.get("total") == result.total_bytes
    row["maxbatch_fits_by_jax_aot"] = "total" in here and here["total"] + here["code"] <= limit
    row["next_refused_by_jax_aot"] = bool(above.get("refused")) or ("total" in above and above["total"] + above["code"] > limit)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="programs' names, comma-separated")
    parser.add_argument("--half-temp", action="store_true", help="at half the first refused batch, budget half-temp")
    args = parser.parse_args()
    from jaxmem.xla import compilers
    from jaxmem.xla.tpu.compile import DEVICELESS_ENV

    for key, value in DEVICELESS_ENV.items():
        os.environ.setdefault(key, value)
    compilers.activate()   # JAX's own AOT compile for the v5e topology, in this process
    rows = []
    for group, name, (step, structs, sizes, names, donate) in programs():
        if args.only and name not in args.only.split(","):
            continue
        import mesh_fit_programs as mp

        device = mp.DEVICE.get(name, "tpu-v5e-16gb")
        row = {"set": group, "program": name, "device": device, "mesh": dict(zip(names, sizes))}
        row.update(one(step, structs, sizes, names, donate, device, half_temp=args.half_temp))
        if not args.half_temp:
            row.update(maxbatch_row(step, structs, sizes, names, donate, device))
        rows.append(row)
        shown = {k: row.get(k) for k in ("set", "program", "batch", "budget_bytes", "fits", "answer", "answer_bytes",
                                         "extra_flops_ratio", "answer_equals_jax_aot", "answer_fits_by_jax_aot",
                                         "seconds", "compiles", "cached", "maxbatch", "maxbatch_equals_jax_aot",
                                         "maxbatch_fits_by_jax_aot", "next_refused_by_jax_aot", "maxbatch_seconds")}
        print(json.dumps(shown), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
