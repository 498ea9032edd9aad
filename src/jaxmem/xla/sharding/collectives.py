"""The bytes a device's collectives carry in one run of a compiled, partitioned HLO module: what a
layout or a `jax.checkpoint` policy adds in communication, beside what it saves in memory.

Read from XLA's optimized module text (`executable.hlo_modules()[0].to_string()`): each
collective counts the buffer it moves on this device (an all-gather its gathered result; an
all-reduce, reduce-scatter, all-to-all or collective-permute its input), asynchronous ones once
(at their `-start`), and a loop body's once per iteration: XLA's `known_trip_count` where it
states one, else its condition's bound (`counter < N`, the counter's start read from the loop's
initial tuple where it is a constant). A loop whose bound cannot be read counts once, and the
result says so (`exact` False).

>>> text = '''
... %body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
...   %p = (s32[], f32[8]{0}) parameter(0)
...   %x = f32[8]{0} get-tuple-element(%p), index=1
...   %ag = f32[64]{0} all-gather(%x), dimensions={0}
...   %one = s32[] constant(1)
...   %i = s32[] get-tuple-element(%p), index=0
...   %next = s32[] add(%i, %one)
...   ROOT %t = (s32[], f32[8]{0}) tuple(%next, %x)
... }
... %cond (p: (s32[], f32[8])) -> pred[] {
...   %p = (s32[], f32[8]{0}) parameter(0)
...   %i = s32[] get-tuple-element(%p), index=0
...   %n = s32[] constant(5)
...   ROOT %lt = pred[] compare(%i, %n), direction=LT
... }
... ENTRY %main (a: f32[8]) -> f32[8] {
...   %a = f32[8]{0} parameter(0)
...   %ar = f32[8]{0} all-reduce(%a), to_apply=%add
...   %zero = s32[] constant(0)
...   %init = (s32[], f32[8]{0}) tuple(%zero, %ar)
...   %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
...   ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
... }
... '''
>>> c = collective_bytes(text)
>>> c.by_kind, c.total, c.exact
({'all-reduce': 32, 'all-gather': 1280}, 1312, True)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Element sizes of HLO's types, in bytes (sub-byte types round up: an upper bound).
_ITEM_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
               "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_HEADER_RE = re.compile(r"^(?:ENTRY )?%(\S+) \(")
_INSTR_RE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_CALLED_RE = re.compile(r"\b(body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_COND_RE = re.compile(r"\bcondition=%([\w.\-]+)")


@dataclass
class CollectiveBytes:
    """Per collective kind, the bytes one device's collectives carry in one run of the module."""

    by_kind: dict[str, int] = field(default_factory=dict)
    exact: bool = True           # False: a loop's trip count could not be read (counted once)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def as_json(self) -> dict[str, object]:
        return {"by_kind": dict(self.by_kind), "exact": self.exact}


@dataclass
class _Instr:
    name: str
    opcode: str
    result: str          # the result type's text
    operands: list[str]  # operand instruction names
    attrs: str           # the text after the operand list
    args: str = ""       # the operand list's text (a constant's value)

    def value(self) -> int | None:
        """A scalar integer constant's value, else None."""
        m = re.fullmatch(r"\s*(-?\d+)\s*", self.args) if self.opcode == "constant" else None
        return int(m.group(1)) if m else None


def _split_instr(rest: str) -> tuple[str, str, str, str] | None:
    """(result type, opcode, operand text, attribute text) of the text after `%name = `."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                result, tail = rest[:i + 1], rest[i + 1:].lstrip()
                break
        else:
            return None
    else:
        result, _, tail = rest.partition(" ")
    m = re.match(r"([a-z][\w\-]*)\(", tail)
    if m is None:
        return None
    depth, start = 0, m.end() - 1
    for i in range(start, len(tail)):
        depth += tail[i] == "("
        depth -= tail[i] == ")"
        if depth == 0:
            return result, m.group(1), tail[start + 1:i], tail[i + 1:]
    return None


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """Each computation's instructions, and the entry computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER_RE.match(line)
            if m and line.rstrip().endswith("{"):
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR_RE.match(line)
        parts = _split_instr(m.group(2)) if m else None
        if parts is None:
            continue
        result, opcode, operand_text, attrs = parts
        operands = re.findall(r"%([\w.\-]+)", operand_text)
        comps[current].append(_Instr(m.group(1), opcode, result, operands, attrs, operand_text))
    return comps, entry


def _array_bytes(type_text: str) -> list[int]:
    return [math.prod(int(d) for d in dims.split(",") if d) * _ITEM_BYTES.get(dtype, 4)
            for dtype, dims in _ARRAY_RE.findall(type_text) if dtype in _ITEM_BYTES]


def _kind(opcode: str) -> str | None:
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def _moved(instr: _Instr, sizes: dict[str, int], kind: str) -> int:
    """The buffer a collective moves on this device: an all-gather's result, else its input."""
    out = _array_bytes(instr.result)
    given = sum(sizes.get(name, 0) for name in instr.operands)
    if kind == "all-gather":
        return max(out + [given])
    return given or (max(out) if out else 0)


def _trip_count(instr: _Instr, comps: dict[str, list[_Instr]], local: dict[str, _Instr]) -> int | None:
    """A while loop's iterations: XLA's known_trip_count, else `counter < N` in its condition with
    the counter's start read from the initial tuple (a constant), else None."""
    m = _TRIP_RE.search(instr.attrs)
    if m:
        return int(m.group(1))
    cond = _COND_RE.search(instr.attrs)
    body = comps.get(cond.group(1), []) if cond else []
    named = {i.name: i for i in body}
    root = body[-1] if body else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    counter, bound = (named.get(n) for n in root.operands)
    if counter is None or bound is None or counter.opcode != "get-tuple-element" or bound.opcode != "constant":
        return None
    index = re.search(r"index=(\d+)", counter.attrs)
    start = 0
    init = local.get(instr.operands[0]) if instr.operands else None
    if index and init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
        first = local.get(init.operands[int(index.group(1))])
        start = first.value() if first is not None and first.value() is not None else 0
    limit = bound.value()
    step = _counter_step(instr, comps, int(index.group(1))) if index else None
    if limit is None or step is None:
        return None
    return max(0, -(-(limit - start) // step))


def _counter_step(instr: _Instr, comps: dict[str, list[_Instr]], index: int) -> int | None:
    """What a while body adds to its counter (tuple element `index`) each iteration: the
    constant in `add(get-tuple-element(param, index), constant)` at that element of its root."""
    called = re.search(r"\bbody=%([\w.\-]+)", instr.attrs)
    body = comps.get(called.group(1), []) if called else []
    if not body or body[-1].opcode != "tuple" or index >= len(body[-1].operands):
        return None
    named = {i.name: i for i in body}
    update = named.get(body[-1].operands[index])
    if update is None or update.opcode != "add" or len(update.operands) != 2:
        return None
    parts = [_through_copies(named.get(n), named) for n in update.operands]
    steps = [p.value() for p in parts if p is not None and p.value() is not None]
    counters = [p for p in parts if p is not None and p.opcode == "get-tuple-element"
                and re.search(rf"index={index}\b", p.attrs)]
    return steps[0] if len(steps) == 1 and counters and steps[0] > 0 else None


def _through_copies(instr: _Instr | None, named: dict[str, _Instr]) -> _Instr | None:
    """`instr`, or what it copies (a `copy`, `bitcast` or `convert` of one operand)."""
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and len(instr.operands) == 1:
        instr = named.get(instr.operands[0])
    return instr


def collective_bytes(text: str) -> CollectiveBytes:
    """The collectives of one run of the module in `text` (see the module's docstring)."""
    comps, entry = _computations(text)
    out = CollectiveBytes()
    memo: dict[str, dict[str, int]] = {}

    def visit(name: str, stack: tuple[str, ...]) -> dict[str, int]:
        if name in memo:
            return memo[name]
        if name in stack or name not in comps:
            return {}
        totals: dict[str, int] = {}
        local = {i.name: i for i in comps[name]}
        sizes = {i.name: sum(_array_bytes(i.result)) for i in comps[name]}

        def add(more: dict[str, int], times: int) -> None:
            for k, v in more.items():
                totals[k] = totals.get(k, 0) + v * times

        for instr in comps[name]:
            if instr.opcode.endswith(("-done", "-update")):
                continue
            kind = _kind(instr.opcode)
            if kind is not None:
                totals[kind] = totals.get(kind, 0) + _moved(instr, sizes, kind)
            if instr.opcode == "while":
                trips = _trip_count(instr, comps, local)
                if trips is None:
                    out.exact, trips = False, 1
                called = re.search(r"\bbody=%([\w.\-]+)", instr.attrs)
                if called:
                    add(visit(called.group(1), stack + (name,)), trips)
                continue
            branches = _BRANCHES_RE.search(instr.attrs)
            if branches or instr.opcode == "conditional":
                names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else \
                    [n for key, n in _CALLED_RE.findall(instr.attrs) if key.endswith("_computation")]
                options = [visit(n, stack + (name,)) for n in names]
                if options:
                    add(max(options, key=lambda d: sum(d.values())), 1)
                continue
            for key, called in _CALLED_RE.findall(instr.attrs):
                if key == "to_apply" and kind is not None:
                    continue   # a collective's reduction: no collectives of its own
                add(visit(called, stack + (name,)), 1)
        memo[name] = totals
        return totals

    if entry is not None:
        out.by_kind = {k: v for k, v in visit(entry, ()).items() if v}
    return out


def from_json(data: object) -> CollectiveBytes | None:
    """`CollectiveBytes.as_json`'s inverse; None for anything else (an older cache entry)."""
    if not isinstance(data, dict) or not isinstance(data.get("by_kind"), dict):
        return None
    kinds = {str(k): int(v) for k, v in data["by_kind"].items() if isinstance(v, int) and v >= 0}
    return CollectiveBytes(kinds, bool(data.get("exact", True)))


__all__ = ["CollectiveBytes", "collective_bytes", "from_json", "KINDS"]
