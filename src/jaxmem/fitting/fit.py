"""`jaxmem.fit`: rewrite a JAX function to recompute values so that it fits a memory budget.

The search (`compiler.remat_search`) proposes a sequence of rewrites, each recomputing one more group of
values later instead of holding them; XLA is the judge of which one to hand back: each
candidate is compiled with `jax.jit(...).lower(...).compile()` and its `memory_analysis()`
total (argument + output + temp - alias) must be within the budget, and so must jaxmem's own
planned peak (`planner.plan_jaxpr`). Among the rewrites that pass, the one with the least
recompute is kept; when none passes, the result says so (`fits=False`) and gives the smallest
budget that was reachable. Each judged step is compiled with later recompute groups merged into
earlier ones that already run their nodes (`remat_search.economize`, fewer FLOPs), and as
searched where XLA finds the merged one over the budget.

>>> import jax, jax.numpy as jnp
>>> def step(w, x):   # four tanh layers sharing w; one SGD step
...     def loss(w):
...         h = x
...         for _ in range(4):
...             h = jnp.tanh(h @ w)
...         return h.sum()
...     return w - 0.1 * jax.grad(loss)(w)
>>> params, batch = jnp.ones((256, 256)), jnp.ones((512, 256))
>>> result = fit(step, params, batch, budget="3.6MiB")     # XLA's total is 3.75 MiB as written
>>> result.fits, result.xla_total_bytes_before, result.xla_total_bytes
(True, 3932160, 3670144)
>>> [(v.primitive, v.shape) for v in result.recomputed]   # one layer's tanh is recomputed
[('tanh', (512, 256))]
>>> new_params = jax.jit(result.fn)(params, batch)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax

from jaxmem.accelerators import is_gpu
from jaxmem.compiler.jaxpr_adapter import donate_positions
from jaxmem.compiler.planner import plan
from jaxmem.compiler.remat import RecomputedValue, recomputed_values, resolve_guard
from jaxmem.compiler.remat_graph import Graph, as_function, trace
from jaxmem.compiler.remat_search import Snapshot, economize, program_flops, search
from jaxmem.compiler.rules import DOT_LIKE
from jaxmem.errors import ConfigError, PlanError
from jaxmem.fitting.bound import WITHOUT_OFFLOAD, capped_verdict, verdict
from jaxmem.fitting.judge import Figures, Judge, infeasible_line, resolve_budget
from jaxmem.fitting.policy import PolicyCandidate, PolicySearch, search_policies
from jaxmem.fitting.rewrites import SourceRewrite, rewrite_first

if TYPE_CHECKING:
    from jaxmem.fitting.mesh import MeshFitResult


@dataclass
class FitResult:
    """What `fit` found. `fn` computes the same values as the original; see `fits`."""

    fn: Callable[..., Any]
    fits: bool
    budget_bytes: int
    planned_peak_bytes: int
    planned_peak_bytes_before: int
    xla_total_bytes: int
    xla_total_bytes_before: int
    recompute_flops_ratio: float
    extra_flops: int
    original_flops: int
    recomputed: list[RecomputedValue]
    min_reachable_bytes: int
    policy: str                    # the closest hand-written jax.checkpoint policy
    policy_code: str               # how to write it
    policy_xla_total_bytes: int | None  # XLA's total for that policy, applied by jaxmem's rewriter
                                        # (a hand-written jax.checkpoint is merged back by XLA:CPU)
    rounds: list[dict[str, int]] = field(default_factory=list)  # every candidate XLA judged
    steps_considered: int = 0      # rewrites the search proposed
    original_fn: Callable[..., Any] | None = None
    step_seconds_before: float | None = None  # one warm jax.jit call of the original, when measured
    step_seconds_after: float | None = None   # ... and of `fn`
    judge: str = "XLA:CPU"         # whose total judged every candidate ("XLA:GPU h100-80gb")
    device: str | None = None      # the GPU preset judged for, or None (XLA:CPU)
    policies: Any = None           # fitting.policy.PolicySearch: every jax.checkpoint alternative judged
    policy_fits: bool = False      # the policy printed meets the budget by itself
    floor_bytes: int = 0           # arguments + outputs - aliases: no recompute goes below it
    infeasible: str | None = None  # the one line that proves the budget infeasible, if it is
    policy_fn: Callable[..., Any] | None = None  # the original with the printed policy applied
    rewrite_ran: bool = True       # False: the rewriting search was skipped (a policy fits, or asked)
    rewrite_skipped: str = ""      # ... and why, in words
    rewrites: list[Any] = field(default_factory=list)  # fitting.rewrites.SourceRewrite, kept in
                                   # order before any policy: their `lines` print first; `fn`,
                                   # `policy_fn` and every candidate start from the last one's `fn`

    def measure(self, *args: Any, repeat: int = 3) -> tuple[float, float]:
        """Time one warm `jax.jit` call of the original and of `fn` on `args` (best of `repeat`,
        interleaved so both see the same machine), keep them on the result and return them:
        extra FLOPs are not the whole cost (a recompute can also stop XLA fusing).

        >>> result.measure(params, batch)                # doctest: +SKIP
        (0.0123, 0.0131)
        """
        before, after = jax.jit(self.original_fn or self.fn), jax.jit(self.fn)
        for f in (before, after):
            jax.block_until_ready(f(*args))              # compile, and warm up
        best = [float("inf"), float("inf")]
        for _ in range(max(1, repeat)):
            for k, f in enumerate((before, after)):
                start = time.perf_counter()
                jax.block_until_ready(f(*args))
                best[k] = min(best[k], time.perf_counter() - start)
        self.step_seconds_before, self.step_seconds_after = best
        return best[0], best[1]


def _planned_peak(fn: Callable, args: Sequence[Any], donate_argnums: tuple[int, ...]) -> int:
    return plan(fn, *args, donate_argnums=donate_argnums).peak_bytes


def _policy(snap: Snapshot, graph: Graph, dots_total: int | None, budget: int) -> tuple[str, str]:
    """Name the hand-written policy closest to what the rewrite chose, and how to write it.

    `dots_total` is XLA's total when every value but matrix products is recomputed (what
    `dots_saveable` allows). When the rewrite recomputes no matrix product, or when that
    dots-only rewrite already meets the budget, `dots_saveable` is the policy to write;
    otherwise the rewrite also recomputes matmuls and only naming what to keep describes it.
    """
    if not snap.groups:
        return "everything_saveable", "no jax.checkpoint needed"
    matmul = any(p in DOT_LIKE for g in snap.groups for p in g.primitives)
    if not matmul or (dots_total is not None and dots_total <= budget):
        return ("dots_saveable", "jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)")
    lines = sorted({str(v.source) for v in recomputed_values(graph, snap) if v.source is not None})
    shown = "; ".join(lines[:4]) + (" ..." if len(lines) > 4 else "")
    return ("save_only_these_names",
            "tag the values to keep with jax.ad_checkpoint.checkpoint_name(x, 'keep') and wrap the "
            "layer in jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names"
            f"('keep')); recompute the values made at: {shown}")


def _on_mesh(fn: Callable[..., Any], args: Sequence[Any], budget: int | str, donate_argnums: int | Sequence[int],
             device: str | None, progress: Callable[[str], None] | None,
             time_limit: float | None) -> MeshFitResult | None:
    """`fitting.mesh.fit_on_mesh`'s answer where the arguments are sharded over a mesh, else None."""
    from jaxmem.xla.sharding import find_mesh

    if find_mesh(args) is None:
        return None
    if device is None:
        raise ConfigError("the arguments are sharded over a mesh: give the device each one is "
                          "(device='tpu-v5e-16gb', --device tpu-v5e-16gb)")
    from jaxmem.fitting.mesh import fit_on_mesh

    return fit_on_mesh(fn, args, budget=budget, device=device, donate=donate_positions(len(args), donate_argnums),
                       progress=progress, time_limit=time_limit if time_limit is not None else 600.0)


def fit(fn: Callable[..., Any], *args: Any, budget: int | str,
        donate_argnums: int | Sequence[int] = (), max_rounds: int = 8,
        guard: str = "auto", device: str | None = None, policies: bool = True,
        rewrite: bool | str = True, progress: Callable[[str], None] | None = None,
        exhaustive: bool = False, time_limit: float | None = None, source_rewrites: bool = True) -> FitResult | MeshFitResult:
    """Rewrite `fn` to recompute values instead of holding them, until XLA runs it within `budget`.

    >>> import jax.numpy as jnp
    >>> def train_step(w, x):   # two tanh layers sharing w; one SGD step
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(jnp.tanh(x @ w) @ w).sum())(w)
    >>> params, batch = jnp.ones((256, 256)), jnp.ones((512, 256))
    >>> result = fit(train_step, params, batch, budget="2GiB")   # fits as written: nothing recomputed
    >>> result.fits, result.recomputed
    (True, [])
    >>> jax.jit(result.fn)(params, batch).shape
    (256, 256)

    Args:
        fn: a JAX-traceable function (typically a training step: forward and backward).
        *args: its example arguments (pytrees of arrays).
        budget: bytes (int), a size such as "2GiB", a share of the original's XLA total ("50%")
            or "half-temp" (XLA's arguments + outputs - aliases + half its temporaries), judged
            against XLA's total (argument + output + temp - alias) and jaxmem's planned peak.
        donate_argnums: positional arguments the caller donates, as for `jax.jit`.
        max_rounds: how many rewrites XLA compiles at most to find the cheapest that fits.
        guard: how recomputation is kept from being merged back by XLA: "cond", "barrier", or
            "auto" (cond on CPU, barrier elsewhere; barrier when judged by XLA:GPU).
        device: a GPU or TPU preset ("h100-80gb", "tpu-v5e-16gb"): every candidate is judged
            by XLA:GPU's or XLA:TPU's total, compiled deviceless (in this process where JAX
            runs with JAX_PLATFORMS=cpu; in a child where this process holds a GPU or TPU, as
            `jaxmem.analyze` compiles); None: XLA:CPU.
        policies: also judge `jax.checkpoint` policies on the scan bodies, the layers called
            from a Python loop and the differentiated function (`FitResult.policy`, `.policies`): an answer to paste into the user's code.
        rewrite: also run the rewriting search (`FitResult.fn`): True (the default), False
            (`fn` is the original), or "auto": only where no policy meets the budget (what
            `jaxmem fit` does).
        exhaustive: compile every policy alternative (else stop at the first that fits).
        time_limit: seconds for the whole fit, counted from its start: the policy search stops
            at half of it, the rewriting search at the end (given at least a quarter of it),
            each then answering with the best judged so far (None: no limit).
        progress: called with a short label before each XLA compile.
        source_rewrites: first rewrite the user's source where XLA's total drops, the values stay
            and the FLOPs stay within the cap (`fitting.rewrites`: max pools as strided slices
            and a pairwise max, an activation's small scaling factors multiplied together first,
            long attention in blocks of queries); every search then starts
            from what was kept (`FitResult.rewrites`).

    Returns:
        A `FitResult`; `fits=False` (not an exception) when the budget cannot be met, with
        `min_reachable_bytes` the smallest budget the rewrite reached. Where the arguments are
        sharded over a mesh, a `fitting.mesh.MeshFitResult` instead: the cheapest change (a
        policy, a layout, or both) that fits each device, judged per device for `device`.
    """
    on_mesh = _on_mesh(fn, args, budget, donate_argnums, device, progress, time_limit)
    if on_mesh is not None:
        return on_mesh
    started = time.perf_counter()
    judge_ = Judge(device)
    donate = donate_positions(len(args), donate_argnums)
    _check_plain(fn, args)
    if max_rounds < 1:
        raise ConfigError(f"max_rounds must be at least 1, got {max_rounds}")
    guard = "barrier" if device is not None and guard == "auto" else resolve_guard(guard)
    note = progress or (lambda label: None)
    graph = trace(fn, *args, donate_argnums=donate)  # first: a function that cannot trace is one PlanError line
    note("original")
    original = judge_.figures(fn, args, donate)
    job = _Job(fn, fn, args, donate, judge_, note, graph, original, resolve_budget(budget, original))
    if source_rewrites:
        _rewrite_source_first(job)
    _prove_infeasible(job)
    found = None
    if policies:
        # Half the time limit: the rewriting search after it must not be left without time.
        found = _search_policies(job, exhaustive,
                                 deadline=None if time_limit is None else started + float(time_limit) / 2)
    if rewrite == "auto":
        best_ = found.best if found is not None else None
        rewrite = not (best_ is not None and best_.xla_total_bytes is not None
                       and best_.xla_total_bytes <= job.budget)
    planned_before = _planned_peak(job.fn, args, donate)
    # One limit for both searches, the policy search held to its first half (above); the
    # rewrite gets at least a quarter of it even where the policy search overran its half.
    deadline = None if time_limit is None else max(started + float(time_limit),
                                                    time.perf_counter() + float(time_limit) / 4)
    rewrite_ran = bool(rewrite) and not (job.infeasible and not job.capped)
    snaps = search(job.graph, guard=guard) if rewrite_ran else [Snapshot(job.graph, 0, 0, [])]
    steps = _Steps(snaps, args, donate, judge_, job.budget, deadline, note,
                   judged={0: (job.base_total, planned_before)})
    chosen = _choose_step(steps, max_rounds, job.base_total)
    return _result(job, steps, chosen, found, guard, planned_before, rewrite_ran)


def _check_plain(fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """fit rewrites plain JAX steps: a framework's step (whose program fit's own trace would
    not be) is one line saying what to write instead; a plain step that updates its arguments
    in place, or leaks a traced value, is refused as `jaxmem.analyze` refuses it."""
    from jaxmem.frameworks import PURE_FORM, as_step, framework_of
    from jaxmem.frameworks.step import FRAMEWORK_NAMES

    kind = framework_of(fn, args)
    if kind != "jax":
        raise PlanError(f"jaxmem.fit rewrites plain JAX steps, not yet {FRAMEWORK_NAMES[kind]}'s: fit the same step "
                        f"written pure ({PURE_FORM[kind]}); jaxmem.analyze reads this one as it is")
    try:
        as_step(fn, args)
    except PlanError:
        raise
    except Exception:  # a function that fails to trace: fit's own trace says so, in its one line
        return


@dataclass
class _Job:
    """One `fit` call: the step every search starts from, how candidates are judged, the budget."""

    fn: Callable[..., Any]         # the user's step, or the last source rewrite's
    user_fn: Callable[..., Any]    # the user's step
    args: Sequence[Any]
    donate: tuple[int, ...]
    judge: Judge
    note: Callable[[str], None]
    graph: Graph                   # `fn` traced
    original: Figures              # XLA's figures for the user's step
    budget: int
    rewrites: list[SourceRewrite] = field(default_factory=list)
    infeasible: str | None = None  # the line that proves the budget infeasible
    capped: bool = False           # ... proven only within the FLOP cap: a rewrite above it may still fit

    @property
    def base_total(self) -> int:
        """XLA's total for `fn`: what every search starts from."""
        return self.rewrites[-1].xla_total_bytes if self.rewrites else self.original.total


def _rewrite_source_first(job: _Job) -> None:
    """Before any recompute: rewrites of the user's source that lower XLA's total (max pools
    whose gradient XLA expands into index arrays; a batch norm's factors, whose gradient XLA
    fuses beside the input gradient; long attention in blocks of queries), each judged and its
    values checked. Every search after it starts from what was kept; its lines print first."""
    job.rewrites = rewrite_first(job.fn, job.args, job.donate, job.judge, job.original.total,
                                 progress=lambda l: job.note(f"rewrite: {l}"))
    if job.rewrites:
        job.fn = job.rewrites[-1].fn
        job.graph = trace(job.fn, *job.args, donate_argnums=job.donate)


def _prove_infeasible(job: _Job) -> None:
    """Set `job.infeasible` where the budget is below the floor, or (XLA:GPU) below the bound
    over every remat and order."""
    floor, name = job.original.floor, job.judge.name
    job.infeasible = infeasible_line(job.budget, floor, name)
    if job.infeasible is None and is_gpu(job.judge.device):
        job.infeasible = verdict(job.fn, job.args, job.donate, job.budget, floor, name)
        if job.infeasible is None:
            job.infeasible = capped_verdict(job.fn, job.args, job.donate, job.budget, floor, name)
            job.capped = job.infeasible is not None


def _search_policies(job: _Job, exhaustive: bool, deadline: float | None) -> PolicySearch:
    """Every `jax.checkpoint` policy alternative on `job.fn`, judged."""
    rewrites, infeasible = job.rewrites, job.infeasible
    return search_policies(job.fn, job.args, donate=job.donate, judge=job.judge, budget=job.budget,
                           original_total=job.base_total, progress=lambda l: job.note(f"policy: {l}"),
                           offload_outside_loops=bool(infeasible) and WITHOUT_OFFLOAD in infeasible,
                           base_flops=rewrites[-1].flops - rewrites[-1].extra_flops if rewrites else None,
                           base_label=" and ".join(r.kind for r in rewrites) + " rewritten" if rewrites else "",
                           exhaustive=exhaustive, deadline=deadline)


def _result(job: _Job, steps: _Steps, chosen: int, found: PolicySearch | None, guard: str,
            planned_before: int, rewrite_ran: bool) -> FitResult:
    """The answer: the rewrite chosen, the policy to print, and every figure beside them."""
    graph, budget_bytes = job.graph, job.budget
    min_reachable = min(max(v) for v in steps.judged.values())
    snap = steps.lean.get(chosen, steps.snaps[chosen])
    xla_total, planned = steps.judged[chosen]
    original_flops = program_flops(graph)
    best = found.best if found is not None else None
    policy, code, policy_total = _policy_answer(best, job, snap, chosen, guard, xla_total)
    if found is not None:
        live = [c.xla_total_bytes for c in found.candidates if not c.error and c.xla_total_bytes is not None]
        min_reachable = min([min_reachable, *live])
    return FitResult(
        fn=job.fn if chosen == 0 else as_function(snap.graph),
        fits=xla_total <= budget_bytes and planned <= budget_bytes,
        budget_bytes=budget_bytes,
        planned_peak_bytes=planned,
        # "before" is the step as the user wrote it, as XLA's figure beside it is
        planned_peak_bytes_before=(_planned_peak(job.user_fn, job.args, job.donate) if job.rewrites
                                   else planned_before),
        xla_total_bytes=xla_total,
        xla_total_bytes_before=job.original.total,
        recompute_flops_ratio=snap.extra_flops / max(original_flops, 1),
        extra_flops=snap.extra_flops,
        original_flops=original_flops,
        recomputed=recomputed_values(graph, snap),
        min_reachable_bytes=min_reachable,
        policy=policy,
        policy_code=code,
        policy_xla_total_bytes=policy_total,
        rounds=steps.rounds,
        steps_considered=len(steps.snaps) - 1,
        original_fn=job.user_fn,
        judge=job.judge.name,
        device=job.judge.device,
        policies=found,
        policy_fits=policy_total is not None and policy_total <= budget_bytes,
        floor_bytes=job.original.floor,
        infeasible=job.infeasible,
        rewrite_ran=rewrite_ran,
        rewrite_skipped=("" if rewrite_ran else "the lower bound below holds for every rewrite too"
                         if job.infeasible and not job.capped
                         else "a policy meets the budget, or --policy-only; --rewrite runs it"),
        policy_fn=best.apply(job.fn) if best is not None else None,
        rewrites=job.rewrites,
    )


@dataclass
class _Steps:
    """The rewrites the search proposed (step 0: none), each judged by XLA and the planner at
    most once: `judged[i]` is (XLA's total, planned peak) of step i's best-judged form."""

    snaps: list[Snapshot]
    args: Sequence[Any]
    donate: tuple[int, ...]
    judge_: Judge
    budget: int
    deadline: float | None
    note: Callable[[str], None]
    judged: dict[int, tuple[int, int]]
    rounds: list[dict[str, int]] = field(default_factory=list)  # every candidate XLA judged
    lean: dict[int, Snapshot] = field(default_factory=dict)  # steps where the economized rewrite is the one judged

    def judge(self, i: int) -> tuple[int, int]:
        if i in self.judged:
            return self.judged[i]
        snaps, judged = self.snaps, self.judged
        # Merge groups into earlier ones that already run their nodes, where the model says
        # that costs no peak; XLA judges that rewrite first.
        merged, saved = economize(snaps[i].graph, snaps[i].peak)
        options = [(Snapshot(merged, snaps[i].peak, snaps[i].extra_flops - saved, snaps[i].groups), 1)
                   ] if saved else []
        for snap_i, is_merged in options + [(snaps[i], 0)]:
            f = as_function(snap_i.graph)
            self.note(f"rewrite step {i}")
            got = (self.judge_.total(f, self.args, self.donate), _planned_peak(f, self.args, self.donate))
            self.rounds.append({"step": i, "modelled_peak": snap_i.peak, "xla_total": got[0],
                                "planned_peak": got[1], "merged": is_merged})
            if i not in judged or max(got) < max(judged[i]):
                judged[i] = got
                if is_merged:
                    self.lean[i] = snap_i
                else:
                    self.lean.pop(i, None)
            # Merged groups hold values longer: where XLA disagrees with the model that this
            # is free, the rewrite before merging is judged too.
            if max(judged[i]) <= self.budget:
                break
        return judged[i]

    def passes(self, i: int) -> bool:
        if i not in self.judged and self.deadline is not None and time.perf_counter() > self.deadline:
            return False  # out of time: an unjudged rewrite is not taken
        xla_total, planned = self.judge(i)
        return xla_total <= self.budget and planned <= self.budget


def _choose_step(steps: _Steps, max_rounds: int, base_total: int) -> int:
    """The first step that passes, found in at most `max_rounds` compiles; when none passes,
    the one closest to the budget."""
    snaps, judged, budget_bytes, passes = steps.snaps, steps.judged, steps.budget, steps.passes
    last = len(snaps) - 1
    if passes(0):
        return 0
    if last == 0 or not passes(last):
        # XLA's total is not monotone in the model's peak near the end of the search: judge a
        # few rewrites spread over the later half too, and keep the smallest.
        spread = max_rounds - (len(judged) - 1)
        for k in range(1, spread + 1):
            i = last // 2 + (last - last // 2) * k // (spread + 1)
            if 0 < i < last and passes(i):
                break
        fitting = [i for i in judged if max(judged[i]) <= budget_bytes]
        return min(fitting) if fitting else min(judged, key=lambda i: (max(judged[i]), i))
    # Bisect for the first rewrite that passes, starting where the model, scaled by how
    # XLA's total relates to it on the original, says the budget is met.
    lo, hi = 0, last
    scale = base_total / max(snaps[0].peak, 1)
    guess = next((i for i, s in enumerate(snaps) if s.peak * scale <= budget_bytes), last)
    probe = min(max(guess, lo + 1), hi - 1) if hi - lo > 1 else None
    while probe is not None and len(judged) - 1 < max_rounds:
        if passes(probe):
            hi = probe
        else:
            lo = probe
        probe = (lo + hi) // 2 if hi - lo > 1 else None
    return hi


def _policy_answer(best: PolicyCandidate | None, job: _Job, snap: Snapshot, chosen: int, guard: str,
                   xla_total: int) -> tuple[str, str, int | None]:
    """(the policy to print, how to write it, XLA's total for it)."""
    if best is not None:
        # The policy answer: applied to the user's code as printed, measured by the judge.
        policy, code, policy_total = best.policy, best.code, best.xla_total_bytes
        if best.policy == "none":
            policy = "everything_saveable"
        return policy, code, policy_total
    # The dots_saveable figure: the same search, never recomputing a matmul, run to its end.
    dots_snaps = search(job.graph, guard=guard, matmul=False) if chosen else []
    if len(dots_snaps) > 1:
        job.note("dots_saveable rewrite")
    dots_total = (job.judge.total(as_function(dots_snaps[-1].graph), job.args, job.donate)
                  if len(dots_snaps) > 1 else job.base_total)
    policy, code = _policy(snap, job.graph, dots_total, job.budget)
    policy_total = {"everything_saveable": job.base_total, "dots_saveable": dots_total}.get(policy, xla_total)
    return policy, code, policy_total


__all__ = ["fit", "FitResult", "RecomputedValue"]
