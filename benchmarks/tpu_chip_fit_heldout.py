"""`jaxmem.fit`'s answer for held-out steps past what fits, run on a TPU v5e. Per step (a factory
of `benchmarks/tpu_models/eval/`, never tuned on, at a batch past its `maxbatch` answer): the
step as written is run once on the chip (its refusal is the measurement), `jaxmem.fit` is asked
in this process (judged by XLA:TPU, each candidate compiled deviceless in a child; its source
rewrites left out, so that the policy is one to write in the step's own source), and its
answer is run for 3 steps on the chip, with `memory_stats()`. One JSON line per step. An answer
that accumulates gradients is run as the user gets it: fit's printed lines pasted into the step's
file (tests/fit/pasted.py) and the factory called again.

    . benchmarks/tpu_chip_setup.sh
    python3 benchmarks/tpu_chip_fit_heldout.py --one benchmarks/tpu_models/eval/near_limit_gpt2.py:make --batch 17
    python3 benchmarks/tpu_chip_fit_heldout.py --one benchmarks/tpu_models/eval/near_limit_gpt2.py:make --batch 32
    # here, without a chip (the search only, on abstract arguments):
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tpu_chip_fit_heldout.py --one ...:make --batch 17 --abstract
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time


def load(target: str):
    path, name = target.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("heldout_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name), module


def pasted_step(target: str, code: str, batch: int):
    """The step from its file with fit's printed lines pasted in."""
    import os
    import sys
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fit"))
    from pasted import load as load_file, paste

    path, name = target.rsplit(":", 1)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(paste(code, open(path).read()))
    return getattr(load_file(f.name, "pasted_step"), name)(batch)[0]


def concrete(tree):
    """Arrays for a tree of ShapeDtypeStructs: ones (normal draws would not change the memory)."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, tree)


def run_steps(fn, args, donate, steps: int) -> dict:
    import jax

    jitted = jax.jit(fn, donate_argnums=donate)
    state, rest = args[0], args[1:]
    try:
        for _ in range(steps):
            out = jitted(state, *rest)
            state = out[0] if isinstance(out, tuple) else out
        jax.block_until_ready(state)
        return {"ran": True}
    except Exception as err:  # the chip's refusal is the measurement
        return {"ran": False, "error": " ".join(str(err).split())[:300]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--abstract", action="store_true")
    parser.add_argument("--time-limit", type=float, default=240.0)
    args = parser.parse_args()
    if args.abstract:   # XLA:TPU in this process (JAX_PLATFORMS=cpu), as `jaxmem fit --device` starts it
        from jaxmem.xla import compilers

        compilers.activate()
    import jax

    import jaxmem

    make, module = load(args.one)
    fn, structs = make(args.batch)
    donate = tuple(getattr(module, "DONATE", (0,)))
    row: dict = {"step": args.one, "batch": args.batch, "jax": jax.__version__,
                 "device_kind": jax.devices()[0].device_kind}
    fit_args = structs
    if not args.abstract:
        row["as_written"] = run_steps(fn, concrete(structs), donate, 1)
        fit_args = concrete(structs)
    started = time.perf_counter()
    result = jaxmem.fit(fn, *fit_args, budget="tpu-v5e-16gb", donate_argnums=donate, device="tpu-v5e-16gb",
                        rewrite="auto", source_rewrites=False, time_limit=args.time_limit,
                        progress=lambda text: print("fit:", text, flush=True))
    answer_fn = result.policy_fn if result.policy_fits and result.policy_fn is not None else result.fn
    best = result.policies.best if result.policies is not None else None
    micro = best.micro_batches if best is not None and result.policy_fits else 0
    if micro:
        answer_fn = pasted_step(args.one, best.code, args.batch)
    row["fit"] = {"seconds": round(time.perf_counter() - started, 1), "fits": bool(result.fits or result.policy_fits),
                  "budget_bytes": result.budget_bytes, "xla_total_bytes_before": result.xla_total_bytes_before,
                  "policy_fits": result.policy_fits, "policy": result.policy_code,
                  "policy_xla_total_bytes": result.policy_xla_total_bytes, "rewrite_xla_total_bytes": result.xla_total_bytes,
                  "extra_flops_ratio": result.recompute_flops_ratio, "infeasible": result.infeasible,
                  "micro_batches": micro or None,
                  "policy_extra_flops_ratio": best.extra_flops_ratio if best is not None else None}
    if not args.abstract:
        m = jax.jit(answer_fn, donate_argnums=donate).lower(*concrete(structs)).compile().memory_analysis()
        row["answer_chip_xla_total"] = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                        - m.alias_size_in_bytes)
        answer = run_steps(answer_fn, concrete(structs), donate, 3)
        stats = jax.devices()[0].memory_stats() or {}
        answer.update({k: stats.get(k) for k in ("peak_bytes_in_use", "peak_bytes_reserved", "bytes_limit")})
        row["answer"] = answer
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
