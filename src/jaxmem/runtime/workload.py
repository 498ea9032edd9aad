"""A built-in allocation workload: the buffer stream of a few training steps, and a runner.

The stream is what an un-donated JAX training step asks of the pool: parameters and Adam
state that live throughout; per layer, activations kept for the backward pass and
temporaries freed at once; in the backward pass, gradients appear as activations go; the
update writes new parameters and optimizer state and frees the old ones. Sizes are fractions
of the pool limit with a seeded jitter, so the same workload fits any device.

    events = training_events(60 << 30, layers=12, steps=2)
    result = run_events(Device("80GiB").allocator, events)
    result.peak_in_use, result.failures
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from jaxmem.errors import OutOfMemory
from jaxmem.runtime.allocator import Allocator

# (op, buffer id, size): op "alloc" uses size; "free" ignores it.
Event = tuple[str, int, int]


def training_events(limit: int, *, layers: int = 24, steps: int = 3, seed: int = 0) -> list[Event]:
    """The events of `steps` training steps of a `layers`-layer model sized to `limit` bytes.

    >>> events = training_events(1 << 30, layers=2, steps=1)
    >>> sum(op == "alloc" for op, _, _ in events) - sum(op == "free" for op, _, _ in events)
    6

    Args:
        limit: the pool limit the model is sized for (peak demand is about 80% of it).
        layers: layers of the model.
        steps: training steps.
        seed: jitter of the sizes.

    Returns:
        A list of ("alloc", id, size) and ("free", id, 0). Parameters and optimizer state are
        still live at the end, as between the steps of a real program.
    """
    rng = random.Random(seed)
    events: list[Event] = []
    ids = iter(range(1 << 62))

    def alloc(share: float) -> int:
        # odd byte counts, as real shapes give, so rounding shows
        size = max(1, int(limit * share * rng.uniform(0.7, 1.3)) + rng.randrange(256))
        buf = next(ids)
        events.append(("alloc", buf, size))
        return buf

    def free(buf: int) -> None:
        events.append(("free", buf, 0))

    param_share, act_share, temp_share = 0.08 / layers, 0.45 / layers, 0.02 / layers
    params = [alloc(param_share) for _ in range(layers)]
    moments = [(alloc(param_share), alloc(param_share)) for _ in range(layers)]
    for _ in range(steps):
        saved = []
        for _ in range(layers):                      # forward
            temp = alloc(temp_share)
            saved.append(alloc(act_share))
            free(temp)
        grads = []
        for layer in reversed(range(layers)):        # backward
            temp = alloc(temp_share)
            grads.append((layer, alloc(param_share)))
            free(saved[layer])
            free(temp)
        for layer, grad in grads:                    # optimizer: new buffers, old ones go
            new_param, new_m, new_v = alloc(param_share), alloc(param_share), alloc(param_share)
            free(params[layer])
            free(moments[layer][0])
            free(moments[layer][1])
            free(grad)
            params[layer], moments[layer] = new_param, (new_m, new_v)
    return events


@dataclass
class RunResult:
    """What one allocator made of a workload."""

    peak_in_use: int = 0
    peak_occupancy: str = ""          # the pool's strip at the moment of peak use
    failures: list[OutOfMemory] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # memory_stats() at the end


def run_events(allocator: Allocator, events: list[Event], *, width: int = 80) -> RunResult:
    """Replay `events` through `allocator`; a failed allocation is recorded, not raised.

    Args:
        allocator: a fresh allocator.
        events: from `training_events`.
        width: characters in the occupancy strip.
    """
    from jaxmem.runtime.dump import occupancy

    result = RunResult()
    live = {}
    for op, buf, size in events:
        if op == "alloc":
            try:
                live[buf] = allocator.allocate(size)
            except OutOfMemory as err:
                result.failures.append(err)
                continue
            if allocator.bytes_in_use > result.peak_in_use:
                result.peak_in_use = allocator.bytes_in_use
                result.peak_occupancy = occupancy(list(allocator.chunks()), width)
        elif buf in live:
            allocator.free(live.pop(buf))
    result.stats = allocator.memory_stats()
    return result


def interleaved_events(limit: int, *, block: int) -> tuple[list[Event], int]:
    """Fill the limit with alternating activation/gradient blocks, free the activations, and
    ask for a block 2.5 times as large: about half the pool is free, but only in holes.

    Returns:
        (events, request): the events up to the request, and the request's size.
    """
    events: list[Event] = []
    count = limit // block
    for buf in range(count):
        events.append(("alloc", buf, block))
    for buf in range(0, count, 2):
        events.append(("free", buf, 0))
    return events, 5 * block // 2
