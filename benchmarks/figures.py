"""Every byte figure jaxmem itself computes for the benchmark programs, as one JSON line per
program: a refactor's guard (run before and after, diff the files; any difference is a changed figure).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/figures.py --out /tmp/figures_before.jsonl
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/figures.py --out /tmp/figures_after.jsonl
    diff /tmp/figures_before.jsonl /tmp/figures_after.jsonl

Per program (the suite, the zoo, the 23 tuning models of `outside_models/` and the 24 held-out
steps of `heldout_models/`): jaxmem's plan (peak, arena, lower bound, valid) for XLA:CPU's model;
the plan with XLA:GPU's fusion rules and the model's prediction of XLA:GPU's figures on H100 and
A100; and the lower bound on XLA:GPU's total (`fitting.bound`, with and without offload). No
XLA compile runs: these are jaxmem's own numbers only, so the run takes minutes, not hours.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("KERAS_BACKEND", "jax")

DEVICES = ("h100-80gb", "a100-40gb")


def targets() -> list[tuple[str, str, tuple[int, ...] | None]]:
    """(name, module:factory, donated or None for the target's own) for every program."""
    from jaxmem.examples.suite import ALL_PROGRAMS
    from bench_outside_models import MODELS

    out = [(f"suite:{p.name}", p.target, tuple(p.donate_argnums)) for p in ALL_PROGRAMS.values()]
    for m in MODELS:
        target, _, donate = m.partition("@")
        out.append((f"outside:{m}", target, tuple(int(d) for d in donate.split(",")) if donate else None))
    for path in sorted(glob.glob(os.path.join(HERE, "heldout_models", "*.py"))):
        name = os.path.basename(path)[:-3]
        if not name.startswith("_"):
            out.append((f"heldout:{name}", f"{name}:make", None))
    return out


def figures(name: str, target: str, donate: tuple[int, ...] | None) -> dict:
    from jaxmem.compiler.planner import plan
    from jaxmem.compiler.target import jit_donation, load_target
    from jaxmem.fitting.bound import lower_bound
    from jaxmem.xla.gpu.model.predict import plan_on_gpu, predict_plan

    fn, args = load_target(target)
    if donate is None:
        donate = jit_donation(fn, args)
    row: dict = {"program": name, "donate": list(donate)}
    p = plan(fn, *args, donate_argnums=donate, xla=False)
    row["plan"] = {"peak": p.peak_bytes, "arena": p.arena_bytes, "lower": p.lower_bound_bytes, "valid": p.valid}
    gp = plan_on_gpu(p)
    row["gpu_plan"] = {"peak": gp.peak_bytes, "arena": gp.arena_bytes, "valid": gp.valid}
    for device in DEVICES:
        pred = predict_plan(gp, device)
        row[device] = {k: v for k, v in dataclasses.asdict(pred).items() if k not in ("seconds", "arguments", "outputs")}
    for offload in (False, True):
        try:
            b = lower_bound(fn, args, donate, host_offload=offload)
            row[f"bound{'_offload' if offload else ''}"] = [b.bytes, b.floor_bytes, b.op, b.held_bytes]
        except Exception as err:  # noqa: BLE001 - the figure file records what failed
            row[f"bound{'_offload' if offload else ''}"] = f"error: {type(err).__name__}: {err}"[:200]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated name prefixes")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(HERE, "outside_models"))
    sys.path.insert(0, os.path.join(HERE, "heldout_models"))
    wanted = [t for t in targets() if not args.only or any(t[0].startswith(o) for o in args.only.split(","))]
    with open(args.out, "w") as out:
        for name, target, donate in wanted:
            started = time.perf_counter()
            try:
                row = figures(name, target, donate)
            except Exception as err:  # noqa: BLE001
                row = {"program": name, "error": f"{type(err).__name__}: {err}"[:300]}
            out.write(json.dumps(row, sort_keys=True) + "\n")
            out.flush()
            print(f"{name:45s} {time.perf_counter() - started:6.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
