"""Speed of planned execution against `jax.jit` and JAX op by op, on every suite program.

    .venv/bin/python benchmarks/bench_execute.py                 # every program, markdown table
    .venv/bin/python benchmarks/bench_execute.py mlp_train --repeat 5

All three run in the same process on the same inputs, interleaved round by round; each figure
is the median of `--repeat` timed calls after one warm-up call (which traces, plans, compiles).
`jax.jit` is timed to `block_until_ready`. JAX op by op is `fn(*args)` under `jax.disable_jit()`.
The machine is shared, so read the ratios rather than the absolute times.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

import jaxmem
from jaxmem.examples.suite import PROGRAMS


def _seconds(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def measure(name: str, repeat: int) -> dict[str, Any]:
    """Seconds per call of jaxmem.jit, jax.jit and JAX op by op for one suite program.

    The three are interleaved (one call of each per round, `repeat` rounds, medians kept) so that
    a change in the machine's load hits all three alike.
    """
    program = PROGRAMS[name]
    fn, args = program.factory()
    planned = jaxmem.jit(fn, donate_argnums=program.donate_argnums)
    jitted = jax.jit(fn)

    def op_by_op() -> Any:
        with jax.disable_jit():
            return jax.block_until_ready(fn(*args))

    calls = {
        "jaxmem_s": lambda: planned(*args),
        "jax_jit_s": lambda: jax.block_until_ready(jitted(*args)),
        "op_by_op_s": op_by_op,
    }
    for call in calls.values():
        call()  # warm-up: trace, plan, compile
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeat):
        for key, call in calls.items():
            times[key].append(_seconds(call))
    row: dict[str, Any] = {"program": name}
    row.update({k: statistics.median(v) for k, v in times.items()})
    executable = planned.lower(*args)
    row["steps"] = len(executable.plan.schedule)
    row["jax_kernels"] = sum(k.name == "jax" for k in executable.program.kernels)
    row["vs_jit"] = row["jax_jit_s"] / row["jaxmem_s"]
    row["vs_op_by_op"] = row["op_by_op_s"] / row["jaxmem_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("programs", nargs="*", help="suite program names (default: all)")
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args(argv)
    names = opts.programs or list(PROGRAMS)
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        print(f"unknown program(s): {', '.join(unknown)}; one of {', '.join(PROGRAMS)}", file=sys.stderr)
        return 2
    rows = []
    print("| program | steps | JAX-run steps | jaxmem.jit ms | jax.jit ms | op by op ms | speed vs jax.jit | speed vs op by op |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        r = measure(name, opts.repeat)
        rows.append(r)
        print(f"| {name} | {r['steps']} | {r['jax_kernels']} | {1e3 * r['jaxmem_s']:.1f} | {1e3 * r['jax_jit_s']:.1f} | "
              f"{1e3 * r['op_by_op_s']:.1f} | {r['vs_jit']:.2f}x | {r['vs_op_by_op']:.2f}x |", flush=True)
    geo = math.exp(sum(math.log(r["vs_jit"]) for r in rows) / len(rows))
    slowest = min(r["vs_op_by_op"] for r in rows)
    print(f"\ngeometric mean speed vs jax.jit: {geo:.2f}x (target >= 0.5x); "
          f"lowest speed vs op by op: {slowest:.2f}x (target >= 1x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
