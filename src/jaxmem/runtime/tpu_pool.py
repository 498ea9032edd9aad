"""A compiled program run for N steps as JAX's TPU runtime holds its memory.

The TPU runtime is not the GPU client: nothing is preallocated and none of the
`XLA_PYTHON_CLIENT_*` variables apply (they are read by JAX's GPU client only). What a v5e's
`memory_stats()` shows (benchmarks/results/tpu_v5e_chip.jsonl, BENCHMARKS.md):

- `bytes_limit` is the chip's memory a program may use (16,909,336,064 B on a v5e);
- arguments and outputs are buffers (`bytes_in_use`, `peak_bytes_in_use`), placed and freed
  as on any device: arguments resident, per step the outputs that take no donated argument's
  buffer, the state outputs replacing their arguments afterwards (`runtime/steps.py`);
- the program's code is a buffer from its first call on (`generated_code_size_in_bytes`), and
  the runtime holds one buffer of its own (`RUNTIME_BYTES`) from the start;
- the program's temporaries are not buffers: they are a reservation the program holds from its
  first call (`bytes_reserved`, `peak_bytes_reserved`): XLA:TPU's preallocated temporaries in
  device memory (`xla.tpu.compile.reservation_bytes`), which is less than `temp_size_in_bytes`; buffers
  share the chip with it.

    verdict = simulate_tpu_steps(program, resolve("tpu-v5e-16gb").capacity_bytes, steps=3)
    verdict.peak_bytes      # what peak_bytes_in_use + peak_bytes_reserved shows on the chip
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from jaxmem.errors import PlanError
from jaxmem.runtime.steps import Leaf, PoolVerdict, StepProgram, simulate_loop

RULES = "tpu_runtime"
# The one buffer JAX's TPU runtime holds before any array is made (26,624 B on a v5e, read
# from memory_stats() at start; benchmarks/results/tpu_v5e_chip.jsonl).
RUNTIME_BYTES = 26_624
# The GPU client's variables, which JAX's TPU runtime does not read.
GPU_CLIENT_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                        "XLA_PYTHON_CLIENT_ALLOCATOR")


@dataclass
class TpuVerdict(PoolVerdict):
    """A `PoolVerdict` under the TPU runtime's rules (`summary()` says so); `message` is XLA:TPU's
    own when its compile refused the program."""

    reserved_bytes: int = 0
    code_bytes: int = 0
    message: str = ""
    factory_programs: int = 0        # programs the factory ran on the chip before the step ...
    factory_code_bytes: int = 0      # ... whose code stays resident (counted in code_bytes)

    def line(self) -> str:
        if self.message:
            return f"does not fit: XLA:TPU refuses to compile it: {self.message}"
        return super().line()

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "rules": RULES, "reserved_bytes": self.reserved_bytes,
                "code_bytes": self.code_bytes, "allocator": "tpu", "preallocate": False, "mem_fraction": None,
                "message": self.message or None, "factory_programs": self.factory_programs,
                "factory_code_bytes": self.factory_code_bytes}


def check_tpu_flags(mem_fraction: Any, preallocate: Any, allocator: Any, steps: int) -> None:
    """The pool flags that name GPU-client settings are refused on a TPU preset, in one line."""
    if steps < 1:
        raise PlanError(f"--steps must be 1 or more, got {steps}")
    given = [flag for flag, value in (("--mem-fraction", mem_fraction), ("--preallocate", preallocate),
                                      ("--allocator", allocator)) if value is not None]
    if given:
        raise PlanError(f"{given[0]} sets JAX's GPU client (XLA_PYTHON_CLIENT_*), which JAX's TPU runtime does "
                        "not read: a TPU preallocates nothing and has one allocator")


def ignored_gpu_variables(environ: Any = None) -> list[str]:
    """The GPU client's variables set in `environ` (default: this process's), which a TPU ignores.

    >>> ignored_gpu_variables({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5", "HOME": "/"})
    ['XLA_PYTHON_CLIENT_MEM_FRACTION']
    """
    import os

    environ = os.environ if environ is None else environ
    return [name for name in GPU_CLIENT_VARIABLES if name in environ]


def _verdict(limit: int, steps: int, reserved: int, code: int) -> TpuVerdict:
    verdict = TpuVerdict(fits=True, limit_bytes=int(limit), peak_bytes=0, steps=steps, allocator="tpu",
                         preallocate=False, mem_fraction=1.0)
    verdict.reserved_bytes, verdict.code_bytes = int(reserved), int(code)
    return verdict


def simulate_tpu_steps(program: StepProgram, limit: int, steps: int = 3, *, code_bytes: int = 0,
                       reserved_bytes: int | None = None, factory: dict[str, int] | None = None) -> TpuVerdict:
    """Run `steps` steps of `program` under the TPU runtime's rules on a chip of `limit` bytes.

    Resident: the runtime's own buffer (`RUNTIME_BYTES`), the arguments, and from the first call
    the program's code (`code_bytes`). The program's reservation (`reserved_bytes`: XLA:TPU's
    preallocated temporaries as the runtime reserves them, `xla.tpu.compile.reservation_bytes`; else
    its temp bytes) is held beside the buffers, which a best-fit pool places over the rest of
    the chip. `peak_bytes` is the buffers' peak plus the reservation, as
    `peak_bytes_in_use + peak_bytes_reserved` reads on the chip.

    >>> from jaxmem.runtime.steps import Leaf
    >>> prog = StepProgram([Leaf(1 << 20)], [Leaf(1 << 20, state_of=0)], temp_bytes=3 << 20)
    >>> v = simulate_tpu_steps(prog, 16 << 20, steps=3)
    >>> v.fits, v.peak_bytes == RUNTIME_BYTES + (2 << 20) + (3 << 20)
    (True, True)
    """
    return simulate_tpu_loop([program], limit, steps, code_bytes=[code_bytes], reserved_bytes=[reserved_bytes],
                             factory=factory)


def simulate_tpu_loop(programs: Sequence[StepProgram], limit: int, steps: int = 3, *,
                      shared: Sequence[dict[int, int]] | None = None, code_bytes: Sequence[int] = (),
                      reserved_bytes: Sequence[int | None] = (), factory: dict[str, int] | None = None) -> TpuVerdict:
    """Several programs run in turn in one process (a train step and an eval step), `steps`
    times, under the TPU runtime's rules (`simulate_tpu_steps` for one). What a v5e showed for
    a train + eval loop (benchmarks/results/tpu_v5e_eval.jsonl, `linen_train_eval_loop`): each
    program's code stays resident from its first call, and the runtime holds one reservation,
    the largest any program called so far needed (the eval step's 201,474,048 B stayed through
    the next train step, whose own is 3,915,776 B). `shared` is `simulate_loop`'s: the arguments
    of a later program that are program 0's state. `factory`: the programs the factory ran on
    the chip before the loop (`xla.tpu.factory.factory_programs`): their code stays resident
    beside the loop's, and their reservation counts as any program's.
    """
    from jaxmem.runtime.device import Device

    factory = factory or {}
    reserved = max([int(p.temp_bytes if r is None else r)
                    for p, r in zip(programs, list(reserved_bytes) + [None] * len(programs))]
                   + [int(factory.get("reserved_bytes", 0))])
    codes = [int(c) for c in list(code_bytes) + [factory.get("code_bytes", 0)] if c]
    verdict = _verdict(limit, steps, reserved, sum(codes))
    verdict.factory_programs = int(factory.get("programs", 0))
    verdict.factory_code_bytes = int(factory.get("code_bytes", 0))
    room = int(limit) - reserved
    if room <= 0:
        verdict.fits, verdict.failed_step, verdict.failed_bytes = False, 1, reserved
        verdict.failed_allocation = "the program's reservation for its temporaries"
        verdict.peak_bytes = reserved
        return verdict
    # The runtime's buffer and the code stay resident; appended to the first program's
    # arguments, so that the programs' own argument indices (aliases, state) are unchanged.
    first = programs[0]
    resident = [Leaf(RUNTIME_BYTES)] + [Leaf(c) for c in codes]
    buffers_only = [StepProgram(list(first.arguments) + resident, first.outputs, 0)]
    buffers_only += [StepProgram(p.arguments, p.outputs, 0) for p in programs[1:]]
    # Each buffer exactly its size (the chip's counters add up exact buffer sizes: a BFC pool's
    # chunks, larger than asked where a free chunk is not split, are not what it shows).
    device = Device(room, allocator="platform")
    buffers = simulate_loop(buffers_only, device, steps, shared)
    for name in ("fits", "failed_step", "failed_allocation", "failed_bytes", "fragmentation",
                 "largest_free_bytes", "in_use_at_failure", "events"):
        setattr(verdict, name, getattr(buffers, name))
    if verdict.failed_allocation and verdict.failed_allocation.startswith("argument "):
        index = int(verdict.failed_allocation.split()[1])
        if index >= len(first.arguments):
            verdict.failed_allocation = "the program's code" if index > len(first.arguments) else "the runtime's buffer"
    verdict.peak_bytes = buffers.peak_bytes + reserved
    return verdict


def compile_refused(ref: Any, accelerator: Any, steps: int) -> TpuVerdict:
    """The verdict when XLA:TPU's own compile refused the program (over the chip's memory)."""
    verdict = _verdict(accelerator.capacity_bytes, steps, ref.temp_bytes, 0)
    verdict.fits, verdict.failed_step = False, 0
    verdict.failed_allocation = "XLA:TPU's compile"
    verdict.failed_bytes = int(ref.total_bytes)
    verdict.peak_bytes = int(ref.total_bytes)
    verdict.message = ref.oom
    return verdict
