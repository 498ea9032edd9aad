"""A GPT-style training step on 8 H100s (deviceless) under each standard layout.

    .venv/bin/python benchmarks/bench_sharding.py                       # 8 and 4x2 meshes
    .venv/bin/python benchmarks/bench_sharding.py --target jaxmem.examples.gpt:default_example

For `jaxmem.examples.sharded:gpt_step` (about 2.65B parameters, float32, Adam; the last argument
is the batch): per layout and mesh, XLA:GPU's per-device total, jaxmem's per-device plan (and
its ratio to XLA's), the replicated bytes per device, the pool verdict on an h100-80gb, the
compile seconds (XLA, one compile) and the plan seconds (jaxmem), each layout in a fresh
subprocess as `jaxmem analyze --compare-shardings` runs them (never from the cache). "unsharded"
counts the per-device program's values jaxmem left whole (no sharding of XLA's found for them).
"""

from __future__ import annotations

import argparse
import time

from jaxmem.api.sharded import pool_verdict
from jaxmem.xla.sharding import LAYOUT_NAMES, sharded_reference
from jaxmem.runtime.steps import make_device
from jaxmem.units import PRESETS


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="jaxmem.examples.sharded:gpt_step")
    parser.add_argument("--device", default="h100-80gb")
    args = parser.parse_args()
    print("| mesh | layout | XLA:GPU total GiB | jaxmem plan GiB | plan/XLA | replicated GiB | pool (3 steps) "
          "| compile s | plan s | wall s | plan method | collectives | unsharded |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|")
    for mesh, layouts in (("8", ("dp", "fsdp")), ("4x2", ("fsdp_tp",))):
        for layout in layouts:
            started = time.perf_counter()
            ref = sharded_reference(args.target, device=args.device, mesh=mesh, layout=layout, use_cache=False)
            wall = time.perf_counter() - started
            pool = pool_verdict(ref, make_device(PRESETS[args.device], {}), 3)
            xla = ref["xla"]
            print(f"| {mesh} | {LAYOUT_NAMES[layout]} | {gib(xla['total_bytes'])} | {gib(ref['peak_bytes'])} "
                  f"| {ref['peak_bytes'] / xla['total_bytes']:.3f} | {gib(ref['replicated_bytes'])} "
                  f"| {'fits' if pool.fits else 'does not fit'} | {xla['compile_seconds']:.1f} "
                  f"| {ref['plan']['plan_seconds']:.1f} | {wall:.0f} | {ref['plan']['method']} "
                  f"| {ref['plan'].get('collectives', '')} | {ref['plan'].get('unsharded_values', '')} |", flush=True)


if __name__ == "__main__":
    main()
