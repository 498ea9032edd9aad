"""mlp_train_donated offloaded by hand (`jaxmem.examples.offload`) against its half-temp budget
and fit's lower bounds, on XLA:GPU (deviceless): what host offload can reach on the one suite
step whose budget is neither met nor proven infeasible for offload policies. Also checks that
the hand-written step computes the suite step's values (on this CPU, pinned host memory
included), and where XLA:GPU's temp allocation goes above the three GEMM buffers its peak holds.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_offload_by_hand.py --out benchmarks/results/offload_by_hand.jsonl
"""

from __future__ import annotations

import os

import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: deviceless XLA:GPU compiles
DUMP = tempfile.mkdtemp(prefix="jaxmem-offload-by-hand-")   # XLA reads its flags once, at start
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}".strip()

import argparse
import json
import shutil

import jax

from jaxmem.examples import offload
from jaxmem.examples.suite import ALL_PROGRAMS
from jaxmem.fitting.bound import flop_lower_bound, lower_bound
from jaxmem.fitting.judge import Judge, values_equal
from jaxmem.xla.gpu.compile import compile_for_gpu

MiB = 2 ** 20


def temp_spans(dump_dir: str) -> list[tuple[int, int]]:
    """(offset, size) of every value in the device temp allocation of the last module dumped."""
    import glob
    import re

    path = sorted(glob.glob(os.path.join(dump_dir, "*jit_offloaded_train_step*after_optimizations-buffer-assignment.txt")))[-1]
    text = open(path).read()
    # the device's temp block is the preallocated temp without a color (color 5 is host memory)
    block = re.search(r"^allocation \d+: size \d+, preallocated-temp:\n(.*?)(?=^allocation|\Z)", text, re.M | re.S)
    return [(int(o), int(s)) for s, o in re.findall(r"\(size=(\d+),offset=(\d+)\)", block.group(1))] if block else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="h100-80gb")
    ap.add_argument("--out", help="append one JSON row to this file")
    args = ap.parse_args()
    judge = Judge(args.device)
    program = ALL_PROGRAMS["mlp_train_donated"]
    fn, fargs = program.factory()
    donate = program.donate_argnums
    original = judge.figures(fn, fargs, donate)
    by_hand, hand_args = offload.make_train_step()
    on_device, device_args = offload.make_train_step(offload=False)
    equal = values_equal(jax.jit(fn)(*fargs), jax.jit(by_hand)(*hand_args))
    hand = judge.figures(by_hand, hand_args, donate)
    kept = judge.figures(on_device, device_args, donate)
    with_offload = lower_bound(fn, fargs, donate, original.floor, host_offload=True)
    capped = flop_lower_bound(fn, fargs, donate, original.floor)
    # compiled again, uncached, so that its buffer assignment is the last one dumped
    compile_for_gpu(by_hand, hand_args, spec=judge.spec, device=judge.device, donate_argnums=donate, use_cache=False)
    spans = temp_spans(DUMP)
    shutil.rmtree(DUMP, ignore_errors=True)
    large = max((o + s for o, s in spans if s >= MiB), default=0)
    above = sorted({o for o, s in spans if o >= large})
    budget = original.half_temp
    rows = [("as written", original.total), ("by hand, activations kept on the device", kept.total),
            ("by hand, activations offloaded", hand.total), ("half-temp budget", budget),
            ("lower bound, host offload included", with_offload.bytes),
            ("lower bound within +15% FLOPs, without host offload", capped.bytes if capped else None),
            ("floor (arguments + outputs - aliases)", original.floor)]
    print(f"mlp_train_donated on XLA:GPU {args.device}, bytes (MiB); values equal to the step as written: {equal}")
    for label, value in rows:
        print(f"  {label:52s} {value:>12,d} ({value / MiB:.2f})" if value is not None else f"  {label:52s} -")
    print(f"  offloaded by hand - budget: {hand.total - budget:+,d} B; its temp block {hand.temp:,d} B, "
          f"{hand.temp - large:,d} B above its largest buffers' top ({large:,d} B), in {len(above)} slots of small values")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"program": "mlp_train_donated", "judge": judge.name, "values_equal": equal,
                                "original": original.total, "by_hand_on_device": kept.total,
                                "by_hand_offloaded": hand.total, "budget": budget, "floor": original.floor,
                                "offload_bound": with_offload.bytes, "capped_bound": capped.bytes if capped else None,
                                "temp": hand.temp, "above_large": hand.temp - large, "small_slots_above": len(above)})
                    + "\n")


if __name__ == "__main__":
    main()
