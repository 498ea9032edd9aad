"""What NNX adds to a step written like google/flax#5116's (`tests/frameworks/flax_5116_like.py`:
`nnx.jit` + `nnx.value_and_grad` + `optimizer.update`) over the same step written pure by hand,
as `jaxmem.analyze` reports it, on a v5e (XLA:TPU, deviceless) and on XLA:CPU here: the pool's
peak as written, with each change jaxmem compiled, and the hand-written pure step's peak (the
peer, measured in the same run).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_framework_costs.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "frameworks"))


def main() -> int:
    import jax
    from flax import nnx

    import flax_5116_like as case
    import jaxmem

    model, optimizer, x, y = case.build()
    state_bytes = sum(a.nbytes for a in jax.tree.leaves((nnx.state(model, nnx.Param), nnx.state(optimizer))))
    print(f"parameters and optimizer state: {state_bytes:,} B")
    for device in ("tpu-v5e-16gb", "8GiB"):
        result = jaxmem.analyze(nnx.jit(case.nnx_train_step), model, optimizer, x, y, device=device, quiet=True)
        found = result.framework
        step, state = case.pure_step(model, optimizer)
        by_hand = jaxmem.analyze(step, state, x, y, device=device, quiet=True)
        print(f"\n{device}: nnx.jit as written: pool peak {found['pool_peak_bytes']:,} B, XLA total {result.xla['total_bytes']:,} B")
        for item in found["adds"]:
            lines = "; ".join(f"{line['source'].rsplit('/', 1)[-1]} {line['bytes']:,} B" for line in item.get("lines", []))
            print(f"  adds: {item['what']}: {item['bytes']:,} B in {item['arrays']} arrays {lines}")
        for change in found["changes"]:
            print(f"  {change['code']}: XLA total {change['xla']['total_bytes']:,} B, pool peak "
                  f"{change['pool_peak_bytes']:,} B, saves {change['saved_bytes']:,} B "
                  f"({'lowers the peak' if change['lowers_peak'] else 'no change'}); results: {change['results_note']}")
        ratio = found["pure_pool_peak_bytes"] / by_hand.pool["peak_bytes"]
        print(f"  written pure by hand: pool peak {by_hand.pool['peak_bytes']:,} B, XLA total "
              f"{by_hand.xla['total_bytes']:,} B; jaxmem's written-pure peak / the hand-written one: {ratio:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
