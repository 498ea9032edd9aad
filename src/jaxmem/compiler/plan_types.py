"""The data a memory plan hands to the executor, the reports and the CLI.

Plain data only: the planner builds it, everyone else reads it. Values are named by `ValueId`
(an int the graph assigns to each jaxpr variable it plans); the jaxpr itself is kept read-only
on the plan so the executor can run its equations.

A schedule is a list of `Step`s in execution order. A step is one top-level equation of the
traced jaxpr (nested jaxprs such as scan/while/cond bodies are one step at this level; their
internal temporaries are a `scratch` buffer live during that step only). A value the fusion
model keeps out of memory has no buffer: `Plan.location(v)` is None and the executor keeps it
as a transient while it runs the step(s) that consume it (as a fused kernel keeps it in
registers).

Arguments that are not donated stay in the caller's memory, outside the arena: their values
have `buffer=None` and `producer=None`, and they count in `Plan.argument_bytes` and in the peak.
Donated arguments live in the arena (kind "argument") so outputs may take their storage over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ValueId = int


@dataclass(frozen=True)
class SourceLine:
    """Where the user's code made a value: the innermost frame of the user's own code (outside
    JAX, jaxmem and installed libraries). `library` is the innermost library frame below it, where
    the call went through one (`flax/linen/linear.py:287` under the user's `model.apply`)."""

    file: str
    line: int
    function: str
    library: SourceLine | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"

    @property
    def text(self) -> str:
        """The line as written (stripped), or "" where the file cannot be read."""
        import linecache

        return linecache.getline(self.file, self.line).strip()


@dataclass(frozen=True)
class Const:
    """An operand that is not a planned value: a jaxpr literal or a closed-over constant."""

    value: Any
    aval: Any = field(default=None, compare=False, repr=False)  # its abstract type, to store it


@dataclass
class Step:
    """One scheduled operation.

    `eqn` is the jaxpr equation to run (read-only). Call-like primitives (pjit, closed_call,
    custom_jvp_call, custom_vjp_call, remat/checkpoint) are inlined by the planner, so `eqn` may
    come from a nested jaxpr; `operands`/`outputs` then name the values it reads and writes
    after renaming. Loops and conditionals (scan, while, cond) stay one step; their body's
    temporaries are a "scratch" buffer live during the step only.
    """

    index: int                     # position in the schedule
    eqn: Any                       # the jaxpr equation (jax.extend.core.JaxprEqn)
    primitive: str
    operands: list[ValueId | Const]  # eqn.invars in order
    outputs: list[ValueId | None]    # eqn.outvars in order; None for a dropped output (`_`)
    fused: bool = False            # True when every output is a transient (no buffer)
    scratch_bytes: int = 0         # bytes of the loop/cond body's own temporaries
    source: SourceLine | None = None

    @property
    def inputs(self) -> list[ValueId]:
        return [v for v in self.operands if not isinstance(v, Const)]


@dataclass
class PlannedBuffer:
    """One region of the arena, held by one or more values that share storage (aliases)."""

    id: int
    offset: int                    # bytes from the arena's start, 256-aligned
    size: int                      # bytes, rounded to 256
    start: int                     # first step index during which it is live (-1: on entry)
    end: int                       # last step index during which it is live (len(schedule): on exit)
    values: list[ValueId]          # values stored here, in definition order
    kind: str                      # "argument" (donated) | "output" | "temp" | "scratch" (a loop
                                   # body's temporaries) | "external" (size 0: a temporary a loop
                                   # body's result took over, living in the loop's own buffer)
    category: str = "temporary"    # report category: parameters, optimizer_state, residuals,
                                   # gradients, temporaries, outputs
    shape: tuple[int, ...] = ()
    dtype: str = ""
    source: SourceLine | None = None
    label: str = ""                # e.g. "dot_general" or "scan scratch"


@dataclass
class ValueInfo:
    id: ValueId
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: int | None           # step index that defines it; None for arguments/constants
    buffer: int | None             # PlannedBuffer.id, or None when fused away
    source: SourceLine | None = None


class MemoryAnalysisTotal:
    """`total_bytes` of XLA's `memory_analysis()` figures, for the classes that hold them
    (`argument_bytes`, `output_bytes`, `temp_bytes`, `alias_bytes`): argument + output + temp -
    alias."""

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


@dataclass
class XlaReference(MemoryAnalysisTotal):
    """XLA's own numbers for the same function on this machine (compiled.memory_analysis())."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int = 0
    scheduler: str = "default"
    # XLA:CPU fusions handed to a library (YNNPACK's "__ynn_fusion"), and the bytes of the dot and
    # convolution results inside them that are not the fusion's output: those are the library's
    # own allocations, missing from temp_bytes, so the total undercounts by about that much.
    library_fusions: int = 0
    library_hidden_bytes: int = 0


@dataclass
class Plan:
    """A valid memory plan for one traced function with fixed input shapes."""

    peak_bytes: int                # non-donated argument bytes + arena_bytes
    arena_bytes: int               # size of the single arena (outputs, temps, donated args)
    argument_bytes: int
    output_bytes: int
    lower_bound_bytes: int         # max over time of live bytes, chosen schedule
    program_order_lower_bound_bytes: int
    schedule: list[Step]
    buffers: list[PlannedBuffer]
    values: dict[ValueId, ValueInfo]
    invars: list[ValueId]          # top-level inputs in order (flattened)
    outvars: list[ValueId | None]  # top-level outputs in order; None where an output is a literal
    donated: tuple[int, ...] = ()  # flat argument indices donated
    valid: bool = False            # the checker's verdict
    plan_seconds: float = 0.0
    num_eqns: int = 0              # equations counted through nested jaxprs
    unknown_primitives: list[str] = field(default_factory=list)
    scheduler: str = ""            # which schedule won
    placement: str = ""            # which placement won
    xla: XlaReference | None = None
    closed_jaxpr: Any = None       # the traced ClosedJaxpr (read-only)
    var_ids: dict[Any, ValueId] = field(default_factory=dict)  # jaxpr Var -> ValueId
    trace_seconds: float | None = None  # JAX's tracing, when `plan()` traced it (not in plan_seconds)
    schedule_peaks: dict[str, int] = field(default_factory=dict)  # arena peak of each schedule tried
    fused_values: int = 0          # values the fusion model keeps out of memory
    problems: list[str] = field(default_factory=list)  # the checker's findings (empty: valid)
    check_seconds: float = 0.0
    # Results written straight into memory outside this plan (a loop body's results, in the
    # loop's own buffers): stored, though they hold no buffer here.
    external_outputs: tuple[ValueId, ...] = ()

    def location(self, value: ValueId) -> tuple[int, int] | None:
        """(offset, nbytes) of a value in the arena, or None when it has no buffer of its own
        in the arena (fused away, or a non-donated argument that stays in the caller's memory)."""
        info = self.values[value]
        if info.buffer is None:
            return None
        return self.buffers[info.buffer].offset, info.nbytes

    def live_at(self, step: int) -> list[PlannedBuffer]:
        return [b for b in self.buffers if b.start <= step <= b.end]
