"""XLA:CPU against XLA:GPU (H100 and A100, deviceless) on every suite program.

    .venv/bin/python benchmarks/bench_gpu_preflight.py                   # the full table
    .venv/bin/python benchmarks/bench_gpu_preflight.py --programs mlp_train,cnn_train

For each program of `jaxmem.examples.suite.PROGRAMS` (with its donation): XLA:CPU's total on
this machine (a fresh process, XLA's default scheduler, as `jaxmem analyze --xla cpu`), XLA:GPU's
total for h100-80gb and a100-40gb (`jaxmem.xla.gpu.compile`, the cache bypassed so the compile
time is real), each compile's seconds, and jaxmem's own plan peak. "CPU/GPU" is XLA:CPU's total
over XLA:GPU H100's: how far the figure jaxmem judged fits by before this change was from the
compiler the GPU runs; "plan/GPU" the same for jaxmem's planned peak. † marks a target where
XLA's default deviceless compile failed (its untuned Triton GEMM tiling) and jaxmem compiled
with Triton GEMM fusions off instead. Compile times are wall
seconds of one compile on a shared 2-core machine (the subprocess start is not counted).
"""

from __future__ import annotations

import argparse
import time

from jaxmem.compiler.planner import plan
from jaxmem.examples.suite import PROGRAMS
from jaxmem.xla.cpu.compile import xla_reference_in_subprocess
from jaxmem.xla.gpu.compile import xla_gpu_reference


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def row(name: str) -> dict:
    program = PROGRAMS[name]
    fn, args = program.factory()
    peak = plan(fn, *args, donate_argnums=program.donate_argnums, xla=False).peak_bytes
    started = time.perf_counter()
    cpu = xla_reference_in_subprocess(program.target, donate_argnums=program.donate_argnums)
    cpu_seconds = time.perf_counter() - started   # includes the child's start and tracing
    h100 = xla_gpu_reference(program.target, device="h100-80gb", donate_argnums=program.donate_argnums,
                             top=0, use_cache=False)
    a100 = xla_gpu_reference(program.target, device="a100-40gb", donate_argnums=program.donate_argnums,
                             top=0, use_cache=False)
    return {"name": name, "peak": peak, "cpu": cpu.total_bytes, "cpu_seconds": cpu_seconds,
            "h100": h100.total_bytes, "h100_temp": h100.temp_bytes, "h100_seconds": h100.compile_seconds,
            "a100": a100.total_bytes, "a100_seconds": a100.compile_seconds, "cpu_temp": cpu.temp_bytes,
            "h100_note": h100.note, "a100_note": a100.note}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    names = [n for n in parser.parse_args().programs.split(",") if n]
    print("| program | XLA:CPU total MiB (temp) | XLA:GPU H100 MiB (temp) | XLA:GPU A100 MiB | CPU/GPU | plan/GPU "
          "| XLA:CPU s | H100 compile s | A100 compile s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for name in names:
        r = row(name)
        ratios.append(r["cpu"] / r["h100"])
        mark = {k: " †" if r[f"{k}_note"] else "" for k in ("h100", "a100")}
        print(f"| {name} | {mib(r['cpu'])} ({mib(r['cpu_temp'])}) | {mib(r['h100'])} ({mib(r['h100_temp'])}){mark['h100']} "
              f"| {mib(r['a100'])}{mark['a100']} | {r['cpu'] / r['h100']:.3f} | {r['peak'] / r['h100']:.3f} | {r['cpu_seconds']:.1f} "
              f"| {r['h100_seconds']:.1f} | {r['a100_seconds']:.1f} |", flush=True)
    print("\n† the default deviceless compile failed (XLA's untuned Triton GEMM tiling); compiled with Triton GEMM "
          "fusions off, as jaxmem does")
    if ratios:
        import math

        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        print(f"\nXLA:CPU/XLA:GPU H100 total: geometric mean {gm:.3f}, range {min(ratios):.3f}-{max(ratios):.3f} "
              f"over {len(ratios)} programs")


if __name__ == "__main__":
    main()
