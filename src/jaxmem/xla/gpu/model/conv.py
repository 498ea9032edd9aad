"""Buffers XLA:GPU stores around a convolution that the jaxpr does not show.

XLA:GPU runs each convolution as a cuDNN custom call, whose operands are plain buffers in the
layout cuDNN wants: nothing is fused into them. The passes that get a jaxpr convolution there:

- `conv_operand_swapper.cc` (SwapConvolutionOperandsIfBeneficial): a convolution whose kernel
  is larger than its input (a transposed convolution's weight gradient) has its operands
  swapped, the window reversed and the dilations exchanged;
- `conv_rewriter.cc` (MatchBackwardInput, MatchBackwardFilter, CanImplementAsGpuForwardConv):
  the convolution becomes a forward, backward-input or backward-filter cuDNN call, which fixes
  which tensor plays cuDNN's input, filter and output;
- `conv_padding_legalization.cc` (MaybePaddedAndSlicedInput, CanonicalizeBackwardFilterConvolution,
  CanonicalizeBackwardInputConvolution): cuDNN takes symmetric padding and no base (lhs)
  dilation, so a forward call's input is padded (and interior-padded) by an explicit `pad`, a
  backward-filter call's activations are padded by the asymmetric part, and a backward-input
  call writes a larger result that a slice trims;
- `layout_assignment.cc` (HeuristicLayoutAssignment, AddBackendConstraintsToDnnConvCustomCall):
  cuDNN reads NHWC on Hopper (2-D, not f64) and for 16-bit types from Volta on, NCHW otherwise;
  a tensor whose layout differs from the one it has is copied (a transpose fusion).

`conv_operand_scratch` sizes those buffers per convolution, as a temporary live while the call
runs: each is made right before its call and read by it alone. A value several calls read
through the same transpose has one copy (CSE), held from the first of them to the last
(`shared_copy_spans`, a span of the heap). A copy no multi-output fusion takes is a kernel of
its own, which XLA's list scheduler may run long before its call (`early_copies`).

Then `cudnn_fused_conv_rewriter.cc` adds a bias and a side input inside a forward call
(`conv_side_inputs`, a fusion rule): the convolution's own result is never stored, the call
writes the sum to a buffer of its own (`conv_calls`), and its side input is stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from jaxmem.compiler.fusion import expanded_inputs
from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import GPU_ELEMENTWISE, GPU_HLO_REDUCE, rule
from jaxmem.compiler.stages import align
from jaxmem.xla.gpu.model.performance import device_numbers
from jaxmem.xla.gpu.model.fusion_cost import capped_reductions
from jaxmem.xla.gpu.model.ops import elements

HOPPER_SM = 90       # layout_assignment.cc: NHWC for every 2-D convolution from Hopper on
VOLTA_SM = 70        # ...and for 16-bit ones from Volta on


@dataclass(frozen=True)
class Window:
    size: int
    stride: int
    lo: int
    hi: int
    base: int          # lhs (base) dilation
    dilation: int      # rhs (window) dilation
    reversal: bool = False


@dataclass(frozen=True)
class Conv:
    """A convolution as HLO states it: operand and result shapes, their dimension numbers
    (batch, feature, spatial... for data; output feature, input feature, spatial... for the
    kernel) and the window; `lhs`, `rhs`, `out` are value ids (None: not a value)."""

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    lhs_spec: tuple[int, ...]
    rhs_spec: tuple[int, ...]
    out_spec: tuple[int, ...]
    window: tuple[Window, ...]
    groups: int
    rhs_reversed: bool
    lhs: Any
    rhs: Any
    out: Any


def conv_of(g: Program, op: Any) -> Conv | None:
    """The jaxpr convolution `op` as a `Conv` (None where it is not a plain convolution)."""
    p = op.params
    dn = p.get("dimension_numbers")
    if dn is None or len(op.operands) < 2 or not all(isinstance(u, int) for u in op.operands[:2]):
        return None
    lhs, rhs = op.operands[:2]
    lspec, rspec, ospec = (tuple(int(d) for d in s) for s in (dn.lhs_spec, dn.rhs_spec, dn.out_spec))
    n = len(lspec) - 2
    strides = tuple(p.get("window_strides") or (1,) * n)
    lhs_d = tuple(p.get("lhs_dilation") or (1,) * n)
    rhs_d = tuple(p.get("rhs_dilation") or (1,) * n)
    pads = tuple(p.get("padding") or ((0, 0),) * n)
    if any(not isinstance(q, (tuple, list)) for q in pads):
        return None
    window = tuple(Window(g.shapes[rhs][rspec[2 + i]], int(strides[i]), int(pads[i][0]), int(pads[i][1]),
                          int(lhs_d[i]), int(rhs_d[i])) for i in range(n))
    prod = g.producer[rhs]
    reversed_ = False
    if isinstance(prod, int) and prod >= 0 and g.ops[prod].primitive == "rev":
        dims = set(g.ops[prod].params.get("dimensions", ()))
        # algebraic_simplifier.cc, HandleReverse: a reverse of size-1 dimensions only (a 1x1
        # kernel's) is removed, so conv_rewriter.cc sees a plain (forward) convolution
        reversed_ = dims == set(rspec[2:]) and any(g.shapes[rhs][d] != 1 for d in dims)
    groups = max(int(p.get("feature_group_count", 1)), int(p.get("batch_group_count", 1)))
    return Conv(g.shapes[lhs], g.shapes[rhs], g.shapes[op.outputs[0]] if op.outputs[0] is not None else (),
                lspec, rspec, ospec, window, groups, reversed_, lhs, rhs, op.outputs[0])


def swapped(c: Conv) -> Conv:
    """conv_operand_swapper.cc, SwapConvolutionOperandsIfBeneficial: the operands swapped when
    the kernel's spatial product exceeds the input's (over the dimensions that are neither a
    pure contraction nor a group dimension); `c` unchanged otherwise."""
    if c.groups > 1:
        return c
    kernel_product = swapped_product = 1
    new: list[Window] = []
    for i, w in enumerate(c.window):
        plain = not w.reversal and w.lo == 0 and w.hi == 0 and w.dilation == 1
        in_size = c.lhs_shape[c.lhs_spec[2 + i]]
        if (plain and w.base == w.size and w.stride == w.size - 1) or \
                (plain and w.size == in_size and w.base == 1 and w.stride == 1):
            new.append(w)
            continue
        dilated_kernel = 1 + (w.size - 1) * w.dilation
        dilated_input = 1 + (in_size - 1) * w.base
        kernel_product *= w.size
        swapped_product *= (w.size if in_size == 1 and w.stride == 1 and w.dilation == 1
                            and w.lo == w.size - 1 and w.hi == w.size - 1 else in_size)
        new.append(Window(in_size, w.stride, dilated_input + w.lo - dilated_kernel,
                          dilated_input + w.hi - dilated_kernel, w.dilation, w.base, True))
    if kernel_product <= swapped_product:
        return c
    # the kernel becomes the input (its output feature as batch), the input the kernel
    # (batch as output feature), the result's batch and feature exchanged
    return replace(c, lhs_shape=c.rhs_shape, rhs_shape=c.lhs_shape, lhs=c.rhs, rhs=c.lhs,
                   lhs_spec=c.rhs_spec, rhs_spec=c.lhs_spec,
                   out_spec=(c.out_spec[1], c.out_spec[0]) + c.out_spec[2:], window=tuple(new),
                   rhs_reversed=False)


def _looks_forward(c: Conv) -> bool:
    """conv_rewriter.cc, LooksLikeForwardConvolution."""
    if c.lhs_shape[c.lhs_spec[0]] != c.out_shape[c.out_spec[0]]:
        return False
    if c.rhs_shape[c.rhs_spec[0]] != c.out_shape[c.out_spec[1]]:
        return False
    return all(c.rhs_shape[c.rhs_spec[2 + i]] <= c.out_shape[c.out_spec[2 + i]] for i in range(len(c.window)))


def backward_input_high(c: Conv) -> list[tuple[int, int]] | None:
    """conv_rewriter.cc, MatchBackwardInput: per spatial dimension the backward call's (low,
    high) padding, or None where the convolution is not a backward-input one."""
    one_by_one = all(w.size == 1 for w in c.window)
    if c.groups > 1 or not (c.rhs_reversed or (one_by_one and any(w.base > 1 for w in c.window))):
        return None
    pads = []
    for i, w in enumerate(c.window):
        if w.stride != 1 or w.dilation != 1 or w.reversal:
            return None
        low = w.size - 1 - w.lo
        if low < 0:
            return None
        stride = w.base
        padded = w.size + stride * (c.lhs_shape[c.lhs_spec[2 + i]] - 1)
        least = padded - c.out_shape[c.out_spec[2 + i]] - low
        high = low if least <= low <= least + stride - 1 else (least if low < least else least + stride - 1)
        if high < 0:
            return None
        pads.append((low, high))
    return pads


def backward_filter_pads(c: Conv) -> list[tuple[int, int]] | None:
    """conv_rewriter.cc, MatchBackwardFilter: per spatial dimension the backward call's (low,
    high) padding of the activations, or None where it is not a backward-filter one."""
    if c.groups > 1 or _looks_forward(c):
        return None
    if any(w.stride != 1 or w.base != 1 or w.lo < 0 or w.reversal for w in c.window):
        return None
    small = sum(c.rhs_shape[c.rhs_spec[2 + i]] <= c.out_shape[c.out_spec[2 + i]] for i in range(len(c.window)))
    if (not c.window or small >= 1) and not any(w.dilation > 1 for w in c.window):
        return None
    pads = []
    for i, w in enumerate(c.window):
        filt, stride = c.out_shape[c.out_spec[2 + i]], w.dilation
        least = filt + (w.size - 1) * stride - c.lhs_shape[c.lhs_spec[2 + i]] - w.lo
        high = w.lo if least <= w.lo <= least + stride - 1 else (least if w.lo < least else least + stride - 1)
        if high < 0:
            return None
        pads.append((w.lo, high))
    return pads


def _nhwc(device: str, dtype: str, spatial: int) -> bool:
    """layout_assignment.cc, HeuristicLayoutAssignment: NHWC (True) or NCHW."""
    dev = device_numbers(device)
    sm = int(dev.sm[3:] or 0) if dev is not None and dev.sm.startswith("sm_") else HOPPER_SM
    if sm >= HOPPER_SM:
        return dtype != "float64" and spatial <= 2
    return dtype in ("float16", "bfloat16") and sm >= VOLTA_SM and spatial == 2


def _order(spec: tuple[int, ...], nhwc: bool) -> tuple[int, ...]:
    """The physical major-to-minor order of a tensor whose dimension numbers are `spec`
    (batch or output feature first, feature or input feature second, then spatial)."""
    return (spec[0],) + spec[2:] + (spec[1],) if nhwc else spec


def _same_layout(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two physical orders of `shape` lay its elements out alike (size-1 dimensions
    do not count: a transpose that only moves them is a bitcast)."""
    return [d for d in a if shape[d] != 1] == [d for d in b if shape[d] != 1]


def cudnn_roles(c: Conv) -> tuple[str, list[tuple[Any, tuple[int, ...], tuple[int, ...]]], int]:
    """(the cuDNN call's kind, [(value, its shape, its dimension numbers as cuDNN reads it)] for
    its lhs, rhs and result, the extra bytes-worth of elements its padding stores (a padded
    input, or a larger result))."""
    extra = 0
    bi = backward_input_high(c)
    if bi is not None:
        lspec, ospec = c.lhs_spec, c.out_spec
        rspec = (c.rhs_spec[1], c.rhs_spec[0]) + c.rhs_spec[2:]
        grown = [abs(hi - lo) for lo, hi in bi]
        if any(grown):
            shape = list(c.out_shape)
            for i, d in enumerate(grown):
                shape[ospec[2 + i]] += d
            extra = elements(shape)
        return "backward_input", [(c.lhs, c.lhs_shape, lspec), (c.rhs, c.rhs_shape, rspec),
                                  (c.out, c.out_shape, ospec)], extra
    bf = backward_filter_pads(c)
    if bf is not None:
        swap = lambda s: (s[1], s[0]) + s[2:]
        if any(lo != hi for lo, hi in bf):
            shape = list(c.lhs_shape)
            for i, (lo, hi) in enumerate(bf):
                shape[c.lhs_spec[2 + i]] += abs(hi - lo)
            extra = elements(shape)
        return "backward_filter", [(c.lhs, c.lhs_shape, swap(c.lhs_spec)), (c.rhs, c.rhs_shape, swap(c.rhs_spec)),
                                   (c.out, c.out_shape, swap(c.out_spec))], extra
    if any(w.lo != w.hi or w.base > 1 or w.lo < 0 or w.hi < 0 for w in c.window):
        shape = list(c.lhs_shape)
        for i, w in enumerate(c.window):
            d = c.lhs_spec[2 + i]
            shape[d] = max(0, (shape[d] - 1) * w.base + 1 + w.lo + w.hi)
        extra = elements(shape)
    return "forward", [(c.lhs, c.lhs_shape, c.lhs_spec), (c.rhs, c.rhs_shape, c.rhs_spec),
                       (c.out, c.out_shape, c.out_spec)], extra


def conv_layouts(g: Program, device: str) -> dict[int, tuple[int, ...]]:
    """Value -> the physical order XLA's layout assignment gives it (layout_assignment.cc;
    GpuLayoutAssignment::AddBackendConstraints adds the convolutions' constraints in program
    order, so the earliest convolution's layout propagates first): each convolution's result
    in the order cuDNN writes it, an elementwise value computed from one in its operand's
    order, and a computed value a convolution reads in the order its first such reader wants.
    Arguments, and values not here, keep row-major order."""
    layouts: dict[int, tuple[int, ...]] = {}
    for op in g.ops:
        if op.primitive == "conv_general_dilated":
            c = conv_of(g, op)
            if c is None or c.out is None:
                continue
            _, roles, _ = cudnn_roles(swapped(c))
            nhwc = _nhwc(device, str(g.dtypes[c.out]), len(c.window))
            for v, _, spec in roles[:2]:
                prod = g.producer[v]
                if v not in layouts and isinstance(prod, int) and prod >= 0:
                    layouts[v] = _order(spec, nhwc)
            layouts[c.out] = _order(roles[2][2], nhwc)
        elif op.primitive in GPU_ELEMENTWISE and op.outputs and op.outputs[0] is not None:
            v = op.outputs[0]
            for u in op.inputs:
                if u in layouts and g.shapes[u] == g.shapes[v]:
                    layouts[v] = layouts[u]
                    break
    return layouts


def conv_copies(g: Program, op: Any, device: str, layouts: dict[int, tuple[int, ...]],
                result: int | None = None) -> list[tuple[Any, int, Any]]:
    """[(value, bytes, what)] XLA:GPU stores for convolution `op` besides its operands and
    result (see the module's text): its padded input (the input's value; None for a larger
    result; `what` the padded bytes), a copy of each operand whose layout (`layouts`, from
    `conv_layouts`) differs from the one cuDNN reads (`what` the order), and the result as cuDNN
    writes it where it is a program output in another order (its readers otherwise read it
    through the transpose, fused into them); `result`: the value the call writes where adds
    are fused into it (`conv_calls`), the convolution's own result otherwise. A weight's copy in the filter layout is small
    beside the activations: counted only where the filter is an activation (the operands
    swapped). Empty for any other op."""
    if op.primitive != "conv_general_dilated":
        return []
    c = conv_of(g, op)
    if c is None or c.out is None:
        return []
    s = swapped(c)
    kind, roles, padded = cudnn_roles(s)
    filter_role = 2 if kind == "backward_filter" else 1
    item = g.nbytes[c.out] // max(1, elements(c.out_shape))
    nhwc = _nhwc(device, str(g.dtypes[c.out]), len(c.window))
    copies: list[tuple[Any, int, Any]] = []
    if padded:
        copies.append((s.lhs if kind != "backward_input" else None, align(padded * item), ("pad", padded)))
    outputs = {u for u in g.outvars if isinstance(u, int)}
    if result is not None:   # the call writes its fused adds' sum (`conv_side_inputs`)
        roles[2] = (result, g.shapes[result], roles[2][2])
    for k, (v, shape, spec) in enumerate(roles):
        if (k == 0 and padded and kind != "backward_input") or (k == filter_role and s is c):
            continue   # the pad writes the input in cuDNN's layout
        row_major = tuple(range(len(shape)))
        if k < 2:
            copied = not _same_layout(shape, _order(spec, nhwc), layouts.get(v, row_major))
        else:
            copied = not _same_layout(shape, _order(spec, nhwc), row_major) and v in outputs
        if copied:
            copies.append((v if k < 2 else None, align(g.nbytes[v]), ("copy", _order(spec, nhwc))))
    return copies


@dataclass
class ConvPlan:
    """What the convolutions of a program store: per convolution op, its `conv_copies`; the
    values every reader of which is a convolution storing its own copy (`materialized`); and
    the values whose readers all pad them alike (`shared_pads`): XLA's CSE keeps one padded
    copy, which takes the value's place for as long as it lives."""

    copies: dict[int, list[tuple[Any, int, Any]]]
    materialized: set[int]
    shared_pads: set[int]
    # value -> its one transposed copy's bytes and the convolutions reading it (`conv_plan`)
    shared_copies: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


def conv_plan(g: Program, device: str, calls: dict[int, int] | None = None) -> ConvPlan:
    """The `ConvPlan` of `g` on `device`; `calls`: `conv_calls`, where adds are fused."""
    layouts = conv_layouts(g, device)
    calls = calls or {}
    copies = {op.index: conv_copies(g, op, device, layouts, g.ops[calls[op.index]].outputs[0] if op.index in calls else None)
              for op in g.ops if op.primitive == "conv_general_dilated"}
    by_value: dict[int, list[tuple[int, Any]]] = {}
    for index, items in copies.items():
        for v, _, what in items:
            if v is not None:
                by_value.setdefault(v, []).append((index, what))
    materialized, shared = set(), set()
    for v, items in by_value.items():
        if set(g.users[v]) <= {index for index, _ in items}:
            kinds = {what for _, what in items}
            if len(items) > 1 and len(kinds) == 1 and next(iter(kinds))[0] == "pad":
                shared.add(v)
            else:
                materialized.add(v)
    return ConvPlan(copies, materialized, shared, _shared_copies(copies, by_value))


def _shared_copies(copies: dict[int, list[tuple[Any, int, Any]]],
                   by_value: dict[int, list[tuple[int, Any]]]) -> dict[int, tuple[int, list[int]]]:
    """Values that several convolutions read through a copy in one layout: layout assignment
    gives each the same transpose, which CSE (hlo_cse.cc) makes one instruction. So XLA holds
    one transposed copy, from the first call that reads it to the last (the A100 dump of
    `tests/gpu/fusion_programs.py:conv_batchnorm_grad`: `wrapped_transpose.1`, the input's NCHW
    copy, read by the forward call and by the backward-filter call, live from one to the
    other and at XLA's peak)."""
    shared = {}
    for v, items in by_value.items():
        orders = {what for _, what in items}
        calls = sorted({index for index, _ in items})
        if len(calls) > 1 and len(orders) == 1 and next(iter(orders))[0] == "copy":
            size = next(n for u, n, what in copies[calls[0]] if u == v and what[0] == "copy")
            shared[v] = (size, calls)
    return shared


def conv_operand_scratch(g: Program, op: Any, plan: ConvPlan) -> int:
    """The bytes of `op`'s copies (`conv_plan`), a temporary live while the call runs; a shared
    pad counts only what it adds to the value it stands for; a shared copy is none of the
    call's own (`shared_copy_spans` holds it)."""
    return sum(size - (align(g.nbytes[v]) if v in plan.shared_pads else 0)
               for v, size, what in plan.copies.get(op.index, ())
               if not (what[0] == "copy" and v in plan.shared_copies))


def shared_copy_spans(g: Program, order: list[int], device: str,
                      calls: dict[int, int] | None = None) -> list[tuple[int, int, int]]:
    """(start, end, bytes) over positions of `order`: each shared copy (`conv_plan`) live from
    the first call that reads it to the last; `calls`: `conv_calls`, where a convolution whose
    adds are fused into its call runs (the sum's op, not the convolution's)."""
    calls = calls or {}
    pos = {oi: p for p, oi in enumerate(order)}
    spans = []
    for size, readers in conv_plan(g, device, calls).shared_copies.values():
        at = [pos[calls.get(c, c)] for c in readers if calls.get(c, c) in pos]
        if at:
            spans.append((min(at), max(at), size))
    return spans


def _loop_sibling(g: Program, fused: Any, reads: Any, sources: list[int], n: int, skip: set[int],
                  reduced: dict[int, list[int]], slow: dict[int, int]) -> bool:
    """Whether an op other than `skip` reads one of `sources` and stores a value of `n` elements
    that XLA makes in a loop fusion: no reduction reads it, or only a slow column reduction,
    which then reads it stored (`read_by_slow_reduction`)."""
    for oi, op in enumerate(g.ops):
        if oi in skip or op.primitive in GPU_HLO_REDUCE or not set(sources) & set(reads[oi]):
            continue
        for o in op.outputs:
            if o is None or fused[o] or elements(g.shapes[o]) != n:
                continue
            if not reduced.get(o) or any(r in slow for r in reduced[o]):
                return True
    return False


def early_copies(g: Program, calls: dict[int, int], fused: Any, reads: Any,
                 device: str) -> list[tuple[int, int, list[int]]]:
    """[(op the cuDNN call runs at, copy bytes, stored values the copy is computed from)] for each
    layout copy (`conv_plan`, one call's own) that is a kernel of its own.

    Layout assignment gives a cuDNN operand in another layout a transpose, and priority fusion
    makes it a loop fusion with its elementwise producers (a U-Net's SiLU output, transposed
    for a transposed convolution's weight gradient: unet's A100 dump, `loop_transpose_fusion`).
    Multi-output fusion (multi_output_fusion.cc, sibling fusion) joins it to a loop fusion that
    reads the same values over the same elements, so the copy is made in the backward beside
    that kernel (the H100 dump: `loop_add_transpose_fusion`; four small A100 decoders in
    BENCHMARKS.md). Where the values' other readers are reduction fusions (a group norm's
    gradient sums, with its elementwise gradient as an extra output) or cuDNN calls, no
    sibling takes it: it is a kernel that defines its bytes and frees nothing, which the list
    scheduler runs once every other ready kernel defines more (`heap.early_copy_spans`):
    in unet's A100 order it is made in the forward pass and held to the backward call.
    `calls`: `conv_calls`, where a convolution whose adds are fused into its call runs."""
    plan = conv_plan(g, device, calls)
    dev = device_numbers(device)
    slow = capped_reductions(g, conv_layouts(g, device), dev) if dev else {}
    reduced: dict[int, list[int]] = {}
    for op in g.ops:
        if op.primitive in GPU_HLO_REDUCE:
            for u in reads[op.index]:
                reduced.setdefault(u, []).append(op.index)
    out, memo = [], {}
    for oi, items in plan.copies.items():
        call = calls.get(oi, oi)
        for v, size, what in items:
            if v is None or what[0] != "copy" or v in plan.shared_copies:
                continue
            sources = expanded_inputs(g, fused, memo, v) if fused[v] else [v]
            if not _loop_sibling(g, fused, reads, sources, elements(g.shapes[v]), {oi, call}, reduced, slow):
                out.append((call, size, sources))
    return out


def conv_operands_materialized(ctx: Any, fused: list[bool]) -> dict[int, bool]:
    """A convolution operand computed by an elementwise op, whose every reader is a
    convolution that stores its own copy of it (padded by conv_padding_legalization.cc's
    MaybePaddedAndSlicedInput, or transposed by layout assignment for cuDNN), is never stored
    itself: the pad or transpose fusion computes it from its operands (priority_fusion.cc fuses
    the elementwise producer into that fusion). Where every reader pads it alike (a strided
    convolution's forward and backward-filter calls), the pads are one (CSE) and that padded
    value is stored in its place (`conv_operand_scratch` adds the growth). Only with a device
    (the prediction)."""
    g = ctx.g
    if not ctx.device:
        return {}
    changes: dict[int, bool] = {}
    for v in conv_plan(g, ctx.device).materialized:
        prod = g.producer[v]
        if fused[v] or ctx.roles.outputs[v] or ctx.roles.external[v] or not isinstance(prod, int) or prod < 0:
            continue
        if g.ops[prod].primitive in GPU_ELEMENTWISE:
            changes[v] = True
    return changes


def _feature_bias(g: Program, u: Any, feature: int) -> bool:
    """cudnn_fused_conv_rewriter.cc, FuseBiasOrSideInput: an addend cuDNN takes as its bias, a
    broadcast of a scalar or of a vector along the output feature dimension (`feature`): a
    literal, a value whose only non-unit dimension is `feature`, or a broadcast of one."""
    if not isinstance(u, int):
        return True
    shape = g.shapes[u]
    if all(n == 1 for d, n in enumerate(shape) if d != feature):
        return True
    prod = g.producer[u]
    if not isinstance(prod, int) or prod < 0 or g.ops[prod].primitive != "broadcast_in_dim":
        return False
    op = g.ops[prod]
    src = g.shapes[op.inputs[0]] if op.inputs else ()
    dims = tuple(op.params.get("broadcast_dimensions", ()))
    return len(dims) == len(src) and all(n == 1 or dims[i] == feature for i, n in enumerate(src))


def _epilogue(g: Program, v: int, feature: int, kept: Callable[[int], bool]) -> tuple[list[int], Any]:
    """(the forward convolution's result `v` and the sums of the adds fused into its call,
    the last the result the call writes; the side input or None): see `conv_side_inputs`.
    `kept(v)`: a program output (or a loop body's), which the chain stops at."""
    chain, side, bias = [v], None, False
    while len(chain) <= 2 and len(g.users[v]) == 1 and not kept(v):
        user = g.ops[g.users[v][0]]
        w = user.outputs[0] if len(user.outputs) == 1 else None
        if rule(user.primitive).gpu_hlo_ops != ("add",) or w is None or user.operands.count(v) != 1 \
                or len(user.operands) != 2 or g.shapes[w] != g.shapes[v]:
            break
        addend = user.operands[1 - user.operands.index(v)]
        if not bias and _feature_bias(g, addend, feature):
            bias = True
        elif side is None and isinstance(addend, int):
            side = addend
        else:
            break
        chain.append(w)
        v = w
    return chain, side


def conv_side_inputs(ctx: Any, fused: list[bool]) -> dict[int, bool]:
    """XLA:GPU adds a bias and a side input inside a forward cuDNN convolution
    (cudnn_fused_conv_rewriter.cc, FuseBiasOrSideInput, run twice per pass): `add(conv, z)`,
    the convolution a forward one (conv_rewriter.cc; not depthwise) whose result has that add
    as its one user, becomes one `__cudnn$convBiasActivationForward` call; `z` is its bias where
    it is a broadcast along the output feature dimension (or of a scalar), its side input
    otherwise (one of each). So the convolution's own result and the first sum are never
    stored: the call writes the last sum; and a side input, an operand of a custom call, is
    stored, even where the model had computed it inside the add (a residual block's
    `x + conv(h)`; the backward's `conv1x1_transpose(g) + norm_grad`). Only with a device (the
    prediction)."""
    g = ctx.g
    if not ctx.device:
        return {}
    changes: dict[int, bool] = {}
    sides: set[int] = set()
    for op in g.ops:
        if op.primitive != "conv_general_dilated" or not op.outputs or op.outputs[0] is None:
            continue
        c = conv_of(g, op)
        if c is None or fused[c.out] or c.out in sides:
            continue
        depthwise = c.groups > 1 and c.lhs_shape[c.lhs_spec[1]] == c.groups
        if depthwise or cudnn_roles(swapped(c))[0] != "forward":
            continue
        chain, side = _epilogue(g, c.out, c.out_spec[1], lambda v: ctx.roles.outputs[v] or ctx.roles.external[v])
        if len(chain) < 2 or chain[-1] in changes:
            continue   # the add is another convolution's (this one's result is its side input)
        for u in chain[:-1]:
            changes[u] = True
        changes[chain[-1]] = False
        if side is not None:
            sides.add(side)
    for side in sides:   # stored: a custom call's operand
        if fused[side] or changes.get(side):
            changes[side] = False
    return changes


def conv_calls(g: Program, roles: Any, fused: list[bool]) -> dict[int, int]:
    """Per convolution op whose result `conv_side_inputs` fused into its adds, the op making the
    sum its cuDNN call writes: where the call runs (its operands' copies are live there), and
    a custom call's result, never written into an operand's buffer (buffer assignment shares
    an operand's buffer only through the call's output_to_operand_aliasing, which the fused
    convolution does not set: the diffusion dump's side input and result are two buffers)."""
    calls: dict[int, int] = {}
    for op in g.ops:
        if op.primitive != "conv_general_dilated" or not op.outputs or op.outputs[0] is None or not fused[op.outputs[0]]:
            continue
        c = conv_of(g, op)
        if c is None:
            continue
        chain, _ = _epilogue(g, c.out, c.out_spec[1], lambda v: roles.outputs[v] or roles.external[v])
        if len(chain) > 1 and not fused[chain[-1]]:
            calls[op.index] = g.producer[chain[-1]]
    return calls


__all__ = ["Conv", "Window", "conv_calls", "backward_filter_pads", "backward_input_high", "conv_layouts", "conv_of",
           "ConvPlan", "conv_copies", "early_copies", "conv_operand_scratch", "conv_plan", "shared_copy_spans", "conv_operands_materialized", "conv_side_inputs", "cudnn_roles", "swapped"]
