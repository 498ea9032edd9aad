"""Whether a loss is a mean over its batch's examples: what gradient accumulation needs to keep
the step's values.

Split into micro-batches, a loss gives the batch's gradient (as the mean of theirs) only where
each example's part of it is computed from that example alone and the loss averages those parts.
A batch norm's statistics, in-batch negatives (`x @ x.T`), a max over the batch, a slice of the
batch's rows, `sum(loss * mask) / sum(mask)`, or a loss that sums over its batch all change the
values micro-batching gives. This module reads the loss's jaxpr forward, marking each value:

- `N`: computed without the batch (parameters, constants);
- `B(a)`: one slice per example along axis `a`, each computed from that example alone;
- `R(d, ...)`: a sum over the examples' slices divided by `d` so far (None: by a value unknown
  here), or several such added together;
- `X(why)`: mixes examples some other way.

The loss passes where its value is `R(d, ...)` with each `d` a whole multiple of the batch size (a mean:
each micro-batch divides by its own size, so the mean of theirs is the batch's). Anything
unknown is `X`: a loss this reading cannot follow is not split.

>>> import jax, jax.numpy as jnp
>>> def mse(w, x): return jnp.mean((x @ w) ** 2)
>>> def batch_norm(w, x): h = x @ w; return jnp.mean(((h - h.mean(0)) / h.std(0)) ** 2)
>>> w, x = jnp.ones((3, 2)), jnp.ones((8, 3))
>>> why_not_separable(jax.make_jaxpr(mse)(w, x), [False, True], 8) is None
True
>>> why_not_separable(jax.make_jaxpr(batch_norm)(w, x), [False, True], 8)
'a value reduced over the batch is combined with each example (statistics of the batch, as a batch norm computes)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.rules import rule


@dataclass(frozen=True)
class Mark:
    kind: str                     # "N", "B", "R" or "X"
    axis: int = 0                 # B: the examples' axis
    divisors: tuple[float | None, ...] = (1.0,)  # R: what each sum added into it has been divided
                                  # by so far (None: a value unknown here)
    why: str = ""                 # X: in words


N = Mark("N")


def _b(axis: int) -> Mark:
    return Mark("B", axis=axis)


def _x(why: str) -> Mark:
    return Mark("X", why=why)


MIXED = "a value reduced over the batch is combined with each example (statistics of the batch, as a batch norm computes)"


def _first_x(marks: Sequence[Mark]) -> Mark | None:
    return next((m for m in marks if m.kind == "X"), None)


def _elementwise(name: str, marks: list[Mark], eqn: Any) -> Mark:
    """An elementwise primitive: examples stay apart; a batch sum stays one only through what is
    linear in it (added to another, scaled or divided by what does not depend on the batch)."""
    bad = _first_x(marks)
    if bad is not None:
        return bad
    axes = {m.axis for m in marks if m.kind == "B"}
    sums = [m for m in marks if m.kind == "R"]
    if len(axes) > 1:
        return _x("examples along two different axes are combined")
    if axes and sums:
        return _x(MIXED)
    if axes:
        return _b(axes.pop())
    if not sums:
        return N
    return _linear(name, marks, eqn)


def _linear(name: str, marks: list[Mark], eqn: Any) -> Mark:
    """A batch sum through an elementwise op: kept where the op is linear in it."""
    kind = rule(name).examples
    if kind == "sum":
        # a constant added keeps a mean one (mean of loss_i + c is the mean + c); two means added
        # (a loss and an auxiliary loss) are one where each is
        return Mark("R", divisors=tuple(d for m in marks if m.kind == "R" for d in m.divisors))
    # the sum times (or over) a value without the batch; mul either way round
    at = 0 if marks[0].kind == "R" else 1 if name == "mul" else None
    if kind == "scale" and at is not None and marks[1 - at].kind == "N":
        factor = _constant(eqn.invars[1 - at])
        if factor is None:
            return marks[at]          # scaled by a value of its own: still linear in the sum
        if factor == 0:
            return Mark("R", divisors=(None,))
        scale = (lambda d: d * factor) if name == "div" else (lambda d: d / factor)
        return Mark("R", divisors=tuple(None if d is None else scale(d) for d in marks[at].divisors))
    if name == "div" and marks[1].kind == "R":
        return _x("divides by a sum over the batch (as sum(loss * mask) / sum(mask)): each micro-batch "
                  "would weigh its examples differently")
    return _x(f"takes {name} of a sum over the batch: not the mean of the micro-batches'")


def _constant(atom: Any) -> float | None:
    if ja.is_literal(atom):
        try:
            return float(ja.literal_value(atom))
        except (TypeError, ValueError):
            return None
    return None


def _reduce(name: str, mark: Mark, eqn: Any) -> Mark:
    axes = tuple(int(a) for a in ja.eqn_params(eqn).get("axes", ()))
    if mark.kind in ("N", "X"):
        return mark
    if mark.kind == "R":
        return mark if name == "reduce_sum" else _x(f"takes {name} of a sum over the batch")
    if mark.axis not in axes:
        return _b(mark.axis - sum(1 for a in axes if a < mark.axis))
    if name == "reduce_sum":
        return Mark("R")
    return _x(f"takes {name} over the batch")


def _along(name: str, mark: Mark, axis: int) -> Mark:
    """An op along one axis (a cumulative sum, a sort, a concatenation): fine off the batch axis."""
    if mark.kind != "B":
        return mark if mark.kind in ("N", "X") else _x(f"{name} of a sum over the batch")
    return _x(f"{name} along the batch axis") if axis == mark.axis else mark


def _full(size: int, start: int, limit: int, stride: int | None) -> bool:
    return start == 0 and limit == size and (stride in (None, 1))


def _dot(eqn: Any, lhs: Mark, rhs: Mark) -> Mark:
    (lc, rc), (lb, rb) = ja.eqn_params(eqn)["dimension_numbers"]
    lc, rc, lb, rb = list(lc), list(rc), list(lb), list(rb)
    shapes = ja.eqn_in_shapes(eqn)
    lfree = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
    rfree = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
    bad = _first_x([lhs, rhs])
    if bad is not None:
        return bad
    if "R" in (lhs.kind, rhs.kind):
        other = rhs if lhs.kind == "R" else lhs
        return (lhs if lhs.kind == "R" else rhs) if other.kind == "N" else _x(MIXED)

    def place(axis: int, batch: list[int], contract: list[int], free: list[int], offset: int) -> tuple[str, int]:
        if axis in batch:
            return "batch", batch.index(axis)
        if axis in contract:
            return "contract", contract.index(axis)
        return "free", offset + free.index(axis)

    if lhs.kind == "B" and rhs.kind == "N":
        where, at = place(lhs.axis, lb, lc, lfree, len(lb))
        return Mark("R") if where == "contract" else _b(at)
    if rhs.kind == "B" and lhs.kind == "N":
        where, at = place(rhs.axis, rb, rc, rfree, len(lb) + len(lfree))
        return Mark("R") if where == "contract" else _b(at)
    if lhs.kind == "B" and rhs.kind == "B":
        left = place(lhs.axis, lb, lc, lfree, len(lb))
        right = place(rhs.axis, rb, rc, rfree, len(lb) + len(lfree))
        if left == right and left[0] == "batch":
            return _b(left[1])
        if left[0] == right[0] == "contract" and left[1] == right[1]:
            return Mark("R")
        return _x("pairs each example with the others (as x @ x.T, in-batch negatives)")
    return N


def _gather(eqn: Any, operand: Mark, indices: Mark) -> Mark:
    bad = _first_x([operand, indices])
    if bad is not None:
        return bad
    if "R" in (operand.kind, indices.kind):
        return _x("gathers with a sum over the batch")
    dn = ja.eqn_params(eqn)["dimension_numbers"]
    out_rank = len(ja.eqn_out_avals(eqn)[0].shape)
    index_rank = len(ja.eqn_in_shapes(eqn)[1])
    batch_out = [d for d in range(out_rank) if d not in tuple(dn.offset_dims)]
    if operand.kind == "N" and indices.kind == "B":
        # a lookup (an embedding): each example's indices pick its own rows
        return _b(batch_out[indices.axis]) if indices.axis < index_rank - 1 and indices.axis < len(batch_out) \
            else _x("gathers along the batch's index vector")
    if operand.kind == "B" and indices.kind == "N":
        sizes, shape = tuple(ja.eqn_params(eqn)["slice_sizes"]), ja.eqn_in_shapes(eqn)[0]
        kept = [d for d in range(len(shape)) if d not in tuple(dn.collapsed_slice_dims)
                and d not in tuple(dn.operand_batching_dims)]
        if operand.axis not in tuple(dn.start_index_map) and operand.axis in kept \
                and sizes[operand.axis] == shape[operand.axis]:
            return _b(tuple(dn.offset_dims)[kept.index(operand.axis)])
        return _x("picks some of the batch's rows")
    if operand.kind == indices.kind == "B":
        ob, ib = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
        if operand.axis in ob and indices.axis in ib and ob.index(operand.axis) == ib.index(indices.axis):
            return _b(batch_out[indices.axis]) if indices.axis < len(batch_out) else _x("gathers across examples")
        return _x("gathers across examples")
    return N


def _reshape(mark: Mark, shape_in: tuple[int, ...], shape_out: tuple[int, ...], batch: int) -> Mark:
    if mark.kind != "B":
        return mark
    a = mark.axis
    if tuple(shape_in[:a + 1]) == tuple(shape_out[:a + 1]):
        return mark
    if a == 0 and shape_out and shape_in[0] % batch == 0 and shape_out[0] % batch == 0 and shape_out[0] > 0:
        return _b(0)   # leading dims merged with the examples' (B, S) -> (B*S), or split back
    return _x("reshapes the batch axis into others")


class _Reader:
    """The forward reading of one jaxpr, recursing into calls and loops."""

    def __init__(self, batch: int):
        self.batch = batch

    def run(self, jaxpr: Any, marks: Sequence[Mark]) -> list[Mark]:
        env: dict[Any, Mark] = dict(zip(jaxpr.invars, marks))
        get = lambda a: N if ja.is_literal(a) else env.get(a, N)  # noqa: E731
        for eqn in ja.jaxpr_eqns(jaxpr):
            outs = self.eqn(eqn, [get(a) for a in eqn.invars])
            for var, mark in zip(eqn.outvars, outs):
                env[var] = mark
        return [get(a) for a in ja.jaxpr_outvars(jaxpr)]

    def eqn(self, eqn: Any, marks: list[Mark]) -> list[Mark]:
        name, n_out = ja.eqn_name(eqn), len(eqn.outvars)
        if all(m.kind == "N" for m in marks):
            return [N] * n_out
        body = ja.call_body(eqn)
        if body is not None:
            return self.run(body[0], marks)
        kind = rule(name).examples
        handler = _along_param if kind.startswith("along:") else _HANDLERS.get(kind)
        if handler is not None:
            return handler(self, eqn, marks)
        if rule(name).cost == "elementwise" or kind in ("sum", "scale"):
            return [_elementwise(name, marks, eqn)] * n_out
        bad = _first_x(marks)
        return [bad or _x(f"{name} is not known to keep examples apart")] * n_out

    def loop(self, body: Any, consts: list[Mark], carry: list[Mark], xs: list[Mark]) -> tuple[list[Mark], list[Mark]]:
        """A scan body run to a fixed point of its carry's marks: (carry out, per-iteration outputs)."""
        jaxpr = ja.split_closed(body)[0]
        for _ in range(4):
            outs = self.run(jaxpr, consts + carry + xs)
            new = [_join(a, b) for a, b in zip(carry, outs[:len(carry)])]
            if new == carry:
                return new, outs[len(carry):]
            carry = new
        return [_x("a loop whose carry keeps changing how it holds the batch")] * len(carry), outs[len(carry):]


def _join(a: Mark, b: Mark) -> Mark:
    if a == b or b.kind == "N":
        return a
    if a.kind == "N":
        return b
    return a if a.kind == "X" else b if b.kind == "X" else _x("a loop carries the batch two ways")


def _scan(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    n_consts, n_carry = ja.scan_counts(eqn)
    xs = marks[n_consts + n_carry:]
    if any(m.kind == "B" and m.axis == 0 for m in xs):
        return [_x("a scan over the batch axis")] * len(eqn.outvars)
    inner = [_b(m.axis - 1) if m.kind == "B" else m for m in xs]
    carry, ys = reader.loop(ja.eqn_params(eqn)["jaxpr"], marks[:n_consts], marks[n_consts:n_consts + n_carry], inner)
    return carry + [_b(m.axis + 1) if m.kind == "B" else m for m in ys]


def _while(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    cond_n, body_n = ja.while_counts(eqn)
    params = ja.eqn_params(eqn)
    carry, _ = reader.loop(params["body_jaxpr"], marks[cond_n:cond_n + body_n], marks[cond_n + body_n:], [])
    stop = reader.run(ja.split_closed(params["cond_jaxpr"])[0], marks[:cond_n] + carry)
    if any(m.kind != "N" for m in stop):
        return [_x("a loop whose stopping depends on the batch")] * len(eqn.outvars)
    return carry


def _cond(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    if marks[0].kind != "N":
        return [_x("a branch chosen by the batch")] * len(eqn.outvars)
    outs: list[Mark] | None = None
    for branch in ja.eqn_params(eqn)["branches"]:
        got = reader.run(ja.split_closed(branch)[0], marks[1:])
        outs = got if outs is None else [_join(a, b) for a, b in zip(outs, got)]
    return outs or []


def _axis_param(eqn: Any, *keys: str) -> int:
    params = ja.eqn_params(eqn)
    for key in keys:
        if key in params:
            value = params[key]
            return int(value[0] if isinstance(value, (tuple, list)) else value)
    return -1


def _same(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    """Ops that pass each operand through (barriers, sharding annotations, names)."""
    return [marks[i] if i < len(marks) else N for i in range(len(eqn.outvars))]


def _broadcast(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    m = marks[0]
    if m.kind == "B":
        return [_b(int(ja.eqn_params(eqn)["broadcast_dimensions"][m.axis]))]
    return [m]


def _transpose(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    m = marks[0]
    return [_b(list(ja.eqn_params(eqn)["permutation"]).index(m.axis)) if m.kind == "B" else m]


def _reshape_eqn(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    return [_reshape(marks[0], ja.eqn_in_shapes(eqn)[0], tuple(ja.eqn_out_avals(eqn)[0].shape), reader.batch)]


def _squeeze(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    m, dims = marks[0], tuple(ja.eqn_params(eqn)["dimensions"])
    if m.kind != "B":
        return [m]
    return [_x("squeezes the batch axis")] if m.axis in dims else [_b(m.axis - sum(1 for d in dims if d < m.axis))]


def _slice(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    m, params, shape = marks[0], ja.eqn_params(eqn), ja.eqn_in_shapes(eqn)[0]
    if m.kind != "B":
        return [m]
    a = m.axis
    if ja.eqn_name(eqn) == "slice":
        strides = params.get("strides") or [None] * len(shape)
        keep = _full(shape[a], int(params["start_indices"][a]), int(params["limit_indices"][a]), strides[a])
    else:
        keep = int(params["slice_sizes"][a]) == shape[a]
    return [m if keep else _x("picks some of the batch's rows")]


def _pad(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    m = marks[0]
    if m.kind == "B" and tuple(ja.eqn_params(eqn)["padding_config"][m.axis]) != (0, 0, 0):
        return [_x("pads the batch axis")]
    return [_elementwise("pad", marks, eqn)]


def _along_param(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    """An op along the axis its parameter names (`along:<param>`): fine off the batch axis."""
    axis = _axis_param(eqn, rule(ja.eqn_name(eqn)).examples.split(":", 1)[1])
    joined = _elementwise(ja.eqn_name(eqn), marks, eqn)
    return [_along(ja.eqn_name(eqn), joined, axis)] * len(eqn.outvars)


def _stack(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    """`stack` / `expand_dims`: a new axis at `axis` (or `dimensions`), the examples' moved past it."""
    joined = _elementwise(ja.eqn_name(eqn), marks, eqn)
    if joined.kind != "B":
        return [joined]
    params = ja.eqn_params(eqn)
    new = sorted(int(d) for d in (params["dimensions"] if "dimensions" in params else (params["axis"],)))
    axis = joined.axis
    for d in new:
        if d <= axis:
            axis += 1
    return [_b(axis)]


def _top_k(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    """`top_k` along the last axis: each example's own where the examples are on another."""
    m, rank = marks[0], len(ja.eqn_in_shapes(eqn)[0])
    return [_along("top_k", m, rank - 1)] * len(eqn.outvars)


def _reduction(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    return [_reduce(ja.eqn_name(eqn), marks[0], eqn)] * len(eqn.outvars)


def _conv(reader: _Reader, eqn: Any, marks: list[Mark]) -> list[Mark]:
    lhs, rhs = marks[0], marks[1]
    params = ja.eqn_params(eqn)
    dn = params["dimension_numbers"]
    if lhs.kind == "B" and rhs.kind == "N" and int(params.get("batch_group_count", 1)) == 1 \
            and lhs.axis == dn.lhs_spec[0]:
        return [_b(dn.out_spec[0])]
    return [_first_x(marks) or _x("a convolution across examples")]


# By `rules.rule(name).examples`: the one primitive table says which kind each primitive is.
_HANDLERS: dict[str, Callable[[_Reader, Any, list[Mark]], list[Mark]]] = {
    "scan_loop": _scan, "while_loop": _while, "branches": _cond, "pass": _same,
    "broadcast": _broadcast, "permute": _transpose, "regroup": _reshape_eqn, "drop_axis": _squeeze,
    "window": _slice, "padded": _pad, "new_axis": _stack, "last_axis": _top_k, "reduction": _reduction,
    "dot": lambda r, e, m: [_dot(e, m[0], m[1])],
    "lookup": lambda r, e, m: [_gather(e, m[0], m[1])],
    "conv": _conv,
}


def why_not_separable(closed_jaxpr: Any, batch_inputs: Sequence[bool], batch: int) -> str | None:
    """None where the jaxpr's first output (the loss) is the mean over the batch of what each
    example gives alone, computed from the inputs flagged in `batch_inputs` (each with its
    examples along axis 0, `batch` of them); else why not, in words."""
    jaxpr = ja.split_closed(closed_jaxpr)[0]
    marks = [_b(0) if flag else N for flag in batch_inputs]
    loss = _Reader(batch).run(jaxpr, marks)[0]
    if loss.kind == "X":
        return loss.why
    if loss.kind == "N":
        return "the loss does not depend on the batch"
    if loss.kind == "B":
        return "the loss is not reduced over the batch"
    for d in loss.divisors:
        if d is None:
            return "the loss divides by a value read only when it runs: not known to be a mean over the batch"
        ratio = d / batch
        if ratio < 1 - 1e-9 or abs(ratio - round(ratio)) > 1e-6:
            return (f"the loss sums over its batch (divided by {d:g}, not a multiple of the batch of {batch}): "
                    "the mean of the micro-batches' would be a fraction of it")
    return None


__all__ = ["why_not_separable"]
