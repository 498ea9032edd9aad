"""`jaxmem.fit` on one device at the half-temp budget, on steps it was never tuned on.

For each step (a module's `make()` returning `(fn, args)`): XLA:GPU H100's total as written, the
budget (arguments + outputs - aliases + half the temporaries), what fit answers (a policy, gradient
accumulation, a source rewrite, the rewriting search) and its total and extra FLOPs, or the line
that proves the budget out of reach. An answer that accumulates gradients is checked as the user
gets it: fit's printed lines pasted into the module's file (tests/fit/pasted.py), compiled by
JAX's own AOT path for a compile-only H100 (not jaxmem's judge), and its values (run here on the
CPU) compared with the step as written.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_fit_half_temp.py --out benchmarks/results/fit_half_temp_heldout.jsonl \\
        benchmarks/outside_models/gpt2_vocab.py:make benchmarks/heldout_models/linen_unet_resize.py:make \\
        benchmarks/heldout_models/haiku_resnet18.py:make benchmarks/heldout_models/linen_scan_remat_lm.py:make
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "fit"))


def checked_by_jax(path: str, factory: str, fn, args, best_code: str, device: str) -> dict:
    """The answer as the user gets it (the printed lines pasted into the module's file, its
    factory called again): JAX's own AOT total for a compile-only GPU, and its values on the CPU
    against the step as written."""
    import tempfile

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from bench_fit_mesh import aot_total, concrete
    from jaxmem.fitting.judge import compute_dtype, values_equal
    from pasted import load, paste

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(paste(best_code, open(path).read()))
    pasted, _ = getattr(load(f.name, "pasted_step"), factory)()
    mesh = concrete((1,), ("one",), device)
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())),
                           tuple(args))
    out = {"jax_aot_written": aot_total(fn, structs, ()), "jax_aot_answer": aot_total(pasted, structs, ())}
    out["values_equal"] = values_equal(jax.jit(fn)(*args), jax.jit(pasted)(*args), compute_dtype(fn, args))
    return out


def run(spec: str, device: str, time_limit: float) -> dict:
    import jaxmem
    from pasted import load

    path, _, factory = spec.partition(":")
    factory = factory or "make"
    fn, args = getattr(load(path, os.path.basename(path)[:-3]), factory)()
    began = time.perf_counter()
    result = jaxmem.fit(fn, *args, budget="half-temp", device=device, rewrite="auto", time_limit=time_limit)
    best = result.policies.best if result.policies is not None else None
    policy_met = result.policy_fits
    row = {"program": spec, "device": device, "seconds": round(time.perf_counter() - began, 1),
           "before_bytes": result.xla_total_bytes_before, "budget_bytes": result.budget_bytes,
           "met": bool(policy_met or result.fits), "infeasible": result.infeasible,
           "answer": (best.policy + best.where) if best is not None and policy_met else
                     ("rewrite" if result.fits else None),
           "answer_bytes": result.policy_xla_total_bytes if policy_met else result.xla_total_bytes,
           "extra_flops_ratio": round(best.extra_flops_ratio if policy_met else result.recompute_flops_ratio, 4),
           "min_reachable_bytes": result.min_reachable_bytes,
           "accumulation": [{"micro_batches": c.micro_batches, "total": c.xla_total_bytes, "error": c.error[:200] or None}
                            for c in (result.policies.candidates if result.policies else []) if c.policy == "accumulate_gradients"]}
    if policy_met and best is not None and best.micro_batches:
        row.update(checked_by_jax(path, factory, fn, args, best.code, device))
        truth = row["jax_aot_answer"]
        row["answer_fits_by_jax_aot"] = "total" in truth and truth["total"] <= result.budget_bytes
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("programs", nargs="+", help="module.py:factory")
    parser.add_argument("--device", default="h100-80gb")
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from jaxmem.xla import compilers

    compilers.activate()   # JAX's own AOT compile for the compile-only GPU, in this process
    for spec in args.programs:
        row = run(spec, args.device, args.time_limit)
        print(json.dumps({k: v for k, v in row.items() if k != "accumulation"}), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
