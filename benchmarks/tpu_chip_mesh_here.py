"""`jaxmem.fit` and `jaxmem.maxbatch` of a step sharded over 8 v5e chips, asked from the process
that holds a TPU v5e (a notebook on a TPU VM, a training script): the step is traced here over
an `AbstractMesh`, each per-chip program compiled deviceless in a child. The answers are those
the same calls give in a process started with JAX_PLATFORMS=cpu (`benchmarks/results/fit_mesh.jsonl`,
tuning row). One JSON line.

    . benchmarks/tpu_chip_setup.sh
    python3 benchmarks/tpu_chip_mesh_here.py
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "api"))


def main() -> int:
    import jax

    import jaxmem
    import mesh_steps

    row: dict = {"jax": jax.__version__, "device_kind": jax.devices()[0].device_kind}
    began = time.perf_counter()
    fn, args = mesh_steps.make(160)
    result = jaxmem.fit(fn, *args, budget="tpu-v5e-16gb", device="tpu-v5e-16gb")
    row["fit"] = {"seconds": round(time.perf_counter() - began, 1), "fits": result.fits,
                  "before_bytes": result.before.total_bytes, "answer": result.best.label if result.best else None,
                  "answer_bytes": result.best.total_bytes if result.best else None,
                  "collective_bytes": result.best.collective_bytes if result.best else None}
    began = time.perf_counter()
    found = jaxmem.maxbatch(mesh_steps.make, arg="batch_size", device="tpu-v5e-16gb", quiet=True)
    row["maxbatch"] = {"seconds": round(time.perf_counter() - began, 1), "value": found.value,
                       "multiple": found.multiple, "total_bytes": found.total_bytes}
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
