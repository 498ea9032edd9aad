"""Fusion rules priced by XLA:GPU's performance model (`performance`): whether priority fusion
computes a producer inside each kernel that reads it or stores it once.

Priority fusion (xla/service/gpu/transforms/priority_fusion.cc: CalculateProducerPriority)
fuses a producer into all its consumers only where gpu_performance_model.cc
(EstimateRunTimesForPriorityFusion) finds the fused kernels faster. Three rules ask it:
`duplicated` (a transcendental chain read by several loop kernels), `reread_stored` (a
cheap value its readers read many times per element) and `slow_reduction_stored` (a
cheap value a column reduction on few blocks reads).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from jaxmem.compiler.plan_types import Const
from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import GPU_EXPENSIVE, GPU_HLO_REDUCE, GPU_NOT_DUPLICATED, MAX_FUSED_READERS, rule
from jaxmem.compiler.stages import Roles
from jaxmem.xla.gpu.model.performance import Kernel, bf16_arithmetic_native, duplicate_is_faster, flops_per_element
from jaxmem.xla.gpu.model.ops import (DOTS, ELEMENTWISE, FUSIBLE_PRODUCERS, LOOP_CONSUMERS, MOVEMENT, REDUCTIONS,
                                      absorbs, elements, kernel_space)
from jaxmem.xla.gpu.model.reduction import column_reduction_blocks

# How far the cost model follows a chain (values); past it the chain is stored.
WALK_LIMIT = 400
# The HLO of a sum (the `gpu_hlo_ops` column): what `sum_of_stored_values` prices.
SUM_HLO_OPS = (("add",), ("subtract",))


def count_reread(u: int, reads: dict[int, int], rereads: dict[Any, tuple[int, int]]) -> None:
    """One more op of a kernel reading the stored value `u`: XLA's cost analysis counts an
    operand's bytes once per use inside the fusion (GpuHloCostAnalysis's operand utilization,
    `n_bytes_total` in gpu_performance_model.cc), the uses past the first re-reads."""
    if u not in reads:
        return
    net, total = rereads.get(u, (reads[u], reads[u]))
    rereads[u] = (net, total + reads[u])


def constant_rereads(op: Any, size: int, rereads: dict[Any, tuple[int, int]]) -> None:
    """An elementwise op's constant operands: during priority fusion a constant is an operand
    of the fusion, broadcast inside it, and the cost analysis counts it read once per element
    (gpu_performance_model.cc, EstimateRunTimeForInstruction; the VLOG of
    `tests/gpu/fusion_programs.py:gelu_step_wide` on H100 lists each scalar constant of the
    gelu fusions with `n_bytes_total` the fusion's elements times 4, `n_bytes_net` 4): read
    again from cache (`Device.reread_ns`)."""
    for k, c in enumerate(op.operands):
        if not isinstance(c, Const):
            continue
        aval = c.aval
        itemsize = getattr(getattr(aval, "dtype", None), "itemsize", 4)
        net = max(1, int(getattr(aval, "size", 1) or 1)) * itemsize
        rereads[(op.index, k)] = (net, size * itemsize)


def _walk_inputs(g: Program, op: Any, inside: Callable[[int], bool], seen: set[int], todo: list[int],
                 reads: dict[int, int], rereads: dict[Any, tuple[int, int]]) -> bool:
    """One step of a kernel's walk: each input of `op` not met before is computed inside the
    kernel (`inside`: its producer joins `todo`) or read (its bytes in `reads`); one met before
    is counted as re-read. False once the walk has met more than WALK_LIMIT values."""
    for u in op.inputs:
        if u in seen:
            count_reread(u, reads, rereads)
            continue
        seen.add(u)
        if len(seen) > WALK_LIMIT:
            return False
        if inside(u):
            todo.append(g.producer[u])
        else:
            reads[u] = g.nbytes[u]
    return True


def _readers_take_in(g: Program, tainted: list[bool], op: Any, w: int) -> bool:
    """Whether every reader of `w` (the result of `op`) computes it inside itself: no GEMM reads
    it tainted, and each reader absorbs it where it reads it."""
    for c in g.users[w]:
        cop = g.ops[c]
        if cop.primitive in DOTS and tainted[w]:
            return False
        if any(u == w and not absorbs(op.primitive, cop.primitive, k) for k, u in enumerate(cop.operands)):
            return False
    return True


@dataclass
class _Chain:
    """The transcendental chain ending at `v` whose duplication `duplicated` prices."""

    g: Program
    roles: Roles
    fused: list[bool]
    tainted: list[bool]
    dev: Any
    v: int
    reread: set[int]

    @property
    def start(self) -> int:
        return self.g.producer[self.v]

    def inside(self, w: int) -> bool:
        """Computed inside its readers (for values after `v`, as the rules will decide)."""
        g, roles = self.g, self.roles
        if w == self.v or w in self.reread:
            return False
        p = g.producer[w]
        if p < 0 or roles.outputs[w] or roles.external[w]:
            return False
        if p < self.start:
            return self.fused[w]
        op = g.ops[p]
        if op.primitive not in FUSIBLE_PRODUCERS or len(op.outputs) != 1 or op.effectful or not g.users[w]:
            return False
        if len(g.users[w]) > MAX_FUSED_READERS:
            return False
        return _readers_take_in(g, self.tainted, op, w)

    def consumer_kernel(self, root: int) -> Kernel | None:
        """The kernel computing op `root`: FLOPs of its fused ops, bytes of the stored values read
        (`v` read, not computed)."""
        g, dev = self.g, self.dev
        rop = g.ops[root]
        flops: dict[int, float] = {}
        reads: dict[int, int] = {}
        rereads: dict[Any, tuple[int, int]] = {}
        seen: set[int] = set()
        todo = [root]
        while todo:
            oi = todo.pop()
            op = g.ops[oi]
            out = next((w for w in op.outputs if w is not None), None)
            size = elements(g.shapes[out]) if out is not None else 0
            if op.primitive in REDUCTIONS and op.inputs:
                size = elements(g.shapes[op.inputs[0]])
            if op.primitive in ELEMENTWISE or op.primitive in REDUCTIONS:
                flops[oi] = flops_per_element(dev, op.primitive, str(g.dtypes[out]) if out is not None else "",
                                              op.params) * size
                constant_rereads(op, size, rereads)
            if not _walk_inputs(g, op, lambda u: u != self.v and self.inside(u), seen, todo, reads, rereads):
                return None
        written = sum(g.nbytes[w] for w in rop.outputs if w is not None)
        out = next((w for w in rop.outputs if w is not None), self.v)
        # a reduction's kernel runs over its input: a value broadcast into it is read (and,
        # fused, computed) once per element of that input
        space = rop.inputs[0] if rop.primitive in REDUCTIONS and rop.inputs else out
        return Kernel(flops, elements(g.shapes[space]), reads, written, rereads)

    def producer_kernel(self) -> Kernel | None:
        """`v`'s own kernel, through the values already fused into it; None where a chain XLA
        never duplicates (`GPU_NOT_DUPLICATED`) or too long a walk is met."""
        g, dev, roles, fused = self.g, self.dev, self.roles, self.fused
        pflops: dict[int, float] = {}
        preads: dict[int, int] = {}
        prereads: dict[Any, tuple[int, int]] = {}
        seen, todo = set(), [self.start]
        while todo:
            oi = todo.pop()
            op = g.ops[oi]
            out = op.outputs[0]
            if op.primitive in GPU_NOT_DUPLICATED:
                return None
            if op.primitive in ELEMENTWISE:
                pflops[oi] = (flops_per_element(dev, op.primitive, str(g.dtypes[out]), op.params)
                              * elements(g.shapes[out]))
                constant_rereads(op, elements(g.shapes[out]), prereads)
            if not _walk_inputs(g, op, lambda u: (g.producer[u] >= 0 and fused[u]
                                                  and not (roles.outputs[u] or roles.external[u])),
                                seen, todo, preads, prereads):
                return None
        return Kernel(pflops, elements(g.shapes[self.v]), preads, g.nbytes[self.v], prereads)

    def reader_roots(self) -> list[int] | None:
        """The kernels reading `v`: the first ops, along each path of fused values, whose result
        is stored; None where an opaque reader (a loop, a call) needs `v` stored."""
        g = self.g
        roots: list[int] = []
        seen_v, todo = {self.v}, [self.v]
        while todo:
            w = todo.pop()
            for c in g.users[w]:
                cop = g.ops[c]
                out = cop.outputs[0] if len(cop.outputs) == 1 else None
                if out is not None and cop.primitive in FUSIBLE_PRODUCERS and self.inside(out):
                    if out not in seen_v:
                        seen_v.add(out)
                        if len(seen_v) > WALK_LIMIT:
                            return None
                        todo.append(out)
                elif cop.primitive in LOOP_CONSUMERS or cop.primitive.startswith("scatter"):
                    if c not in roots:
                        roots.append(c)
                else:
                    return None
        return roots


def duplicated(g: Program, roles: Roles, fused: list[bool], tainted: list[bool], dev: Any, v: int,
               reread: set[int] = frozenset()) -> bool:
    """Whether XLA:GPU computes the transcendental chain ending at `v` inside each loop kernel
    that reads it (priority fusion, `performance.duplicate_is_faster`), rather than storing it.

    The kernels reading `v` are found by following its readers through values that are
    themselves fused (cheap elementwise ops and data movement, computed in each of their
    readers); each kernel's FLOPs and bytes are those of its cone, up to stored values
    (`reread`: values `reread_stored` stores, each then a kernel of its own).
    """
    chain = _Chain(g, roles, fused, tainted, dev, v, reread)
    producer = chain.producer_kernel()
    if producer is None:
        return False
    roots = chain.reader_roots()
    if roots is None:
        return False
    if len(roots) <= 1:
        return True
    consumers = []
    for r in roots:
        k = chain.consumer_kernel(r)
        if k is None:
            return False
        consumers.append(k)
    return duplicate_is_faster(dev, producer, v, consumers)


@dataclass
class _Reread:
    """The state of `reread_stored`'s walk: the values stored so far."""

    g: Program
    roles: Roles
    fused: list[bool]
    tainted: list[bool]
    dev: Any
    stored: set[int]

    def fusible(self, w: int, reader_side: bool) -> bool:
        """Whether `w` is computed inside its readers, as far as this rule can tell."""
        g, roles = self.g, self.roles
        p = g.producer[w]
        if p < 0 or roles.outputs[w] or roles.external[w]:
            return False
        if self.fused[w]:
            return True
        op = g.ops[p]
        if (op.primitive not in FUSIBLE_PRODUCERS or len(op.outputs) != 1 or op.effectful or not g.users[w]
                or len(g.users[w]) > MAX_FUSED_READERS or w in self.stored):
            return False
        # a transcendental read twice is priced by `duplicated`; here it is taken as stored
        if op.primitive in GPU_EXPENSIVE and not (reader_side and len(g.users[w]) == 1):
            return False
        return _readers_take_in(g, self.tainted, op, w)

    def cone(self, root: int, stop: int) -> tuple[dict[int, float], dict[int, int], dict[Any, tuple[int, int]]]:
        """FLOPs of the ops computed in the kernel rooted at op `root`, bytes of the stored
        values it reads (`stop` counted as read), its re-reads (`Kernel.rereads`)."""
        g = self.g
        flops: dict[int, float] = {}
        reads: dict[int, int] = {}
        rereads: dict[Any, tuple[int, int]] = {}
        seen, todo = set(), [root]
        while todo and len(seen) <= WALK_LIMIT:
            op = g.ops[todo.pop()]
            out = next((w for w in op.outputs if w is not None), None)
            if out is not None and (op.primitive in ELEMENTWISE or op.primitive in REDUCTIONS):
                flops[op.index] = flops_per_element(self.dev, op.primitive, str(g.dtypes[out]),
                                                    op.params) * kernel_space(g, op)
                constant_rereads(op, kernel_space(g, op), rereads)
            for u in op.inputs:
                if u in seen:
                    count_reread(u, reads, rereads)
                    continue
                seen.add(u)
                if u != stop and self.fusible(u, False):
                    todo.append(g.producer[u])
                else:
                    reads[u] = g.nbytes[u]
        return flops, reads, rereads

    def reader_roots(self, v: int) -> list[int] | None:
        """The readers' kernels: the first ops, along each path of fused values, whose result is
        stored (GEMMs left out); None where a loop or a call reads it: stored whatever the cost."""
        g = self.g
        roots: list[int] = []
        seen, todo = {v}, [v]
        while todo:
            w = todo.pop()
            for c in g.users[w]:
                cop = g.ops[c]
                out = cop.outputs[0] if len(cop.outputs) == 1 else None
                if out is not None and cop.primitive in FUSIBLE_PRODUCERS and self.fusible(out, True):
                    if out not in seen:
                        seen.add(out)
                        todo.append(out)
                elif cop.primitive in DOTS:
                    continue
                elif cop.primitive in LOOP_CONSUMERS or cop.primitive.startswith("scatter"):
                    if c not in roots:
                        roots.append(c)
                else:
                    return None
            if len(seen) > WALK_LIMIT:
                return None
        return roots

    def stored_is_faster(self, op: Any, v: int, roots: list[int]) -> bool:
        """Whether the performance model finds storing `v` (made by `op`) faster than computing it
        in each of the kernels `roots`."""
        g = self.g
        pflops, preads, prereads = self.cone(op.index, -1)
        producer = Kernel(pflops, elements(g.shapes[v]), preads, g.nbytes[v], prereads)
        consumers = []
        for r in roots:
            cflops, creads, crereads = self.cone(r, v)
            written = sum(g.nbytes[w] for w in g.ops[r].outputs if w is not None)
            consumers.append(Kernel(cflops, kernel_space(g, g.ops[r]), creads, written, crereads))
        return not duplicate_is_faster(self.dev, producer, v, consumers)


def _stored_cheap_values(g: Program, roles: Roles, fused: list[bool]) -> Iterator[tuple[Any, int]]:
    """(op, value), readers first, for each cheap elementwise value stored so far that a rule
    priced by the performance model may yet keep stored: not an output or an input, read."""
    for op in reversed(g.ops):
        if (op.primitive not in ELEMENTWISE or op.primitive in GPU_EXPENSIVE or len(op.outputs) != 1
                or op.outputs[0] is None or op.effectful):
            continue
        v = op.outputs[0]
        if not (fused[v] or roles.outputs[v] or roles.external[v] or not g.users[v]):
            yield op, v


def reread_stored(g: Program, roles: Roles, fused: list[bool], tainted: list[bool], dev: Any) -> set[int]:
    """Cheap elementwise values XLA:GPU stores because a kernel reading them reads each element
    many times (a broadcast into a reduction, an outer product into a scatter's updates).

    Priority fusion prices every producer, cheap or not, with its cost model
    (`performance.duplicate_is_faster`); fused into a consumer it is computed once per element the
    consumer reads (the operand's utilization: gpu_performance_model.cc multiplies the
    producer's FLOPs by it), and it reads its own inputs that often. Fused into a kernel that
    broadcasts it 128 times, even a multiply costs more than writing and reading it once: in
    moe_train's dumps the gelu output `h`, read by the second einsum's reduction and by the
    weight gradient's scatter, is stored on both devices (`loop_multiply_fusion` on H100, the
    first output of `loop_multiply_tanh_fusion` on A100), and so are the output gradient and
    gelu's input gradient that the scatters broadcast. Where no reader re-reads the value,
    fusion wins and the other rules stand. Small programs put XLA's threshold where the cost
    model does (`tests/gpu/fusion_programs.py`: `x * 2 + 1` broadcast 2 or 8 times is fused, 16
    or more times stored, on H100 and A100).

    The producer's cone is priced with transcendentals stored (the cheapest producer: a chain
    that also recomputes a tanh costs more fused, so it is stored a fortiori); GEMM readers are
    left out (XLA's GEMM fusion, not priority fusion, takes producers into them).

    Readers first: a chain feeding a stored value is then priced against that value's kernel
    (in moe_train, gelu's backward chain is fused into its last product, which is stored, not
    into the scatter that broadcasts the product).
    """
    walk = _Reread(g, roles, fused, tainted, dev, set())
    for op, v in _stored_cheap_values(g, roles, fused):
        roots = walk.reader_roots(v)
        n = elements(g.shapes[v])
        if roots is None or not roots or all(kernel_space(g, g.ops[r]) <= n for r in roots):
            continue
        if walk.stored_is_faster(op, v, roots):
            walk.stored.add(v)
    return walk.stored


def capped_reductions(g: Program, layouts: dict[int, tuple[int, ...]], dev: Any) -> dict[int, int]:
    """Reduce op -> its blocks, for each column reduction launched on too few blocks to reach
    the device's DRAM bandwidth (`reduction.column_reduction_blocks`, in the operand's
    physical order `layouts`: a convolution's NCHW result on A100 is reduced per channel as
    a row reduction, its NHWC one on H100 as a column reduction)."""
    found = {}
    for op in g.ops:
        if op.primitive not in GPU_HLO_REDUCE or not op.inputs:
            continue
        u = op.inputs[0]
        shape = g.shapes[u]
        itemsize = g.nbytes[u] // max(1, elements(shape))
        blocks = column_reduction_blocks(shape, tuple(op.params.get("axes") or ()),
                                         layouts.get(u, tuple(range(len(shape)))), itemsize)
        if blocks is not None and dev.block_bandwidth(dev.bandwidth, blocks) < dev.bandwidth:
            found[op.index] = blocks
    return found


@dataclass
class _SlowReduction(_Reread):
    """`reread_stored`'s walk for `slow_reduction_stored`; `producer_at`: the op whose own kernel
    `cone` is building (its movement operands, and the cheap values it alone reads, fused into
    it; a value other kernels read too is read)."""

    producer_at: int = -1

    def fusible(self, w: int, reader_side: bool) -> bool:
        p = self.g.producer[w]
        if (self.producer_at >= 0 and p >= 0 and self.g.ops[p].primitive not in MOVEMENT
                and len(self.g.users[w]) > 1):
            return False
        return super().fusible(w, reader_side)

    def kernel(self, root: int, stop: int, space: int, written: int, blocks: int | None) -> Kernel:
        """The kernel rooted at op `root` running over `space` elements: `cone`'s FLOPs and
        reads, every stored value it reads counted `space` elements' worth (the operand's
        utilization in GpuHloCostAnalysis: a per-channel vector broadcast over the kernel is read
        once per element, from cache but through the launch's bandwidth)."""
        self.producer_at = root if stop < 0 else -1
        flops, reads, rereads = self.cone(root, stop)
        self.producer_at = -1
        for u, net in reads.items():
            total = space * (self.g.nbytes[u] // max(1, elements(self.g.shapes[u])))
            if total > rereads.get(u, (net, net))[1]:
                rereads[u] = (net, total)
        return Kernel(flops, space, reads, written, rereads, blocks)


def slow_reduction_stored(g: Program, roles: Roles, fused: list[bool], tainted: list[bool], dev: Any,
                          capped: dict[int, int]) -> set[int]:
    """Cheap elementwise values XLA:GPU stores because a column reduction on few blocks
    (`capped_reductions`) reads them, rather than computing them inside that reduction.

    The performance model limits a kernel's bandwidth by its blocks (AdjustBandwidth), re-reads
    from cache included, and counts a broadcast operand once per element the kernel reads
    (gpu_performance_model_base.cc, ReadTimeWithDRAMHeuristic with GpuHloCostAnalysis's operand
    utilization). A producer fused into a column reduction of 4096 rows of NHWC data, 4 blocks
    on an H100, makes that kernel read the producer's operands, a broadcast per-channel mean
    among them, at about 250 GB/s, so priority fusion (priority_fusion.cc,
    CalculateProducerPriority) finds `fused_time` above `unfused_time` and stores it: the batch
    norm's centred value `x - mean` that the variance reads, the relu gradient's select, the
    product the scale's gradient sums (`tests/gpu/fusion_programs.py:bn_column`, whose dump
    stores `loop_subtract_fusion` on H100 and A100). A longer reduction is split over many
    blocks by the tree reduction rewriter and fuses them all (`bn_column_split`).

    Consumers first, each producer with what it alone reads (its broadcasts and other movement
    operands, and cheap values no other kernel reads: fusing those removes a kernel and
    duplicates nothing, the highest priorities, so a relu gradient's select holds its compare
    by then), its other operands read: priority fusion fuses an op into a reduction first where
    that reads no more (a square into the variance's sum) and prices the op before it against
    the grown reduction; a value whose reader was stored is priced against that reader's loop
    kernel (the centred value feeding a stored product is fused into it).
    """
    walk = _SlowReduction(g, roles, fused, tainted, dev, set())
    for op, v in _stored_cheap_values(g, roles, fused):
        roots = walk.reader_roots(v)
        if not roots or not any(r in capped for r in roots):
            continue
        producer = walk.kernel(op.index, -1, elements(g.shapes[v]), g.nbytes[v], None)
        consumers = [walk.kernel(r, v, kernel_space(g, g.ops[r]),
                                 sum(g.nbytes[w] for w in g.ops[r].outputs if w is not None), capped.get(r))
                     for r in roots]
        if not duplicate_is_faster(dev, producer, v, consumers):
            walk.stored.add(v)
    return walk.stored


def sum_of_stored_values(g: Program, roles: Roles, fused: list[bool], tainted: list[bool], dev: Any,
                         reread: set[int], op: Any, v: int) -> bool:
    """Whether XLA:GPU stores `v`, a sum (an add or subtract, `SUM_HLO_OPS`) of two or more
    stored values of its own size (a residual stream's `x + f(x)`), rather than computing it
    in each op that reads it.

    Priority fusion prices every producer against its consumers (priority_fusion.cc:
    CalculateProducerPriority with gpu_performance_model.cc, EstimateRunTimesForPriorityFusion;
    `performance.duplicate_is_faster`); its first pricing, with every op still its own kernel,
    is what this follows: the sum and each op reading it (`_direct_readers`) as single-op
    kernels. Fused, each reader reads the sum's inputs in place of the sum. With two readers
    that is faster (linen_resnet_bottleneck's dumps, A100: each `bn + shortcut` sum, read by
    the relu's `maximum` and its gradient's `compare`, 80 us fused against 92 unfused, and
    computed in both; `tests/gpu/fusion_programs.py:residual_relu`); with the five or six
    readers of a pre-LayerNorm residual stream (the next LayerNorm's mean, centring and square,
    the next sum, the backward) storing it is (mixer's and `bf16_residual_mlp`'s dumps: 96.9 us
    fused against 92.4 unfused, each sum a multi-output fusion's stored result,
    `input_add_reduce_fusion{2}`). On a device without bfloat16 arithmetic the sum is priced as
    float32 and read through its widening converts (float normalization and
    SimplifyFPConversions: the LayerNorm reads the float32 sum). Later re-pricings, after
    neighbours are fused, can still flip a sum (the dumps fuse every other sum of
    `bf16_residual_mlp` in the end); this rule does not follow them."""
    if rule(op.primitive).gpu_hlo_ops not in SUM_HLO_OPS:
        return False
    n = elements(g.shapes[v])
    if len(g.users[v]) < 2 or sum(1 for u in op.inputs if elements(g.shapes[u]) == n) < 2:
        return False
    walk = _Reread(g, roles, fused, tainted, dev, set(reread))
    _, preads, _ = walk.cone(op.index, -1)
    if sum(1 for u in preads if elements(g.shapes[u]) == n) < 2:
        return False
    in_f32 = not bf16_arithmetic_native(dev)
    copies = _widened(g, v) if in_f32 else [v]
    readers = _direct_readers(g, copies)
    if len(readers) < 2:
        return False
    producer = _single_op_kernel(g, dev, op, {}, in_f32)
    consumers = [_single_op_kernel(g, dev, g.ops[c], {w: v for w in copies}, in_f32) for c in readers]
    return not duplicate_is_faster(dev, producer, v, consumers)


def _widened(g: Program, v: int) -> list[int]:
    """`v` and the float32 copies its widening converts make (one value to XLA after
    SimplifyFPConversions: the sum is computed in float32)."""
    out = [v]
    for c in g.users[v]:
        cop = g.ops[c]
        w = cop.outputs[0]
        if cop.primitive == "convert_element_type" and w is not None and g.nbytes[w] > g.nbytes[v]:
            out.append(w)
    return out


def _direct_readers(g: Program, copies: list[int]) -> list[int]:
    """The ops reading a value or its widened copies (`copies`, the value first), GEMMs left out."""
    v = copies[0]
    readers: list[int] = []
    for w in copies:
        for c in g.users[w]:
            cop = g.ops[c]
            if c in readers or cop.primitive in DOTS or (w == v and cop.outputs[0] in copies):
                continue
            readers.append(c)
    return readers


def _single_op_kernel(g: Program, dev: Any, op: Any, alias: dict[int, int], in_f32: bool) -> Kernel:
    """`op` alone as a kernel (reads its operands, writes its results); `alias` maps a value
    read to the one it stands for; `in_f32`: bfloat16 values priced as float32 (float
    normalization, `bf16_arithmetic_native`)."""
    def nbytes(u: int) -> int:
        return g.nbytes[u] * (2 if in_f32 and str(g.dtypes[u]) == "bfloat16" else 1)
    out = next(w for w in op.outputs if w is not None)
    space = kernel_space(g, op)
    flops = {op.index: flops_per_element(dev, op.primitive, str(g.dtypes[out]), op.params) * space}
    reads = {}
    for u in op.inputs:
        reads[alias.get(u, u)] = nbytes(u)
    written = sum(nbytes(w) for w in op.outputs if w is not None)
    return Kernel(flops, space, reads, written, {})
