"""`jaxmem analyze TARGET --with TARGET2`: several programs in one process, the pool verdict for
the whole loop (a train step, then an eval step, `--steps` times).

What the process holds then (measured on a TPU v5e, `benchmarks/results/tpu_v5e_eval.jsonl`,
`linen_train_eval_loop`): every program's arguments, with the state a later program takes from
the first one counted once (`runtime.steps.shared_state`); each program's outputs while they
live; on a TPU each program's code, resident from its first call, and one reservation for
temporaries, the largest any program needed (`runtime.tpu_pool.simulate_tpu_loop`); on a GPU
each call's temporaries as a buffer in the pool (`runtime.steps.simulate_loop`).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--with", dest="with_targets", action="append", default=[], metavar="TARGET",
                        help="another program the same process runs in turn with TARGET (an eval step): the "
                             "pool verdict is for the loop; repeatable")


def loop_pool(run: Any, device: Any = None) -> Any:
    """The pool verdict of TARGET and every `--with` program run in turn (`run`: the analysis
    whose XLA:TPU or XLA:GPU figures are in; `device`: the GPU client's pool to run them in);
    sets `run.loop`, the programs' figures for the report. None when the device's XLA figures
    are not there to judge by."""
    from jaxmem.compiler.target import argument_signatures
    from jaxmem.runtime.steps import program_from_reference, shared_state, simulate_loop
    from jaxmem.runtime.tpu_pool import simulate_tpu_loop
    from jaxmem.xla.gpu.compile import load_abstract

    first = run.tpu if run.tpu is not None else run.gpu
    if first is None or first.oom:
        return None
    refs, shared = [first], [{}]
    programs = [program_from_reference(first)]
    mine = argument_signatures(run.fn_args)
    for target in run.args.with_targets:
        ref = run.guarded(lambda: _reference(run, target), "compile")
        _, args = run.guarded(lambda: load_abstract(target, {}), "load")
        refs.append(ref)
        programs.append(program_from_reference(ref))
        shared.append(shared_state(mine, programs[0], argument_signatures(args)))
    run.loop = [{"target": t, "total_bytes": r.total_bytes, "temp_bytes": r.temp_bytes,
                 "reserved_bytes": r.reserved_bytes, "generated_code_bytes": r.generated_code_bytes,
                 "shared_arguments": len(s), "oom": r.oom or None}
                for t, r, s in zip([run.target] + list(run.args.with_targets), refs, shared)]
    refused = [r for r in refs if r.oom]
    if refused:
        from jaxmem.runtime.tpu_pool import compile_refused

        return compile_refused(refused[0], run.accelerator, run.args.steps)
    if run.tpu is not None:
        return simulate_tpu_loop(programs, run.accelerator.capacity_bytes, run.args.steps, shared=shared,
                                 code_bytes=[r.generated_code_bytes for r in refs],
                                 reserved_bytes=[r.reserved_bytes for r in refs], factory=first.factory)
    return simulate_loop(programs, device, run.args.steps, shared)


def _reference(run: Any, target: str) -> Any:
    """XLA:TPU's or XLA:GPU's figures of another program of the loop (compiled deviceless)."""
    if run.tpu is not None:
        from jaxmem.xla.tpu.compile import xla_tpu_reference

        return xla_tpu_reference(target, run.accelerator, top=0)
    from jaxmem.xla.gpu.compile import xla_gpu_reference

    return xla_gpu_reference(target, device=run.preset, top=0)
