"""Reordering alone (issue 12): on every suite training step where jaxmem's own plan for the
target is at least 10% below XLA's total, XLA's total before and after `fitting.reorder`
(jaxmem's planned order chained with optimization_barrier, no recompute), the share of the
gap covered, and what XLA's dumps say about the rest: XLA's own live peak (arguments, outputs
from their definition, and temporaries live at once, from its buffer assignment and live
ranges) and its temp allocation against the temporaries live at its peak (heap packing).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_reorder.py                  # every training step, H100
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_reorder.py --programs cnn_train,mlp_deep_train --device a100-40gb
"""
import argparse
import os
import re
import shutil
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="jaxmem-reorder-dump-")
# A fresh cache: every compile runs, so each leaves its dump for `Dumps` to read.
os.environ["JAXMEM_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmem-reorder-cache-")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={DUMP}"]).strip()

import jax  # noqa: E402  (XLA reads XLA_FLAGS when it starts)
import numpy as np  # noqa: E402

from jaxmem.compiler import jaxpr_adapter as ja  # noqa: E402
from jaxmem.compiler.planner import plan_jaxpr  # noqa: E402
from jaxmem.examples.suite import ALL_PROGRAMS  # noqa: E402
from jaxmem.fitting.judge import Judge  # noqa: E402
from jaxmem.fitting.reorder import reorder  # noqa: E402
from jaxmem.xla.gpu.compile import _dump_files  # noqa: E402
from jaxmem.xla.gpu.model.predict import plan_on_gpu  # noqa: E402

MIB = 2 ** 20
_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"^\s*(\S+):(\d+)-(\d+)$")
_OTHER_SPACE = re.compile(r"^allocation \d+: size \d+, color [1-9]")


def xla_live(dump_dir: str) -> dict:
    """XLA's own live peak from its dumps: parameters throughout, output and temp slices while a
    value in them is live (live-range report), each slice counted once; and the temp
    allocation's size against the temp bytes live at once (the rest is heap packing)."""
    live_path, _, assignment_path = _dump_files(dump_dir)
    slices, params, temp, kind, alloc = {}, 0, 0, "", -1
    for line in open(assignment_path):
        if line.startswith("allocation"):
            alloc = int(line.split()[1].rstrip(":"))
            size = int(line.split("size ")[1].split(",")[0])
            kind = ("temp" if "preallocated-temp" in line else "param" if " parameter " in line
                    else "out" if "live-out" in line else "")
            if _OTHER_SPACE.match(line):
                kind = ""   # another memory space (color 5: pinned host memory), not the device's
            temp = size if kind == "temp" else temp
            params += size if kind == "param" else 0
            continue
        m = _VALUE.match(line)
        if m and kind in ("temp", "out"):
            slices[m.group(1)] = (alloc, int(m.group(3)), int(m.group(2)), kind)
    ranges, on = {}, False
    for line in open(live_path):
        on = on or "BufferLiveRange" in line
        if "Live ranges at" in line:
            break
        m = _RANGE.match(line)
        if on and m:
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    times: dict[tuple, set] = {}
    for name, key in slices.items():
        r = ranges.get(name) or ranges.get(name + "{}")
        if r is not None:
            times.setdefault(key, set()).update(range(r[0], r[1] + 1))
    horizon = max((max(t) for t in times.values() if t), default=0) + 1
    both, temps = [0] * horizon, [0] * horizon
    for (_, _, size, k), ts in times.items():
        for t in ts:
            both[t] += size
            temps[t] += size if k == "temp" else 0
    return {"live": params + max(both), "temp": temp, "temp_live": max(temps)}


class Dumps:
    """Reads each compile's dump as `reorder` reports its next step: at each label, the dump
    on disk is the previous compile's."""

    def __init__(self, first: str):
        self.label, self.stats = first, {}

    def __call__(self, label: str) -> None:
        if all(_dump_files(DUMP)):
            self.stats[self.label] = xla_live(DUMP)
        shutil.rmtree(DUMP, ignore_errors=True)
        os.makedirs(DUMP)
        self.label = label


def same_values(fn, new, args) -> str:
    """"equal" (bit for bit), "close" (within 1e-5 relative), or "DIFFERENT"; run here (XLA:CPU)."""
    pairs = [(np.asarray(x), np.asarray(y)) for x, y in
             zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(jax.jit(new)(*args)), strict=True)]
    if all(np.array_equal(x, y) for x, y in pairs):
        return "equal"
    return "close" if all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in pairs) else "DIFFERENT"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default="", help="comma-separated names (default: every training step)")
    ap.add_argument("--device", default="h100-80gb")
    ap.add_argument("--threshold", type=float, default=0.9, help="plan at or below this share of XLA's total")
    opts = ap.parse_args()
    names = opts.programs.split(",") if opts.programs else [n for n, p in ALL_PROGRAMS.items() if p.kind == "training"]
    judge = Judge(opts.device)
    print(f"| program | plan | XLA before | XLA after | saved | share of gap | order kept (tried) | "
          f"XLA live peak before / after | temp after: allocation / live at once | values equal | s |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|")
    for name in names:
        start = time.time()
        p = ALL_PROGRAMS[name]
        fn, args = p.factory()
        donate = ja.donate_positions(len(args), p.donate_argnums)
        traced = ja.trace(fn, args, donate_argnums=donate)
        donated = [k in traced.donated for k in range(len(traced.in_avals))]
        plan = plan_on_gpu(plan_jaxpr(traced.closed_jaxpr, donated=donated, check=False)).peak_bytes
        dumps = Dumps("original")
        dumps("original")
        total = judge.total(fn, args, donate)
        if plan > opts.threshold * total:
            print(f"| {name} | {plan / MIB:.1f} | {total / MIB:.1f} | not run: plan {plan / total:.3f} of XLA's total "
                  f"| | | | | | | {time.time() - start:.0f} |", flush=True)
            continue
        r = reorder(fn, *args, donate_argnums=p.donate_argnums, device=opts.device, progress=dumps)
        dumps("end")
        b, a = dumps.stats["original"], dumps.stats[r.order]
        tried = ", ".join(f"{k} {v / MIB:.1f}" for k, v in r.candidates.items())
        print(f"| {name} | {r.planned_peak_bytes / MIB:.1f} | {r.xla_total_bytes_before / MIB:.1f} | "
              f"{r.xla_total_bytes_after / MIB:.1f} | {r.saved_bytes / MIB:.1f} | {100 * r.share_of_gap:.0f}% | "
              f"{r.order} ({tried}) | {b['live'] / MIB:.1f} / {a['live'] / MIB:.1f} | "
              f"{a['temp'] / MIB:.1f} / {a['temp_live'] / MIB:.1f} | {same_values(fn, r.fn, args)} | "
              f"{time.time() - start:.0f} |", flush=True)
    shutil.rmtree(DUMP, ignore_errors=True)
    shutil.rmtree(os.environ["JAXMEM_CACHE_DIR"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
