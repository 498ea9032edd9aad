"""A compiled program run for N steps in a device pool, as JAX's runtime runs a training loop.

    program = StepProgram(arguments=[Leaf(64 << 20, donated=True)], outputs=[Leaf(64 << 20, aliases=0)],
                          temp_bytes=32 << 20)
    verdict = simulate_steps(program, Device.from_env("h100-80gb"), steps=3)
    verdict.fits, verdict.peak_bytes, verdict.failed_step

The arguments are resident buffers, allocated once before the first step. Each step, as XLA's
GPU executable asks the pool for them: every output that does not take a donated argument's
buffer, in output order, then the one temp allocation. After the step: the temp allocation is
freed; donated arguments whose buffer no output took are freed; the outputs that are the next
step's state (an output whose shape matches an argument's: `params, opt = step(params, opt,
batch)`) replace that argument, whose buffer is freed when the caller lets go of it; the other
outputs (a loss) replace the previous step's. Arguments that no output replaces (a batch) stay.
Fragmentation is the pool's own: a step fails when no free block is large enough, even if the
free bytes add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jaxmem.errors import OutOfMemory
from jaxmem.runtime.allocator import Buffer
from jaxmem.units import format_size

DEFAULT_STEPS = 3


@dataclass(frozen=True)
class Leaf:
    """One flat argument or output: its bytes; for arguments whether donated, for outputs the
    flat argument whose buffer it takes (XLA's input/output alias) or None; `state_of`: for an
    output, the argument it replaces in the next step (None: not state)."""

    bytes: int
    donated: bool = False
    aliases: int | None = None
    state_of: int | None = None


@dataclass
class StepProgram:
    """What the pool sees of one compiled step: arguments, outputs and the temp allocation."""

    arguments: list[Leaf]
    outputs: list[Leaf]
    temp_bytes: int


@dataclass
class PoolVerdict:
    """The pool across the steps: `fits`; else `failed_step` (1-based; 0 when the resident
    arguments alone do not fit), the allocation that failed and whether fragmentation caused it.
    `peak_bytes` is the pool's peak in use."""

    fits: bool
    limit_bytes: int
    peak_bytes: int
    steps: int
    allocator: str
    preallocate: bool
    mem_fraction: float
    failed_step: int | None = None
    failed_allocation: str | None = None
    failed_bytes: int | None = None
    fragmentation: bool = False
    largest_free_bytes: int | None = None
    in_use_at_failure: int | None = None
    events: list[str] = field(default_factory=list)

    @property
    def headroom_bytes(self) -> int:
        """The limit minus the peak in use (meaningful when it fits)."""
        return self.limit_bytes - self.peak_bytes

    def summary(self) -> dict[str, Any]:
        """The JSON `pool` object."""
        return {"fits": self.fits, "limit_bytes": self.limit_bytes, "peak_bytes": self.peak_bytes,
                "steps": self.steps, "failed_step": self.failed_step, "headroom_bytes": self.headroom_bytes,
                "failed_allocation": self.failed_allocation, "failed_bytes": self.failed_bytes,
                "fragmentation": self.fragmentation, "largest_free_bytes": self.largest_free_bytes,
                "allocator": self.allocator, "preallocate": self.preallocate, "mem_fraction": self.mem_fraction}

    def line(self) -> str:
        """One sentence for people."""
        if self.fits:
            return (f"fits: {self.steps} steps, pool peak {format_size(self.peak_bytes)} of "
                    f"{format_size(self.limit_bytes)} ({format_size(self.headroom_bytes)} headroom)")
        why = "fragmentation: the free bytes add up but no block is large enough" if self.fragmentation else "out of memory"
        if self.failed_step == 0:
            return (f"does not fit: the arguments alone cannot be placed ({self.failed_allocation}, "
                    f"{format_size(self.failed_bytes or 0)}) under {format_size(self.limit_bytes)}; {why}")
        return (f"does not fit: step {self.failed_step} cannot allocate {self.failed_allocation} "
                f"({format_size(self.failed_bytes or 0)}) under {format_size(self.limit_bytes)}; {why}")


def match_state(arguments: Sequence[Leaf], outputs: Sequence[Leaf], shapes_in: Sequence[Any] | None = None,
                shapes_out: Sequence[Any] | None = None) -> list[Leaf]:
    """`outputs` with `state_of` filled in: an aliased output replaces the argument it aliases;
    the others, in order, the first unclaimed argument with the same shape key (bytes when no
    shapes are given).

    >>> [o.state_of for o in match_state([Leaf(8), Leaf(4)], [Leaf(8), Leaf(2)])]
    [0, None]
    """
    keys_in = list(shapes_in) if shapes_in is not None else [a.bytes for a in arguments]
    keys_out = list(shapes_out) if shapes_out is not None else [o.bytes for o in outputs]
    claimed = {o.aliases for o in outputs if o.aliases is not None}
    result = []
    for i, out in enumerate(outputs):
        state = out.aliases
        if state is None:
            for j, key in enumerate(keys_in):
                if j not in claimed and key == keys_out[i]:
                    state = j
                    claimed.add(j)
                    break
        result.append(Leaf(out.bytes, out.donated, out.aliases, state))
    return result


def simulate_steps(program: StepProgram, device: Any, steps: int = DEFAULT_STEPS) -> PoolVerdict:
    """Run `steps` steps of `program` in `device`'s pool (a `jaxmem.Device`).

    >>> from jaxmem.runtime.device import Device
    >>> prog = StepProgram([Leaf(1 << 20)], [Leaf(1 << 20, state_of=0)], temp_bytes=1 << 20)
    >>> simulate_steps(prog, Device("16MiB"), steps=3).fits
    True

    Returns:
        A `PoolVerdict`; the pool is left as the failure (or the last step) left it.
    """
    return simulate_loop([program], device, steps)


def simulate_loop(programs: Sequence[StepProgram], device: Any, steps: int = DEFAULT_STEPS,
                  shared: Sequence[dict[int, int]] | None = None) -> PoolVerdict:
    """Run a loop of several programs in one process `steps` times (a train step, then an eval
    step, ...) in `device`'s pool. `shared[k]` maps an argument of program k to the argument of
    program 0 it is (a loop passes its current state to the eval step): that argument is no
    buffer of its own, and takes whatever program 0's last call left there.

    >>> from jaxmem.runtime.device import Device
    >>> train = StepProgram([Leaf(4 << 20), Leaf(1 << 20)], [Leaf(4 << 20, state_of=0)], temp_bytes=0)
    >>> evaluate = StepProgram([Leaf(4 << 20), Leaf(2 << 20)], [Leaf(512)], temp_bytes=0)
    >>> simulate_loop([train, evaluate], Device("64MiB", allocator="platform"), 2, [{}, {0: 0}]).peak_bytes == (11 << 20) + 512
    True
    """
    shared = list(shared) if shared is not None else [{} for _ in programs]
    allocator = device.allocator
    verdict = PoolVerdict(fits=True, limit_bytes=int(allocator.limit), peak_bytes=0, steps=steps,
                          allocator=device.allocator_name, preallocate=device.preallocate,
                          mem_fraction=device.mem_fraction)

    def take(size: int, what: str, step: int) -> Buffer | None:
        try:
            return device.allocate(max(1, int(size)))
        except OutOfMemory as err:
            verdict.fits = False
            verdict.failed_step = step
            verdict.failed_allocation = what
            verdict.failed_bytes = int(size)
            verdict.fragmentation = bool(getattr(err, "fragmentation", False))
            verdict.largest_free_bytes = getattr(err, "largest_free_block", None)
            verdict.in_use_at_failure = getattr(err, "in_use", None)
            return None

    # Every argument of every program is a slot; a shared argument is program 0's slot.
    slots: list[Buffer | None] = []
    places: list[list[int]] = []
    for k, program in enumerate(programs):
        place = []
        for i, leaf in enumerate(program.arguments):
            if k and i in shared[k]:
                place.append(places[0][shared[k][i]])
                continue
            buf = take(leaf.bytes, _argument_name(k, i), 0)
            if buf is None:
                verdict.peak_bytes = int(allocator.peak_bytes_in_use)
                return verdict
            place.append(len(slots))
            slots.append(buf)
        places.append(place)
    previous: list[list[Buffer]] = [[] for _ in programs]
    for step in range(1, steps + 1):
        for k, program in enumerate(programs):
            made = _call(program, places[k], slots, previous[k], take, device, step, _output_name(k, len(programs)))
            if made is None:
                verdict.peak_bytes = int(allocator.peak_bytes_in_use)
                return verdict
            previous[k] = made
        verdict.events.append(f"step {step}: in use {format_size(allocator.bytes_in_use)}")
    verdict.peak_bytes = int(allocator.peak_bytes_in_use)
    return verdict


def shared_state(first: Sequence[tuple[Any, Sequence[Any]]], program: StepProgram,
                 other: Sequence[tuple[Any, Sequence[Any]]]) -> dict[int, int]:
    """Which flat arguments of a later program in a loop are program 0's state: a positional
    argument (its tree structure and its leaves' shapes and dtypes, as `(tree, [leaf keys])`)
    equal to one of program 0's (`first`, `program`) whose every leaf an output of program 0
    replaces. A loop passes its current state (the parameters, a TrainState) to the eval step;
    a batch of the same shape is another array, and is not matched, as it is no state.

    >>> train = StepProgram([Leaf(16), Leaf(8), Leaf(32)], [Leaf(16, state_of=0), Leaf(8, state_of=1)], 0)
    >>> shared_state([("T", ["f32[4]", "f32[2]"]), ("B", ["f32[8]"])], train, [("T", ["f32[4]", "f32[2]"]), ("B", ["f32[8]"])])
    {0: 0, 1: 1}
    """
    first_state = {o.state_of for o in program.outputs if o.state_of is not None}
    starts, offset = [], 0
    for _, leaves in first:
        starts.append(offset)
        offset += len(leaves)
    mapping: dict[int, int] = {}
    used: set[int] = set()
    flat = 0
    for tree, leaves in other:
        for q, (tree0, leaves0) in enumerate(first):
            state = all(starts[q] + i in first_state for i in range(len(leaves0)))
            if q not in used and state and tree0 == tree and list(leaves0) == list(leaves):
                used.add(q)
                mapping.update({flat + i: starts[q] + i for i in range(len(leaves))})
                break
        flat += len(leaves)
    return mapping


def _argument_name(program: int, index: int) -> str:
    return f"argument {index}" if not program else f"program {program + 1}'s argument {index}"


def _output_name(program: int, count: int) -> str:
    return "output" if count == 1 else f"program {program + 1}'s output"


def _call(program: StepProgram, place: list[int], slots: list[Buffer | None], previous: list[Buffer],
          take: Callable[[int, str, int], Buffer | None], device: Any, step: int, name: str) -> list[Buffer] | None:
    """One call of `program` over its argument slots: its outputs (a donated argument's buffer
    where one aliases it), its temp allocation, the state outputs replacing their arguments;
    returns its outputs that are not state (freed at its next call), or None when one could not
    be allocated."""
    made: list[Buffer | None] = []
    for j, out in enumerate(program.outputs):
        if out.aliases is not None and program.arguments[out.aliases].donated and slots[place[out.aliases]] is not None:
            made.append(slots[place[out.aliases]])   # XLA writes into the donated buffer
            continue
        buf = take(out.bytes, f"{name} {j}", step)
        if buf is None:
            return None
        made.append(buf)
    if program.temp_bytes > 0:
        temp = take(program.temp_bytes, "the temp allocation", step)
        if temp is None:
            return None
        device.free(temp)
    taken = {id(b) for b in made if b is not None}
    # Donated arguments no output took are freed by the runtime.
    for i, leaf in enumerate(program.arguments):
        buf = slots[place[i]]
        if leaf.donated and buf is not None and id(buf) not in taken:
            device.free(buf)
            slots[place[i]] = None
    # Outputs that are state replace their argument; the caller drops the old one.
    for j, out in enumerate(program.outputs):
        buf = made[j]
        if out.state_of is None or buf is None:
            continue
        old = slots[place[out.state_of]]
        if old is not None and old is not buf and id(old) not in taken and old.live:
            device.free(old)
        slots[place[out.state_of]] = buf
    # Other outputs (a loss) replace the previous call's.
    for buf in previous:
        if buf.live:
            device.free(buf)
    return [made[j] for j, out in enumerate(program.outputs) if out.state_of is None and made[j] is not None]


def program_from_reference(ref: Any) -> StepProgram:
    """The `StepProgram` of an `XlaGpuReference` (its per-leaf arguments and outputs)."""
    arguments = [Leaf(int(a["bytes"]), donated=bool(a.get("donated"))) for a in ref.arguments]
    outputs = [Leaf(int(o["bytes"]), aliases=o.get("aliases")) for o in ref.outputs]
    shapes_in = [a.get("shape", a["bytes"]) for a in ref.arguments]
    shapes_out = [o.get("shape", o["bytes"]) for o in ref.outputs]
    return StepProgram(arguments, match_state(arguments, outputs, shapes_in, shapes_out), int(ref.temp_bytes))


def make_device(capacity: int | str, environ: Any = None, *, allocator: str | None = None,
                preallocate: bool | None = None, mem_fraction: float | None = None) -> Any:
    """A simulated device set up as JAX would from `environ` (default: this process's), with any
    of allocator, preallocate and mem_fraction overridden (the CLI's flags)."""
    import os

    from jaxmem.runtime.config import config_from_env
    from jaxmem.runtime.device import Device

    # A flag replaces its variable before the environment is read, so that a value jaxmem cannot
    # model (XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async) is no error once a flag overrides it.
    env = dict(os.environ if environ is None else environ)
    if allocator is not None:
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = allocator
    if mem_fraction is not None:
        env.pop("XLA_CLIENT_MEM_FRACTION", None)
        env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    if preallocate is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
    config = config_from_env(env)
    return Device(capacity, allocator=allocator or config.allocator,
                  preallocate=config.preallocate if preallocate is None else preallocate,
                  mem_fraction=config.mem_fraction if mem_fraction is None else mem_fraction,
                  unified_memory=config.unified_memory)
