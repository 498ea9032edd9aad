"""Schedulers: orders of the ops that respect data dependencies, aiming at few live bytes.

A schedule is a list of op indices; every scheduler is a function `(program, analysis) -> order`
(`stages.Analysis`: roles, fusion, loop scratch). Three families, in the spirit of XLA's
hlo_memory_scheduler:
the program's own order; a list scheduler that greedily runs the ready op freeing the most
bytes net of what it allocates; and a depth-first post-order from the outputs that visits the
operand with more extra users / larger subgraph first. The planner scores each by its live
bytes and keeps the best.

    >>> from jaxmem.compiler.doc_example import sin_analysis
    >>> program, order, analysis = sin_analysis()   # sin(x) * 2 over f32[4], fusion chosen
    >>> order = list_schedule(program, analysis)
    >>> sorted(order) == list(range(len(program.ops)))
    True
"""

from __future__ import annotations

import heapq

from jaxmem.compiler.fusion import op_views
from jaxmem.compiler.plan_types import Const
from jaxmem.compiler.program import Program, side_table
from jaxmem.compiler.stages import Analysis, align


def program_order(g: Program, analysis: Analysis | None = None) -> list[int]:
    """The order the program itself wrote its equations in."""
    return list(range(len(g.ops)))


def _producers(g: Program, oi: int) -> list[int]:
    """The ops making `oi`'s operands (a shared table: read-only)."""
    return side_table(g, "producers", _all_producers)[oi]


def _all_producers(g: Program) -> list[list[int]]:
    return [list({g.producer[u] for u in op.inputs if g.producer[u] >= 0}) for op in g.ops]


def _alloc_all(g: Program, fused: list[bool], external: list[bool], views: list[bool]) -> list[int]:
    """Per op, the arena bytes it allocates: its stored outputs' (arguments and loop-body results
    written outside excepted), none for a view of a value in the arena."""
    nbytes = g.nbytes
    out = []
    for oi, op in enumerate(g.ops):
        ins = op.inputs
        if views[oi] and ins and not external[ins[0]]:
            out.append(0)
            continue
        total = 0
        for v in op.outputs:
            if v is not None and not fused[v] and not external[v]:
                total += align(nbytes[v])
        out.append(total)
    return out


def list_schedule(g: Program, analysis: Analysis, prefer_late: bool = False) -> list[int]:
    """Greedy list scheduling: always run the ready op with the best bytes-freed minus
    bytes-allocated (loop scratch counted at a quarter); ties go to the earliest op in program
    order (latest with `prefer_late`).

    **Returns:** a topological order of all ops.
    """
    nops = len(g.ops)
    reads, fused, scratch = analysis.fusion.reads, analysis.fusion.fused, analysis.scratch
    external, outputs = analysis.roles.external, analysis.roles.outputs
    readers = _readers(g, fused, reads)
    remaining = [len(r) for r in readers]
    freeable = [not (e or o) for e, o in zip(external, outputs)]
    size = [align(b) for b in g.nbytes]
    views = side_table(g, "views", op_views)
    alloc = _alloc_all(g, fused, external, views)
    for oi, extra in scratch.items():   # loop scratch, counted at a quarter
        alloc[oi] += extra // 4
    free_op = [not reads[oi] and alloc[oi] == 0 for oi in range(nops)]
    succ, indeg = side_table(g, "successors", _successors)
    indeg = list(indeg)
    scheduled = [False] * nops
    ready = [False] * nops
    version = [0] * nops
    sign = -1 if prefer_late else 1
    heap: list[tuple[int, int, int, int]] = []
    heappush = heapq.heappush

    def push(oi: int) -> None:
        # the priority: bytes freed (operands read for the last time) minus bytes allocated
        version[oi] += 1
        if free_op[oi]:
            priority = 1 << 62
        else:
            priority = -alloc[oi]
            for u in reads[oi]:
                if remaining[u] == 1 and freeable[u]:
                    priority += size[u]
        heappush(heap, (-priority, sign * oi, version[oi], oi))

    for oi in range(nops):
        if indeg[oi] == 0:
            ready[oi] = True
            push(oi)
    order: list[int] = []
    while heap:
        _, _, ver, oi = heapq.heappop(heap)
        if scheduled[oi] or ver != version[oi]:
            continue
        scheduled[oi] = True
        order.append(oi)
        for u in reads[oi]:
            remaining[u] -= 1
            if remaining[u] == 1 and freeable[u]:
                for r in readers[u]:
                    if not scheduled[r] and ready[r]:
                        push(r)
        for s in succ[oi]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready[s] = True
                push(s)
    if len(order) != nops:  # a cycle cannot happen in a jaxpr; keep the program's order if it did
        return program_order(g)
    return order


def _readers(g: Program, fused: list[bool], reads: list[list[int]]) -> list[list[int]]:
    """Per value, the ops reading it once fusion is applied (a side table per fusion: the
    schedules of one plan share it; read-only)."""
    hit = side_table(g, ("readers", bytes(fused)), lambda g: (reads, _readers_of(g.num_values, reads)))
    return hit[1] if hit[0] is reads else _readers_of(g.num_values, reads)


def _readers_of(num_values: int, reads: list[list[int]]) -> list[list[int]]:
    readers: list[list[int]] = [[] for _ in range(num_values)]
    for oi, ins in enumerate(reads):
        for u in ins:
            readers[u].append(oi)
    return readers


def _successors(g: Program) -> tuple[list[list[int]], list[int]]:
    """Per op, the ops reading its results, and how many ops it reads from (a side table)."""
    producers = side_table(g, "producers", _all_producers)
    succ: list[list[int]] = [[] for _ in g.ops]
    for oi, prods in enumerate(producers):
        for p in prods:
            succ[p].append(oi)
    return succ, [len(prods) for prods in producers]


def dfs_schedule(g: Program, analysis: Analysis, reverse_roots: bool = False) -> list[int]:
    """Depth-first post-order from the outputs, as XLA's DFS memory scheduler: operands with more
    extra users, then larger total subgraph bytes, are visited first; `reverse_roots` starts
    from the last output.

    **Returns:** a topological order of all ops.
    """
    nops = len(g.ops)
    fused = analysis.fusion.fused
    outputs_order = [v for v in g.outvars if not isinstance(v, Const)]
    producers = side_table(g, "producers", _all_producers)
    # both root orders visit operands by the same key
    visits = side_table(g, ("dfs", bytes(fused)), lambda g: _dfs_visits(g, fused, producers))

    roots: list[int] = []
    seen_root: set[int] = set()
    for v in outputs_order:
        p = g.producer[v]
        if p >= 0 and p not in seen_root:
            seen_root.add(p)
            roots.append(p)
    if reverse_roots:
        roots.reverse()
    roots += [oi for oi in range(nops) if oi not in seen_root]  # effects / unused results
    visited = [False] * nops
    order: list[int] = []
    for root in roots:
        if visited[root]:
            continue
        # Each stack entry keeps its operands still to visit, best last (popped first).
        stack: list[tuple[int, list[int]]] = [(root, list(visits[root]))]
        visited[root] = True
        while stack:
            oi, todo = stack[-1]
            while todo and visited[todo[-1]]:
                todo.pop()
            if todo:
                nxt = todo.pop()
                visited[nxt] = True
                stack.append((nxt, list(visits[nxt])))
            else:
                stack.pop()
                order.append(oi)
    return order


def _dfs_visits(g: Program, fused: list[bool], producers: list[list[int]]) -> list[list[int]]:
    """Per op, its producers in the order the DFS visits them, reversed (the next one last)."""
    key = _dfs_rank(g, fused, producers).__getitem__
    return [sorted(prods, key=key, reverse=True) for prods in producers]


def _dfs_rank(g: Program, fused: list[bool], producers: list[list[int]]) -> list[tuple[int, int, int]]:
    """Per op, the DFS visiting key: operands with more extra users, then larger total subgraph
    bytes, first (smaller keys sort first)."""
    nops = len(g.ops)
    extra = [0] * nops
    total = [0] * nops
    nbytes, readers = g.nbytes, g.users
    for oi, op in enumerate(g.ops):  # ops are topologically numbered
        own = users = 0
        for v in op.outputs:
            if v is not None:
                users += len(readers[v])
                if not fused[v]:
                    own += align(nbytes[v])
        e = max(users - 1, 0)
        t = own
        for p in producers[oi]:
            e += extra[p]
            t += total[p]
        extra[oi] = e
        total[oi] = t
    return [(-extra[p], -total[p], p) for p in range(nops)]


def topological_orders(g: Program, limit: int) -> list[list[int]] | None:
    """Every topological order of the ops, or None when there are more than `limit`.

    For tiny programs this lets the planner prove its schedule optimal by trying them all.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.jaxpr_adapter import inline
    >>> topological_orders(inline(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(4))), 1000)
    [[0, 1]]
    >>> wide = inline(jax.make_jaxpr(lambda x: [jnp.sin(x) + i for i in range(12)])(jnp.ones(4)))
    >>> topological_orders(wide, 1000) is None   # too many to enumerate
    True
    """
    nops = len(g.ops)
    preds = [set(_producers(g, oi)) for oi in range(nops)]
    indeg = [len(p) for p in preds]
    succ: list[list[int]] = [[] for _ in range(nops)]
    for oi in range(nops):
        for p in preds[oi]:
            succ[p].append(oi)
    orders: list[list[int]] = []
    current: list[int] = []
    ready = [oi for oi in range(nops) if indeg[oi] == 0]

    def extend() -> bool:
        if len(current) == nops:
            orders.append(list(current))
            return len(orders) <= limit
        for k in range(len(ready)):
            oi = ready[k]
            if oi is None:
                continue
            ready[k] = None
            current.append(oi)
            added = []
            for s in succ[oi]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    ready.append(s)
                    added.append(s)
            ok = extend()
            for s in succ[oi]:
                indeg[s] += 1
            del ready[len(ready) - len(added):]
            current.pop()
            ready[k] = oi
            if not ok:
                return False
        return True

    if not extend():
        return None
    return orders


def sink_schedule(g: Program, analysis: Analysis, order: list[int]) -> list[int]:
    """One local-search move over a whole schedule: every op that grows memory (allocates more
    than the inputs dying at it free) is delayed to just before its first consumer, so its
    result is not held while unrelated work runs. The caller keeps the result only if it lowers
    the peak.

    **Returns:** a new topological order.
    """
    nops = len(g.ops)
    reads, fused = analysis.fusion.reads, analysis.fusion.fused
    external, outputs = analysis.roles.external, analysis.roles.outputs
    last = [-1] * g.num_values
    for p, oi in enumerate(order):
        for u in reads[oi]:
            last[u] = p
    sunk = [False] * nops
    views = side_table(g, "views", op_views)
    nbytes = g.nbytes
    alloc = _alloc_all(g, fused, external, views)
    for p, oi in enumerate(order):
        frees = 0   # bytes of the operands read for the last time here
        for u in reads[oi]:
            if last[u] == p and not external[u] and not outputs[u]:
                frees += align(nbytes[u])
        sunk[oi] = alloc[oi] > frees
    return sink(order, side_table(g, "producers", _all_producers), sunk)


def sink(order: list[int], producers: list[list[int]], sunk: list[bool]) -> list[int]:
    """`order` with every op flagged in `sunk` delayed to just before its first consumer (ops
    delayed to the same consumer keep their relative order). An op nothing reads keeps its
    place: its results only leave the program. Shared by the planner's local search and
    remat's model of XLA's fusion (`remat_search.sink_fused`).

        >>> sink([0, 1, 2], [[], [], [0]], [True, False, False])
        [1, 0, 2]

    **Arguments:** an order of op indices; per op, the ops it reads from; per op, whether to delay it.

    **Returns:** a new topological order.
    """
    consumers: list[list[int]] = [[] for _ in producers]
    for oi, prods in enumerate(producers):
        for p in prods:
            consumers[p].append(oi)
    # An op's key is the position it runs before (its own, unless delayed), then its position.
    key = [(0, 0)] * len(producers)
    for p in range(len(order) - 1, -1, -1):
        oi = order[p]
        key[oi] = (p, p)
        if sunk[oi] and consumers[oi]:
            key[oi] = (min(key[c][0] for c in consumers[oi]), p)
    return sorted(order, key=key.__getitem__)
