"""XLA:CPU's total for the three remat benchmark models' original steps under each of its
schedulers (each in a fresh process: XLA reads its flags once), the figure `jaxmem fit` now
checks before it recomputes anything.

    .venv/bin/python benchmarks/bench_remat_schedulers.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxmem.units import format_size
from jaxmem.xla.cpu.compile import scheduler_env

CHILD = """
import json, sys, jax
sys.path.insert(0, {here!r})
from bench_remat import mlp_model, plain_mlp_model, transformer_model
from jaxmem.xla.cpu.compile import xla_reference
out = {{}}
for name, (make, args) in {{
        "residual MLP 12L": mlp_model(12, batch=2048, width=256),
        "gelu MLP 16L": plain_mlp_model(16, batch=4096, width=512),
        "transformer 12L": transformer_model(12, batch=8, seq=128, d=256, heads=4, vocab=1024)}}.items():
    out[name] = xla_reference(make(lambda f: f), args).total_bytes
print(json.dumps(out))
"""


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    totals = {}
    for scheduler in ("dfs", "bfs", None):
        proc = subprocess.run([sys.executable, "-c", CHILD.format(here=here)], env=scheduler_env(scheduler),
                              capture_output=True, text=True, check=True)
        totals[scheduler or "default"] = json.loads(proc.stdout.strip().splitlines()[-1])
    print("| model | XLA:CPU default | dfs (MEMORY_OPTIMIZED) | bfs (CONCURRENCY_OPTIMIZED) |")
    print("|---|---:|---:|---:|")
    for name in totals["dfs"]:
        print(f"| {name} | " + " | ".join(format_size(totals[s][name]) for s in ("default", "dfs", "bfs")) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
