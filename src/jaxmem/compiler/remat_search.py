"""The greedy rematerialization search: drop values across the peak, recompute them later.

The model is liveness over the program's ops in the order remat runs them (`remat_graph.Graph`,
a view over `program.Program`): a value occupies its bytes from the op that makes it to its
last use; arguments and outputs for the whole call (the caller holds the arguments; XLA
reserves output buffers for the whole call and counts them in its total), less outputs that
take over a donated argument's buffer. A recompute group holds its intermediates during its
own step only. `profile` lists how this model deviates from the planner's liveness.

One step of the search looks at the step where live bytes peak, and at the values that are live
across it without being used there (in a training step: the forward's residuals waiting for the
backward). For each such value `v` it builds a recompute chain to run right before `v`'s next
use `u`: `v`'s producer, and recursively the producers of operands that are not live at `u`
anyway. Values the chain can make with a few more cheap ops, and that are also waiting for a
use at or after `u`, join the group (a layer's mask and activation are recomputed together).
A transpose the chain would read is rebuilt inside the group from the value it views (a head
split of an attention projection): XLA:CPU holds such a transpose twice when a group reads it
(the group gets the untransposed layout, the matrix product its own copy), and the model counts
that second copy. Groups whose chain is all cheap (elementwise, movement, reductions: what XLA
fuses) go first, largest first; then the rest by bytes freed per FLOP recomputed. The first
group that lowers the peak (or keeps it and lowers the area under the live-bytes curve) is
applied, and the search goes on until no group helps. Every accepted step is kept, so a
caller can pick the least recompute that meets a budget, and the last step is the smallest
peak reachable.

Three things keep XLA:CPU's schedule close to the model's. A chain's elementwise tail runs
right after its group, outside it, where XLA fuses it (`_tail`). The largest gradient product
after a group reads one of its operands as handed back by the group, so XLA cannot run it
beside the group's intermediates (`_pinned`). And `economize` merges a later group into an
earlier one that already runs all its ops (a dropped residual value's recompute makes the
activation the next layer's backward needs), which `fit` judges beside the unmerged step.

>>> import jax, jax.numpy as jnp
>>> from jaxmem.compiler.remat_graph import trace
>>> g = trace(lambda x: jnp.sum(jnp.sin(x) * jnp.cos(x)), jnp.ones(4))
>>> profile(g).peak > 0
True
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from jaxmem.compiler.costs import eqn_cost, is_cheap, is_recomputable
from jaxmem.compiler.plan_types import Const
from jaxmem.compiler.program import Op
from jaxmem.compiler.remat_graph import Graph, group_op
from jaxmem.compiler.schedule import sink as schedule_sink
from jaxmem.compiler.stages import live_profile
# DOUBLED_VIEWS: movement ops whose output XLA:CPU may hold twice (two layouts) when a recompute
# group reads it; CHAIN_VIEWS: movement ops a transposed operand may be recomputed through
# (see `_view_chain`).
from jaxmem.compiler.rules import (CHAIN_VIEWS, DOT_LIKE, DOUBLED_VIEWS, ELEMENTWISE_COST, MAX_FUSED_READERS,
                                   fusible_producer)

# A chain may reach this many ops back from the value it recomputes; deeper chains cost more
# than they free in every model we measured, and the bound keeps one search step cheap.
MAX_CHAIN_DEPTH = 16
MAX_CHAIN_NODES = 64
# Extra cheap ops a sibling may add to a group's chain.
MAX_SIBLING_NODES = 4
# Candidates tried per search step before giving up (they are ranked, so later ones rarely win).
MAX_TRIES = 6


@dataclass
class XlaProfile:
    """Live bytes per step under remat's model of XLA:CPU (`profile`), and each value's
    definition and uses. (The planner's own intervals are `liveness.Liveness`.)"""

    live: list[int]                       # live bytes at steps 0..N (N: the program's exit)
    defs: dict[int, int]                  # value -> op position (-1: argument or constant)
    uses: dict[int, list[int]]            # value -> sorted positions that read it (N: output)
    producer: dict[int, int]              # value -> op position
    last: dict[int, int]                  # value -> last position it is live
    virtual: set[int] = field(default_factory=set)  # values XLA fuses into their consumers

    @property
    def peak(self) -> int:
        return max(self.live) if self.live else 0

    @property
    def peak_step(self) -> int:
        return self.live.index(self.peak)

    @property
    def area(self) -> int:
        return sum(self.live)


def profile(graph: Graph) -> XlaProfile:
    """Live bytes at every step of `graph`: remat's model of what XLA:CPU holds.

    It is the one live-bytes profile (`stages.live_profile`) over value spans, with these
    deviations from the planner's liveness (`liveness.assign_buffers`), each measured on XLA:CPU:
    - pinned: arguments and outputs are held for the whole call (`_pinned_bytes`);
    - virtual: values XLA's loop fusion keeps out of memory (`_virtual`), whose operands stay
      live until the fused readers run;
    - group scratch: a recompute group holds its own intermediates during its step;
    - doubled transposes: a transpose a group reads is held twice, up to the group;
    - no in-place sharing and no 256-byte alignment: every value is its own exact-size buffer.
    """
    n = len(graph.ops)
    defs: dict[int, int] = {}
    uses: dict[int, list[int]] = {}
    producer: dict[int, int] = {}
    scratch: dict[int, int] = {}
    for vid in graph.invars:
        defs[vid] = -1
    for pos, op in enumerate(graph.ops):
        for vid in op.inputs:
            uses.setdefault(vid, []).append(pos)
        for vid in op.outputs:
            if vid is not None:
                defs[vid] = pos
                if op.eqn is not None:
                    producer[vid] = pos
        if op.body:
            scratch[pos] = _group_scratch(graph, op)
    for vid in graph.outvars:
        if not isinstance(vid, Const):
            uses.setdefault(vid, []).append(n)
    virtual = _virtual(graph, uses)
    # A fused value is read where its consumers run: its operands stay live until then.
    for pos in range(n - 1, -1, -1):
        op = graph.ops[pos]
        if op.outputs and op.outputs[0] in virtual:
            later = [u for out in op.outputs if out is not None for u in uses.get(out, [])]
            for w in op.inputs:
                uses[w] = sorted(set(uses.get(w, [])) | set(later))
    last = {vid: (uses[vid][-1] if vid in uses else pos) for vid, pos in defs.items()}
    pinned = set(graph.invars) | {v for v in graph.outvars if not isinstance(v, Const)}
    spans = [(0, n, _pinned_bytes(graph))]
    spans += [(max(defs[r], 0), end, graph.program.nbytes[r]) for r, end in last.items()
              if r not in pinned and r not in virtual]
    spans += [(pos, pos, size) for pos, size in scratch.items()]
    # XLA:CPU gives a transposed value a second copy when a recompute group reads it besides a
    # matrix product: the group's operand gets the untransposed layout (a slice of the producer)
    # while the dot gets its own transposed copy. Count that copy from the transpose to the group.
    for pos, op in enumerate(graph.ops):
        if not op.body:
            continue
        for w in set(op.operands[:-1]):
            src = producer.get(w)
            if src is not None and graph.ops[src].primitive in DOUBLED_VIEWS and w not in virtual:
                spans.append((src, pos, graph.program.nbytes[w]))
    live = live_profile(spans, n)[1:].tolist()
    return XlaProfile(live, defs, uses, producer, last, virtual)


def _group_scratch(graph: Graph, op: Op) -> int:
    """Bytes a recompute group holds while it runs, besides its outputs: the most of its own
    intermediates live at once (each from the body op that makes it to its last reader)."""
    outs = set(op.outputs)
    last: dict[int, int] = {}
    for k, inner in enumerate(op.body):
        for v in inner.inputs:
            last[v] = k
    peak = 0
    for k, inner in enumerate(op.body):
        live = 0
        for j in range(k + 1):
            for v in op.body[j].outputs:
                if v is not None and v not in outs and last.get(v, j) >= k:
                    live += graph.program.nbytes[v]
        peak = max(peak, live)
    return peak


def _virtual(graph: Graph, uses: dict[int, list[int]]) -> set[int]:
    """Values XLA keeps out of memory: made by elementwise or movement ops and read only by
    fusible ops (elementwise, movement, reductions), so each consumer's fusion recomputes them.

    XLA does not re-emit a value in every reader without bound: a chain of adds where every sum
    has several readers (a transformer's residual stream) would be re-emitted in every reader
    of every later sum, and XLA holds those sums in memory (measured: XLA:CPU's buffer
    assignment keeps them). A value whose held readers, counted through the fused values it
    feeds, are more than `rules.MAX_FUSED_READERS` is held too. (Counted as distinct readers, not
    paths: a gelu's diamond of elementwise ops stays fused, as XLA fuses it.)
    """
    n = len(graph.ops)
    virtual = set()
    roots: dict[int, frozenset[int]] = {}  # virtual value -> the held readers it is fused into
    for pos in range(n - 1, -1, -1):
        op = graph.ops[pos]
        if not fusible_producer(op.primitive, every_cheap_op=True):
            continue
        outs = [v for v in op.outputs if v is not None]
        ok = True
        into: set[int] = set()
        for v in outs:
            for u in uses.get(v, []):
                if u >= n or not fusible_producer(graph.ops[u].primitive, every_cheap_op=True):
                    ok = False
                    break
                fused = [roots[c] for c in graph.ops[u].outputs if c in virtual]
                into.update(*fused) if fused else into.add(u)
        if ok and len(into) <= MAX_FUSED_READERS:
            virtual.update(outs)
            roots.update((v, frozenset(into)) for v in outs)
    return virtual


def sink_fused(graph: Graph) -> Graph:
    """Move each elementwise/movement op that does not shrink its operand to just before its
    first consumer, as XLA's fusion does (`schedule.sink`); values are unchanged, residuals get
    shorter."""
    outputs = {v for v in graph.outvars if not isinstance(v, Const)}
    made_by = {v: pos for pos, op in enumerate(graph.ops) for v in op.outputs if v is not None}
    sunk = []
    for op in graph.ops:
        outs = [v for v in op.outputs if v is not None]
        sunk.append(bool(outs) and fusible_producer(op.primitive, every_cheap_op=True)
                    and not any(v in outputs for v in outs)
                    and all(graph.program.nbytes[w] <= min(graph.program.nbytes[v] for v in outs)
                            for w in op.inputs))
    producers = [list(dict.fromkeys(made_by[w] for w in op.inputs if w in made_by)) for op in graph.ops]
    order = schedule_sink(list(range(len(graph.ops))), producers, sunk)
    return graph.with_ops([graph.ops[i] for i in order], list(graph.outvars))


def hoist(graph: Graph) -> Graph:
    """Move the ops that make outputs (and the cheap ops that only feed them) to just after
    their last operand exists, as XLA's memory-minimizing scheduler does: an output's buffer is
    held for the whole call anyway, and its operands (a gradient before the optimizer update)
    die sooner."""
    n = len(graph.ops)
    outputs = {v for v in graph.outvars if not isinstance(v, Const)}
    consumers: dict[int, list[int]] = {}
    for pos, op in enumerate(graph.ops):
        for w in op.inputs:
            consumers.setdefault(w, []).append(pos)
    hoisted = set()
    for pos in range(n - 1, -1, -1):
        op = graph.ops[pos]
        outs = [v for v in op.outputs if v is not None]
        if not outs or op.eqn is None or not is_recomputable(op.eqn):
            continue
        if all(v in outputs for v in outs) or (
                fusible_producer(op.primitive, every_cheap_op=True) and all(c in hoisted for v in outs for c in consumers.get(v, [])
                                                ) and all(v in consumers for v in outs)):
            hoisted.add(pos)
    producer = {v: pos for pos, op in enumerate(graph.ops) for v in op.outputs if v is not None}
    key: list[tuple[int, int, int]] = [(i, 0, i) for i in range(n)]
    for pos in sorted(hoisted):
        after = [key[producer[w]][0] for w in graph.ops[pos].inputs if w in producer]
        key[pos] = (max(after, default=-1), 1, pos)
    order = sorted(range(n), key=lambda i: key[i])
    return graph.with_ops([graph.ops[i] for i in order], list(graph.outvars))


def _pinned_bytes(graph: Graph) -> int:
    """Bytes held for the whole call: arguments and outputs, less outputs that take a donated
    argument's buffer (same shape and dtype, as XLA's input-output aliasing pairs them)."""
    outs = list(dict.fromkeys(v for v in graph.outvars if not isinstance(v, Const)))
    total = sum(graph.program.nbytes[v] for v in dict.fromkeys(graph.invars))
    total += sum(graph.program.nbytes[v] for v in outs if v not in graph.invars)
    p = graph.program
    free = [graph.invars[i] for i in sorted(graph.donated)]
    for v in outs:
        for i, d in enumerate(free):
            if p.shapes[d] == p.shapes[v] and p.dtypes[d] == p.dtypes[v]:
                total -= p.nbytes[v]
                del free[i]
                break
    return total


def _donated_ids(graph: Graph) -> set[int]:
    return {graph.invars[i] for i in graph.donated}


@dataclass
class Group:
    """One rewrite: recompute `chain` (original op positions, in order) before op `at`."""

    values: list[int]          # values dropped across the peak and recomputed
    chain: list[int]           # op positions to duplicate, topological order
    at: int                    # insert before this op position
    freed: int                 # bytes the group frees at the peak step
    flops: int
    cheap: bool
    primitives: list[str] = field(default_factory=list)   # the chain's, in order
    makers: list[str] = field(default_factory=list)       # what makes each of `values`
    through: int | None = None  # a value the group hands back so op `at` waits for it

    def rank(self) -> tuple:
        if self.cheap:
            return (0, -self.freed)
        return (1, -self.freed / max(self.flops, 1))


@dataclass
class Snapshot:
    """The program after some search steps, with its modelled peak and recompute cost."""

    graph: Graph
    peak: int
    extra_flops: int
    groups: list[Group] = field(default_factory=list)


def _available(graph: Graph, lv: XlaProfile, vid: int, at: int) -> bool:
    if lv.defs.get(vid, 0) < 0:
        return vid not in _donated_ids(graph) or lv.last[vid] >= at
    if vid in lv.virtual:
        return False  # fused: reading it later would keep its operands alive; recompute it
    return lv.defs[vid] < at and lv.last.get(vid, -1) >= at


def _build_chain(graph: Graph, lv: XlaProfile, vid: int, at: int, chain: dict[int, None],
                 depth: int, limit: int, cheap_only: bool, matmul: bool = True) -> bool:
    pos = lv.producer.get(vid)
    if pos is None:
        return False
    if pos in chain:
        return True
    op = graph.ops[pos]
    if op.eqn is None or not is_recomputable(op.eqn) or (cheap_only and not is_cheap(op.eqn)):
        return False
    if not matmul and op.primitive in DOT_LIKE:
        return False
    if len(chain) >= limit:
        return False
    for w in op.inputs:
        if _available(graph, lv, w, at):
            views = _view_chain(graph, lv, w)
            if views is not None and len(chain) + len(views) < limit:
                # Recompute the transpose from the value it views rather than read it: XLA:CPU
                # would hold it twice (see `profile`), the viewed value once.
                chain.update(dict.fromkeys(views))
            continue
        if depth >= MAX_CHAIN_DEPTH:
            return False
        if not _build_chain(graph, lv, w, at, chain, depth + 1, limit, cheap_only, matmul):
            return False
    chain[pos] = None
    return True


def _view_chain(graph: Graph, lv: XlaProfile, vid: int) -> list[int] | None:
    """The movement ops that make transposed value `vid` from a value XLA holds in memory
    (back through fused views: reshape, slice, split), in program order; None if `vid` is not
    a transpose or no such value is within a few views."""
    pos = lv.producer.get(vid)
    if pos is None or graph.ops[pos].primitive not in DOUBLED_VIEWS:
        return None
    found = []
    while len(found) < 4:
        op = graph.ops[pos]
        if op.eqn is None or op.primitive not in CHAIN_VIEWS or len(op.inputs) != 1:
            return None
        found.append(pos)
        src = op.inputs[0]
        if src not in lv.virtual:
            return found[::-1]
        pos = lv.producer.get(src)
        if pos is None:
            return None
    return None


def _first_use_after(lv: XlaProfile, vid: int, t: int) -> int | None:
    uses = lv.uses.get(vid, [])
    i = bisect.bisect_right(uses, t)
    return uses[i] if i < len(uses) else None


def _crossing(graph: Graph, lv: XlaProfile, t: int, min_bytes: int) -> dict[int, int]:
    """Values live across step t but not read there, with their next use: value -> position."""
    found = {}
    for vid, pos in lv.producer.items():
        if pos >= t or vid in lv.virtual or graph.program.nbytes[vid] < min_bytes:
            continue
        uses = lv.uses.get(vid)
        if not uses or uses[-1] <= t:
            continue
        nxt = _first_use_after(lv, vid, t - 1)
        if nxt is None or nxt == t:
            continue
        found[vid] = nxt
    return found


def candidates(graph: Graph, lv: XlaProfile, min_fraction: float = 1e-4,
               matmul: bool = True) -> list[Group]:
    """Ranked groups that could lower the live bytes at the peak step.

    With `matmul=False` no chain recomputes a matrix product or convolution: what the
    `dots_saveable` checkpoint policy allows.
    """
    t = lv.peak_step
    crossing = _crossing(graph, lv, t, int(lv.peak * min_fraction))
    consumers: dict[int, list[int]] = {}
    for pos, op in enumerate(graph.ops):
        for w in op.inputs:
            consumers.setdefault(w, []).append(pos)
    groups = []
    for vid, at in crossing.items():
        chain: dict[int, None] = {}
        if not _build_chain(graph, lv, vid, at, chain, 0, MAX_CHAIN_NODES, False, matmul):
            continue
        if not _has_external_input(graph, lv, chain, at):
            continue  # a chain of constants would be folded back by XLA
        values = [vid]
        # Siblings: other waiting values that the chain's ops feed with a few cheap ops.
        frontier = [out for p in list(chain) for out in graph.ops[p].outputs if out is not None]
        seen = set(frontier)
        while frontier:
            src = frontier.pop()
            for cpos in consumers.get(src, []):
                for c in graph.ops[cpos].outputs:
                    if c is None or c in seen or c not in crossing or crossing[c] < at:
                        continue
                    seen.add(c)
                    trial = dict(chain)
                    if _build_chain(graph, lv, c, at, trial, 0, len(chain) + MAX_SIBLING_NODES, True):
                        chain = trial
                        values.append(c)
                        frontier.append(c)
        chain = _close_fused(graph, lv, chain, at, consumers)
        if chain is None:
            continue
        flops = sum(eqn_cost(graph.ops[p].eqn).flops for p in chain)
        cheap = all(is_cheap(graph.ops[p].eqn) for p in chain)
        freed = sum(graph.program.nbytes[v] for v in values)
        prims = [graph.ops[p].primitive for p in chain]
        makers = [graph.ops[lv.producer[v]].primitive for v in values]
        groups.append(Group(values, list(chain), at, freed, flops, cheap, prims, makers))
    groups.sort(key=Group.rank)
    return groups


def _close_fused(graph: Graph, lv: XlaProfile, chain: dict[int, None], at: int,
                 consumers: dict[int, list[int]]) -> dict[int, None] | None:
    """Add the fused consumers of the chain's values that still feed uses at or after `at`.

    Such a consumer (say `1 - a` of a dropped `a`) sits before `at` but is fused into its later
    readers, so it keeps its operand alive; it has to be recomputed with the group, else the
    original stays live. Returns the chain in program order, or None if one cannot join.
    """
    work = [out for p in chain for out in graph.ops[p].outputs if out is not None]
    while work:
        src = work.pop()
        for c in consumers.get(src, []):
            op = graph.ops[c]
            if c >= at or c in chain or not fusible_producer(op.primitive, every_cheap_op=True):
                continue
            if not any(u >= at for o in op.outputs if o is not None for u in lv.uses.get(o, [])):
                continue
            trial = dict(chain)
            trial.pop(c, None)
            ok = True
            for w in op.inputs:
                if w in {o for p in trial for o in graph.ops[p].outputs} or _available(graph, lv, w, at):
                    continue
                if not _build_chain(graph, lv, w, at, trial, 0, len(trial) + MAX_SIBLING_NODES, True):
                    ok = False
                    break
            if not ok:
                return None
            trial[c] = None
            chain = trial
            work.extend(o for o in op.outputs if o is not None)
    return dict.fromkeys(sorted(chain))


def _has_external_input(graph: Graph, lv: XlaProfile, chain: dict[int, None], at: int) -> bool:
    inside = {out for p in chain for out in graph.ops[p].outputs}
    return any(w not in inside
               for p in chain for w in graph.ops[p].inputs)


def _tail(graph: Graph, chain: list[int]) -> set[int]:
    """The chain's elementwise tail: ops that can run after the group, outside it.

    A recompute group's outputs are materialized (XLA does not fuse across the conditional's
    boundary): a gelu recomputed in one group hands back its product and every elementwise
    intermediate its backward reads, each a full buffer. Elementwise ops at the end of the
    chain whose chain readers are also in the tail run right after the group instead, reading
    its outputs, and XLA fuses them into their readers (measured on XLA:CPU: a gelu MLP's
    deepest rewrite goes from 48% to 33% of the original's total). Each must read a value the
    chain makes: a tail op reading only originals would be merged back into the original by
    XLA's CSE. The group keeps at least one op.
    """
    made = {out: p for p in chain for out in graph.ops[p].outputs if out is not None}
    readers: dict[int, list[int]] = {}
    for p in chain:
        for w in graph.ops[p].inputs:
            if w in made:
                readers.setdefault(made[w], []).append(p)
    tail: set[int] = set()
    # In reverse, so an op joins only once every chain reader of its outputs has joined (the
    # group never needs a tail value), and only if it reads a value the chain makes (so it
    # reads fresh copies).
    for p in reversed(chain):
        op = graph.ops[p]
        if op.eqn is not None and op.primitive in ELEMENTWISE_COST and all(
                r in tail for r in readers.get(p, [])) and any(w in made for w in op.inputs):
            tail.add(p)
    return tail if len(tail) < len(chain) else set()


def apply(graph: Graph, lv: XlaProfile, group: Group, guard: str = "cond") -> Graph:
    """The graph with `group.chain` recomputed by one group op inserted before op `group.at`.

    The group reads the chain's operands that are not themselves recomputed, plus an anchor
    (the newest value made before `at`) that keeps XLA from running it earlier; later ops
    read its copies instead of the originals. `guard` is how XLA is kept from merging the copy
    back into the original (see `remat_graph._run_group`). The chain's elementwise tail runs
    right after the group, outside it (see `_tail`).
    """
    at = group.at
    # A pinned group keeps its tail: XLA would run the pinned product between the group and a
    # tail left outside it (measured: the residual MLP's tanh ran after `g W^T`).
    tail = _tail(graph, group.chain) if group.through is None else set()
    inside = {out for p in group.chain for out in graph.ops[p].outputs if out is not None}
    external: list[int] = []
    for p in group.chain:
        if p in tail:
            continue
        for w in graph.ops[p].inputs:
            if w not in inside and w not in external:
                external.append(w)
    if group.through is not None and group.through not in external:
        external.append(group.through)
    anchor = _anchor(graph, at, set(external))
    later: dict[int, int] = {}  # original value -> recomputed copy
    body = []
    after = []
    for p in group.chain:
        op = graph.ops[p]
        outs = []
        for out in op.outputs:
            if out is None:
                outs.append(None)
                continue
            later[out] = graph.new_id(out)
            outs.append(later[out])
        ins = [v if isinstance(v, Const) else later.get(v, v) for v in op.operands]
        (after if p in tail else body).append(op.renamed(ins, outs, recompute=True))
    through = ()
    if group.through is not None:
        # Op `at` and every later reader take the handed-back copy: XLA cannot run them
        # before the group, and the original dies at the group.
        later[group.through] = graph.new_id(group.through)
        through = ((later[group.through], group.through),)
    used_later = set()
    ops = list(graph.ops[:at])
    rest = []
    for op in graph.ops[at:]:
        if any(not isinstance(v, Const) and v in later for v in op.operands):
            used_later.update(v for v in op.operands if not isinstance(v, Const) and v in later)
            op = op.renamed([v if isinstance(v, Const) else later.get(v, v) for v in op.operands])
        rest.append(op)
    used_later.update(v for v in graph.outvars if not isinstance(v, Const) and v in later)
    copies = {later[v] for v in used_later}
    # Tail ops nothing reads are left out; the group returns what the kept tail reads.
    kept_tail = []
    for op in reversed(after):
        if any(o in copies for o in op.outputs if o is not None):
            kept_tail.append(op)
            copies.update(op.inputs)
    kept_tail.reverse()
    made_in_tail = {o for n in kept_tail for o in n.outputs if o is not None}
    outs = [c for c in (later[v] for v in later) if c in copies and c not in made_in_tail]
    ins = external + ([anchor] if anchor is not None else external[:1])
    ops.append(group_op(ins, outs, body, guard, tuple(t for t in through if t[0] in outs)))
    ops.extend(kept_tail)
    ops.extend(rest)
    outvars = [v if isinstance(v, Const) else later.get(v, v) for v in graph.outvars]
    return graph.with_ops(ops, outvars)


def _anchor(graph: Graph, at: int, exclude: set[int]) -> int | None:
    for pos in range(at - 1, -1, -1):
        for out in graph.ops[pos].outputs:
            if out is None or out in exclude:
                continue
            if graph.program.nbytes[out] > 0 and graph.program.dtypes[out] in _PLAIN_DTYPES:
                return out
    return None


_PLAIN_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint64",
    "uint32", "uint16", "uint8", "bool", "complex64", "complex128",
})


def _pinned(graph: Graph, lv: XlaProfile, group: Group) -> list[Group]:
    """`group` with the largest product among the ops after it pinned behind it: that op
    reads one of its operands as handed back by the group. [] where there is none.

    The readers of a recomputed activation in a backward are the gradient products around it
    (`dW = a^T g`, `g W^T`). XLA's scheduler runs a product whose operands exist before the
    group ahead of it (measured on XLA:CPU: the residual MLP's `g W^T`, 8 MiB, ran before each
    recompute group, live beside the group's own 8 MiB product and 8 MiB tanh). Read through
    the group, it runs after the group, when the group's intermediates are gone.
    """
    at = group.at
    readers = [u for v in group.values for u in lv.uses.get(v, []) if u >= at]
    if not readers:
        return []
    best = None
    for q in range(at + 1, min(max(readers), len(graph.ops) - 1) + 1):
        op = graph.ops[q]
        if op.eqn is None or op.primitive not in DOT_LIKE:
            continue
        operands = [w for w in op.inputs if lv.defs.get(w, -1) < at]
        if len(operands) != len(op.inputs):
            continue  # it waits for something made after the group already
        size = sum(graph.program.nbytes[o] for o in op.outputs if o is not None)
        if size >= group.freed and (best is None or size > best[0]):
            best = (size, q, operands)
    if best is None:
        return []
    # Hand back an operand the program made (an argument's copy would add its bytes).
    made = [w for w in best[2] if lv.defs.get(w, -1) >= 0] or best[2]
    through = min(made, key=lambda w: graph.program.nbytes[w])
    return [Group(group.values, group.chain, at, group.freed, group.flops, group.cheap,
                  group.primitives, group.makers, through)]


def merge(graph: Graph, first: int, later: int) -> Graph | None:
    """The graph with the recompute group at position `later` removed, its readers taking the
    copies the group at `first` makes of the same values; None if `first` does not run every
    op of `later` (matched by the original op each recomputes).

    Dropping a residual-stream value `h` recomputes `h = h_prev + tanh(h_prev W1) W2` before
    `h`'s backward; the `tanh(h_prev W1)` it makes on the way is what a later group recomputes
    for `h_prev`'s own backward. Handing it over saves that group's product, at the price of
    holding its output in between.
    """
    a, b = graph.ops[first], graph.ops[later]
    made = {}
    for inner in a.body:
        made.setdefault(inner.index, inner)
    if not a.body or not b.body or any(inner.index not in made for inner in b.body):
        return None
    rename: dict[int, int | Const] = {}
    extra = []
    for inner in b.body:
        for out, src in zip(inner.outputs, made[inner.index].outputs):
            if out is None or out not in b.outputs:
                continue
            if src is None:
                return None  # the earlier group drops that output
            rename[out] = src
            if src not in a.outputs and src not in extra:
                extra.append(src)
    # A product pinned behind the removed group read its operand through it: now directly.
    for out, src in b.through:
        rename[out] = b.operands[b.body_ins.index(src)]
    ops = []
    for pos, op in enumerate(graph.ops):
        if pos == later:
            continue
        if pos == first:
            op = op.renamed(op.operands, op.outputs + extra)
        elif pos > first and any(not isinstance(v, Const) and v in rename for v in op.operands):
            op = op.renamed([v if isinstance(v, Const) else rename.get(v, v) for v in op.operands])
        ops.append(op)
    outvars = [v if isinstance(v, Const) else rename.get(v, v) for v in graph.outvars]
    return graph.with_ops(ops, outvars)


def economize(graph: Graph, peak: int) -> tuple[Graph, int]:
    """Merge every recompute group into an earlier one that already runs all its ops (see
    `merge`), where the modelled peak stays at or below `peak`. Returns the graph and the
    FLOPs saved."""
    saved = 0
    groups = [pos for pos, op in enumerate(graph.ops) if op.body]
    # Latest first: removing a group does not move the ones before it.
    for later in reversed(groups):
        flops = sum(eqn_cost(n.eqn).flops for n in graph.ops[later].body)
        if flops == 0:
            continue  # movement only: nothing to save
        for first in groups:
            if first >= later:
                break
            merged = merge(graph, first, later)
            if merged is not None and profile(merged).peak <= peak:
                saved += flops
                graph = merged
                break
    return graph, saved


def search(graph: Graph, *, stop_below: int = 0, max_steps: int = 5000,
           guard: str = "cond", matmul: bool = True) -> list[Snapshot]:
    """Run the greedy search from `graph` until no group lowers the peak (or it is below `stop_below`).

    Args:
        graph: the flat program (`remat_graph.trace`).
        stop_below: stop once the modelled peak is at or below this many bytes.
        max_steps: a bound on accepted rewrites.
        guard: how each group is kept from XLA's CSE ("cond" or "barrier").
        matmul: allow recomputing matrix products and convolutions.

    Returns:
        The snapshots, the unmodified program first; each later one applies one more group.
    """
    graph = hoist(sink_fused(graph))
    lv = profile(graph)
    snapshots = [Snapshot(graph, lv.peak, 0)]
    extra = 0
    groups: list[Group] = []
    while len(snapshots) <= max_steps and lv.peak > stop_below:
        accepted = None
        for group in candidates(graph, lv, matmul=matmul)[:MAX_TRIES]:
            best = None
            # The pinned variant first: the model does not see what it prevents (XLA running
            # a product early), so it is kept unless the model finds it worse.
            for place in _pinned(graph, lv, group) + [group]:
                trial = apply(graph, lv, place, guard)
                tlv = profile(trial)
                if best is None or (tlv.peak, tlv.area) < (best[2].peak, best[2].area):
                    best = (place, trial, tlv)
                if place.through is not None and tlv.peak <= lv.peak:
                    break
            group, trial, tlv = best
            if tlv.peak < lv.peak or (tlv.peak == lv.peak and tlv.area < lv.area):
                accepted = (group, trial, tlv)
                break
        if accepted is None:
            break
        group, graph, lv = accepted
        extra += group.flops
        groups = groups + [group]
        snapshots.append(Snapshot(graph, lv.peak, extra, groups))
    return snapshots


def program_flops(graph: Graph) -> int:
    """FLOPs of the graph's original (not recomputed) ops."""
    return sum(eqn_cost(n.eqn).flops for n in graph.ops if n.eqn is not None and not n.recompute)
