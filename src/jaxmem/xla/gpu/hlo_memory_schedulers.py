"""XLA's three memory schedulers run over XLA's own entry computation, read from a dump.

XLA:GPU's memory scheduler (xla/hlo/transforms/simplifiers/hlo_memory_scheduler.cc,
DefaultMemoryScheduler) runs a list, a DFS and a post-order scheduler and keeps the order with
the least memory. The module XLA dumps after optimization is printed in the order it kept; the
two it rejected are in no dump. This module rebuilds all three from the dumped instructions, so
they can be compared buffer by buffer with each other and with the model's
(`python -m jaxmem.xla.gpu.hlo_memory_schedulers DUMP.txt`).

- `list_schedule` follows ListScheduler: an instruction's priority is the bytes of the operand
  values it reads for the last time less the bytes it defines, then its user count (effective
  scalars first); priorities are set when an instruction becomes ready and refreshed only for
  the users of an operand whose value just came down to one unscheduled use; among equal
  priorities the one that became ready last runs.
- `dfs_schedule` follows DFSMemoryScheduler: a post-order DFS from the root, operands visited by
  decreasing extra users, then decreasing total sizes (both summed over operands transitively,
  capped), then name.
- `post_order` is HloComputation::MakeInstructionPostOrder, the post-order scheduler's order.

Values follow HloDataflowAnalysis: bitcast, get-tuple-element and tuple elements forward their
operand's values, so a get-tuple-element reads every value of its tuple. Parameters and
constants define no bytes and free none. The dump's text order stands for the computation's
instruction and user order, which only breaks the list scheduler's ties: where XLA kept DFS or
the post order, the rebuilt order is the dumped one instruction for instruction
(`tests/gpu/test_hlo_memory_schedulers.py`).
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

from jaxmem.errors import PlanError

ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                 "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                 "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
POINTER_BYTES = 8          # a tuple's table of element pointers
FORWARDING = ("bitcast", "get-tuple-element", "tuple")
NO_BYTES = ("parameter", "constant")   # ListScheduler::IgnoreInstruction

_LINE = re.compile(r"^\s*(ROOT )?%(\S+) = (.*)$")
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\]")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")


@dataclass
class Instruction:
    """One instruction of the entry computation: its shape as a tree of (bytes, dims) leaves."""

    name: str
    shape: object
    opcode: str
    operands: list[str]
    root: bool = False
    index: int = -1
    users: list[str] = field(default_factory=list)


def _skip_comment(text: str, i: int) -> int:
    while text[i] in " ,":
        i += 1
    if text.startswith("/*", i):
        return _skip_comment(text, text.index("*/", i) + 2)
    return i


def parse_shape(text: str, i: int = 0) -> tuple[object, int]:
    """(shape, index after it): a tuple shape is a list of shapes, an array (bytes, dims)."""
    i = _skip_comment(text, i)
    if text[i] == "(":
        elements, i = [], i + 1
        while True:
            i = _skip_comment(text, i)
            if text[i] == ")":
                return elements, i + 1
            element, i = parse_shape(text, i)
            elements.append(element)
    m = _ARRAY.match(text, i)
    if m is None:
        raise PlanError(f"cannot read an HLO shape at {text[i:i + 40]!r}")
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    count = 1
    for d in dims:
        count *= d
    end = m.end()
    if end < len(text) and text[end] == "{":
        end = text.index("}", end) + 1
    return (count * ELEMENT_BYTES.get(m.group(1), 4), dims), end


def parse_entry(text: str) -> list[Instruction]:
    """The entry computation's instructions in the dump's order, users filled in."""
    start = text.find("\nENTRY")
    if start < 0:
        raise PlanError("no ENTRY computation in this HLO text")
    out: list[Instruction] = []
    for line in text[start:].split("\n")[1:]:
        if line.startswith("}"):
            break
        m = _LINE.match(line)
        if m is None:
            continue
        root, name, rest = m.groups()
        shape, i = parse_shape(rest)
        op = _OPCODE.match(rest, i)
        if op is None:
            raise PlanError(f"cannot read the opcode of %{name}")
        depth, k = 1, op.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(rest[k], 0)
            k += 1
        operands = re.findall(r"%([^\s,)]+)", rest[op.end():k - 1])
        index = re.search(r"index=(\d+)", rest[k:])
        out.append(Instruction(name, shape, op.group(1), operands, bool(root),
                               int(index.group(1)) if index and op.group(1) == "get-tuple-element" else -1))
    by_name = {ins.name: ins for ins in out}
    for ins in out:
        for o in dict.fromkeys(ins.operands):
            by_name[o].users.append(ins.name)
    return out


@dataclass
class Dataflow:
    """Values (bytes, defining instruction) and, per instruction, its value tree (value id,
    element trees or None) and the values it defines."""

    sizes: list[int]
    owner: list[str]
    tree: dict[str, tuple]
    defined: dict[str, list[int]]

    def flat(self, name: str) -> list[int]:
        """Every value in `name`'s value tree (GetFlattenedValueSet)."""
        out, todo = [], [self.tree[name]]
        while todo:
            vid, elements = todo.pop()
            out.append(vid)
            todo.extend(elements or ())
        return out


def dataflow(instructions: Sequence[Instruction]) -> Dataflow:
    """HloDataflowAnalysis's values for these instructions (forwarding ops define none but a
    tuple's own table)."""
    flow = Dataflow([], [], {}, {})

    def new(size: int, name: str) -> int:
        flow.sizes.append(size)
        flow.owner.append(name)
        return len(flow.sizes) - 1

    def build(shape: object, name: str) -> tuple:
        if isinstance(shape, list):
            return new(POINTER_BYTES * len(shape), name), [build(e, name) for e in shape]
        return new(shape[0], name), None

    for ins in instructions:
        before = len(flow.sizes)
        if ins.opcode == "bitcast":
            flow.tree[ins.name] = flow.tree[ins.operands[0]]
        elif ins.opcode == "get-tuple-element":
            flow.tree[ins.name] = flow.tree[ins.operands[0]][1][ins.index]
        elif ins.opcode == "tuple":
            flow.tree[ins.name] = (new(POINTER_BYTES * len(ins.operands), ins.name),
                                   [flow.tree[o] for o in ins.operands])
        else:
            flow.tree[ins.name] = build(ins.shape, ins.name)
        flow.defined[ins.name] = list(range(before, len(flow.sizes)))
    return flow


def _effective_scalar(shape: object) -> bool:
    return not isinstance(shape, list) and all(d == 1 for d in shape[1])


def list_schedule(instructions: Sequence[Instruction]) -> list[str]:
    """ListScheduler::CreateSchedule over `instructions`: their names in the order it runs them."""
    flow = dataflow(instructions)
    by_name = {ins.name: ins for ins in instructions}
    ignored = [by_name[n].opcode in NO_BYTES for n in flow.owner]
    uses = {ins.name: sorted({v for o in dict.fromkeys(ins.operands) for v in flow.flat(o)})
            for ins in instructions}
    unscheduled = [0] * len(flow.sizes)
    for vs in uses.values():
        for v in vs:
            unscheduled[v] += 1
    for ins in instructions:
        if ins.root:
            for v in set(flow.flat(ins.name)):
                unscheduled[v] += 1
    defined = {ins.name: 0 if ins.opcode in NO_BYTES else sum(flow.sizes[v] for v in flow.defined[ins.name])
               for ins in instructions}

    def priority(name: str) -> tuple[int, int]:
        if _effective_scalar(by_name[name].shape):
            return (sys.maxsize, sys.maxsize)
        freed = sum(flow.sizes[v] for v in uses[name] if not ignored[v] and unscheduled[v] == 1)
        return (freed - defined[name], len(by_name[name].users))

    waiting = {ins.name: len(dict.fromkeys(ins.operands)) for ins in instructions}
    arrival = itertools.count()
    ready = {ins.name: (priority(ins.name), next(arrival)) for ins in instructions if not ins.operands}
    order: list[str] = []
    while ready:
        best = max(ready, key=ready.__getitem__)
        del ready[best]
        order.append(best)
        refresh = False
        for v in uses[best]:
            unscheduled[v] -= 1
            refresh = refresh or unscheduled[v] == 1
        for user in by_name[best].users:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready[user] = (priority(user), next(arrival))
        if refresh:
            for o in by_name[best].operands:
                for user in by_name[o].users:
                    if user in ready and priority(user) != ready[user][0]:
                        ready[user] = (priority(user), next(arrival))
    return order


def _post_order_from(starts: Sequence[str], children: Callable[[str], list[str]]) -> list[str]:
    """An iterative post-order DFS from each of `starts` in turn; `children(name)`: the operands
    of `name` not yet done, in the order they are to be visited."""
    done: set[str] = set()
    order: list[str] = []
    for start in starts:
        stack, expanding = [start], set()
        while stack:
            name = stack[-1]
            if name in done:
                stack.pop()
            elif name in expanding:
                stack.pop()
                done.add(name)
                order.append(name)
            else:
                expanding.add(name)
                stack.extend(reversed([o for o in children(name) if o not in done]))
    return order


def post_order(instructions: Sequence[Instruction]) -> list[str]:
    """HloComputation::MakeInstructionPostOrder (the post-order scheduler's order): a post-order
    DFS from each instruction nothing reads, in the computation's order, operands first to last."""
    by_name = {ins.name: ins for ins in instructions}
    return _post_order_from([ins.name for ins in instructions if not ins.users],
                            lambda name: by_name[name].operands)


def dfs_schedule(instructions: Sequence[Instruction]) -> list[str]:
    """DFSMemoryScheduler: a post-order DFS from the root (instructions nothing reads first),
    each instruction's operands visited by decreasing extra users (users - 1, summed over its
    operands transitively), then decreasing total sizes (bytes it defines, likewise), then
    name; both sums capped as XLA caps them, along `post_order`."""
    flow = dataflow(instructions)
    by_name = {ins.name: ins for ins in instructions}
    extra: dict[str, int] = {}
    total: dict[str, int] = {}
    cumulative = 0
    for name in post_order(instructions):
        ins = by_name[name]
        if ins.opcode in NO_BYTES:
            extra[name] = total[name] = 0
            continue
        size = sum(flow.sizes[v] for v in flow.defined[name])
        cumulative += size
        e, t = max(len(ins.users) - 1, 0), size
        for o in dict.fromkeys(ins.operands):
            e, t = e + extra[o], t + total[o]
        extra[name], total[name] = min(e, len(instructions)), min(t, cumulative)

    def key(name: str) -> tuple[int, int, str]:
        return (-extra[name], -total[name], name)

    roots = [ins.name for ins in instructions if not ins.users and not ins.root]
    roots += [ins.name for ins in instructions if ins.root]
    return _post_order_from(roots, lambda name: sorted(by_name[name].operands, key=key))


def live_bytes(instructions: Sequence[Instruction], order: Sequence[str],
               parameters: bool = False) -> list[int]:
    """Bytes of values live at each step of `order` (a value from its definition to its last
    read, live-out values to the end; no buffer shared in place); entry parameters counted
    only with `parameters`."""
    flow = dataflow(instructions)
    by_name = {ins.name: ins for ins in instructions}
    at = {name: k for k, name in enumerate(order)}
    last = [-1] * len(flow.sizes)
    for name in order:
        for o in by_name[name].operands:
            for v in flow.flat(o):
                last[v] = max(last[v], at[name])
    for ins in instructions:
        if ins.root:
            for v in flow.flat(ins.name):
                last[v] = len(order)
    profile = [0] * (len(order) + 1)
    for v, size in enumerate(flow.sizes):
        if by_name[flow.owner[v]].opcode == "parameter" and not parameters:
            continue
        start = at[flow.owner[v]]
        for t in range(start, max(start, last[v]) + 1):
            profile[t] += size
    return profile


def main(argv: Sequence[str] | None = None) -> int:
    """Print the peak live bytes of the dumped order and of each scheduler's order rebuilt."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m jaxmem.xla.gpu.hlo_memory_schedulers MODULE_after_optimizations.txt", file=sys.stderr)
        return 2
    try:
        instructions = parse_entry(open(args[0]).read())
    except (OSError, PlanError, ValueError, IndexError, KeyError) as err:
        print(f"error: cannot read {args[0]}: {err}", file=sys.stderr)
        return 1
    dumped = [ins.name for ins in instructions]
    for label, order in (("dumped", dumped), ("list", list_schedule(instructions)),
                         ("dfs", dfs_schedule(instructions)), ("post", post_order(instructions))):
        profile = live_bytes(instructions, order, parameters=True)
        peak = max(profile)
        step = profile.index(peak)
        same = " (the dumped order)" if label != "dumped" and order == dumped else ""
        print(f"{label:7} peak {peak / 2**20:8.2f} MiB at step {step} of {len(order)} "
              f"({order[min(step, len(order) - 1)]}){same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
