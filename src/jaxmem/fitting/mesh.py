"""`jaxmem.fit` on a mesh: the cheapest change that makes a sharded step fit every device, judged by
XLA's per-device compile for the topology (compile-only GPUs or TPU chips, deviceless).

The changes it compiles, each beside XLA's per-device total, the FLOPs it adds per step and the
bytes per step its collectives carry (`xla.sharding.collectives`):

- a `jax.checkpoint` policy on the step's scanned or looped layers (offload to pinned host memory
  included), found by the one-device policy search (`fitting.policy`) with this module's judge;
- a standard layout (`xla.sharding.layout_specs`: replicated data parallel, FSDP, FSDP + tensor
  parallel) on meshes of the same device count, as written and, where none fits alone, with the
  policy search run again under the layout that came closest.

Every row is the program the printed code makes (a policy re-traces the user's step with exactly
that `jax.checkpoint`; a layout's code builds exactly `layout_specs`' shardings), so the answer
compiles within the budget as printed. Among those that fit, the answer adds the fewest FLOPs
(ties: the fewest collective bytes); where another one that fits carries fewer collective bytes,
it is named too: which one is cheaper in time depends on the machine's FLOPs and links, which
jaxmem does not guess.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jaxmem.errors import ConfigError, ShardingError
from jaxmem.fitting.judge import Figures, Judge, resolve_budget
from jaxmem.units import format_size

TP_SIZES = (2, 4, 8)   # "model" axis sizes tried for FSDP + tensor parallel (within one host's chips)


@dataclass
class Compiled:
    """One per-device compile: XLA's figures, the collectives' bytes per step (None: unknown) and
    whether it came from the cache; `refused` is XLA:TPU's line where it would not compile it."""

    figures: Figures
    collective_bytes: int | None
    cached: bool
    refused: str = ""


class MeshJudge(Judge):
    """XLA's per-device figures of a step whose arguments are sharded over a mesh: the step traced
    over an `AbstractMesh` of the arguments' axes (or of `mesh` under `layout`) and compiled
    per device for `device`'s topology in a child (`api.sharded.reference_of_traced`). A
    per-chip program XLA:TPU refuses counts as the bytes its message asks for."""

    def __init__(self, device: str, mesh: str | None = None, layout: str | None = None):
        super().__init__(device)
        if self.accelerator is None:
            raise ConfigError("fit on a mesh needs a GPU or TPU preset as --device")
        self.mesh, self.layout = mesh, layout
        self.cached = 0
        self.last: Compiled | None = None
        self.refusals: set[int] = set()   # totals XLA:TPU's refusals asked for (not cached)
        self.on_compiled: Callable[[Compiled], None] = lambda compiled: None

    @property
    def name(self) -> str:
        return f"{self.accelerator.xla_name} {self.device} per device"

    def figures(self, fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int]) -> Figures:
        return self.compiled(fn, args, donate).figures

    def compiled(self, fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int]) -> Compiled:
        from jaxmem.xla.sharding.lowered import reference_of_traced, trace_on_mesh
        from jaxmem.xla.sharding.collectives import from_json
        from jaxmem.xla.tpu.compile import required_bytes

        traced = trace_on_mesh(fn, args, donate_argnums=tuple(donate), mesh=self.mesh, layout=self.layout)
        kind = "tpu" if self.accelerator.is_tpu else "gpu"
        try:
            ref = reference_of_traced(traced, xla=kind, device=self.device, top=0)
        except ShardingError as err:
            if "does not fit" not in str(err):
                raise
            cached = bool(getattr(err, "cached", False))
            self.cached += int(cached)
            self.compiles += int(not cached)
            needed = required_bytes(str(err)) or 2 * self.accelerator.capacity_bytes
            self.last = Compiled(Figures(0, 0, needed, 0), None, cached, str(err))
            self.refusals.add(needed)
            self.on_compiled(self.last)
            return self.last
        cached = bool(ref.get("cached"))
        if cached:
            self.cached += 1
        else:
            self.compiles += 1
        x = ref["xla"]
        moved = from_json(ref.get("collectives"))
        figures = Figures(int(x["argument_bytes"]), int(x["output_bytes"]), int(x["temp_bytes"]), int(x["alias_bytes"]))
        self.last = Compiled(figures, moved.total if moved is not None else None, cached)
        self.on_compiled(self.last)
        return self.last


@dataclass
class MeshCandidate:
    """One change compiled: what it is, the code that makes it, and what XLA measured per device."""

    label: str                 # "as written", "dots_saveable on the lax.scan body (model.py:31)", ...
    code: str                  # what to paste ("" for as written)
    total_bytes: int           # XLA's per-device total (or what its refusal asked for)
    extra_flops: int           # per step, over the whole mesh, against the step as written
    flops: int                 # the step as written's FLOPs (for the ratio)
    collective_bytes: int | None   # per device per step
    fits: bool
    layout: str | None = None  # the standard layout, or None (the step's own shardings)
    mesh: dict[str, int] | None = None
    policy: Any = None         # fitting.policy.PolicyCandidate, or None
    refused: str = ""

    @property
    def extra_flops_ratio(self) -> float:
        return self.extra_flops / self.flops if self.flops else 0.0


@dataclass
class MeshFitResult:
    """What `fit` found for a step on a mesh. `best` is the cheapest change that fits (None where
    none does: `closest` is then the lowest compiled)."""

    device: str
    judge: str
    mesh: dict[str, int]
    budget_bytes: int
    before: MeshCandidate
    candidates: list[MeshCandidate] = field(default_factory=list)
    best: MeshCandidate | None = None
    fewer_collectives: MeshCandidate | None = None   # fits, adds more FLOPs, carries fewer bytes
    compiles: int = 0
    cached: int = 0
    seconds: float = 0.0
    left_out: list[str] = field(default_factory=list)  # what was not tried, and why

    @property
    def fits(self) -> bool:
        return self.before.fits or self.best is not None

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def closest(self) -> MeshCandidate:
        return min([self.before] + self.candidates, key=lambda c: (c.total_bytes, c.extra_flops))

    def text(self) -> str:
        """The table and the answer, as `jaxmem fit` prints them."""
        from jaxmem.fitting.mesh_text import render

        return render(self)


def fit_on_mesh(fn: Callable[..., Any], args: Sequence[Any], *, budget: int | str, device: str,
                donate: Sequence[int] = (), progress: Callable[[str], None] | None = None,
                time_limit: float | None = 600.0, layouts: bool = True) -> MeshFitResult:
    """The cheapest change that makes `fn(*args)` (its arguments sharded over a mesh) fit each
    device within `budget`, per device (see the module's docstring).

    Args:
        fn, args, donate: the step, its sharded arguments (arrays or `ShapeDtypeStruct`s with
            `NamedSharding`s, concrete or `AbstractMesh`) and donated positions.
        budget: bytes per device, a size, a preset, a share of the step's own total or "half-temp".
        device: the GPU or TPU preset each device is.
        progress: called with a short label before each compile.
        time_limit: seconds for the whole search (None: no limit); what was left is listed.
        layouts: also compile the standard layouts on meshes of the same device count.
    """
    from jaxmem.xla.sharding import find_mesh

    started = time.perf_counter()
    deadline = None if time_limit is None else started + time_limit
    lowest: list[int] = []

    def seen(compiled: Compiled) -> None:
        lowest[:] = [min(lowest + [compiled.figures.total])]

    def note(label: str) -> None:
        if progress is not None:
            so_far = f" (lowest so far {format_size(lowest[0])} per device)" if lowest else ""
            progress(f"compiling {label}{so_far}")
    found = find_mesh(args)
    if found is None:
        raise ConfigError("fit on a mesh needs arguments sharded over a mesh (NamedSharding)")
    sizes = dict(zip(found[1], found[0]))
    fn, donate = _plain(fn, args, donate)
    judge = MeshJudge(device)
    judge.on_compiled = seen
    note("the step as written")
    first = judge.compiled(fn, args, donate)
    budget_bytes = resolve_budget(budget, first.figures)
    flops = _flops(fn, args)
    before = _row("as written", "", first, 0, flops, budget_bytes, None, sizes)
    result = MeshFitResult(device, judge.name, sizes, budget_bytes, before)
    judges = [judge]
    if not before.fits:
        result.candidates += _policies(fn, args, donate, judge, budget_bytes, flops, sizes, None, note, deadline, result)
        if layouts:
            _layouts(fn, args, donate, device, budget_bytes, flops, sizes, note, deadline, result, judges)
    result.compiles = sum(j.compiles for j in judges)
    result.cached = sum(j.cached for j in judges)
    _choose(result)
    result.seconds = time.perf_counter() - started
    return result


def _plain(fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int]) -> tuple[Callable[..., Any], tuple[int, ...]]:
    """The function a `jax.jit` wrapper wraps (each candidate re-traces it: a jitted function's
    trace is cached, and the policy search must see every call its sites make), with the
    wrapper's donation where none is given."""
    from jaxmem.compiler.target import jit_donation

    donate = tuple(donate) or tuple(jit_donation(fn, tuple(args)))
    info = getattr(fn, "_jit_info", None)
    if hasattr(fn, "lower") and hasattr(fn, "__wrapped__") and not getattr(info, "static_argnums", ()) \
            and not getattr(info, "static_argnames", ()):
        fn = fn.__wrapped__
    return fn, donate


def _row(label: str, code: str, compiled: Compiled, extra: int, flops: int, budget: int, policy: Any,
         mesh: dict[str, int], layout: str | None = None) -> MeshCandidate:
    total = compiled.figures.total
    return MeshCandidate(label, code, total, extra, flops, compiled.collective_bytes,
                         not compiled.refused and total <= budget, layout, mesh, policy, compiled.refused)


def _policies(fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int], judge: MeshJudge, budget: int,
              flops: int, sizes: dict[str, int], layout: str | None, note: Callable[[str], None],
              deadline: float | None, result: MeshFitResult) -> list[MeshCandidate]:
    """The policy search under `judge`, each compiled alternative as a row (its collectives read
    back from the compile cache)."""
    from jaxmem.fitting.policy import search_policies

    where = f" under {layout}" if layout else ""
    policy_deadline = None if deadline is None else time.perf_counter() + max(1.0, (deadline - time.perf_counter()) / 2)
    # Offload to host memory costs host transfers each step that FLOPs do not count: tried only
    # where no policy that keeps the values on the device fits (those compiles come from the cache).
    candidates: list[Any] = []
    for offload in (False, True):
        found = search_policies(fn, args, donate=donate, judge=judge, budget=budget, offload=offload, reorder=False,
                                progress=lambda label: note(f"{label}{where}"), deadline=policy_deadline)
        seen = {(c.policy, c.kind, tuple(c.keys or ()), c.but_last, c.first, c.rest, c.grouped) for c in candidates}
        candidates += [c for c in found.candidates
                       if (c.policy, c.kind, tuple(c.keys or ()), c.but_last, c.first, c.rest, c.grouped) not in seen]
        if found.best is not None and found.best.xla_total_bytes is not None and found.best.xla_total_bytes <= budget:
            break
    rows = []
    for cand in candidates:
        if cand.policy == "none" or cand.xla_total_bytes is None:
            if cand.error:
                result.left_out.append(f"{cand.policy} on {cand.kind}{where}: {cand.error}")
            continue
        if cand.xla_total_bytes in judge.refusals:
            compiled = Compiled(Figures(0, 0, cand.xla_total_bytes, 0), None, False, "XLA:TPU refused it")
        else:
            compiled = judge.compiled(cand.apply(fn), args, donate)   # from the cache: its collectives
            judge.cached -= int(compiled.cached)
        label = f"{cand.policy} on the {_site_words(cand)}{cand.where}"
        rows.append(_row(label, cand.code, compiled, max(0, cand.flops - flops), flops, budget, cand,
                         dict(sizes) if layout is None else _mesh_of(judge.mesh), layout))
    return rows


def _site_words(cand: Any) -> str:
    if getattr(cand, "micro_batches", 0):
        return "gradient call" + (f" ({cand.sites[0].call.file.rsplit('/', 1)[-1]}:{cand.sites[0].call.line})"
                                  if cand.sites else "")
    kinds = {"scan": "lax.scan body", "loop": "loop of layers", "layer": "layer", "grad": "differentiated function",
             "own": "jax.checkpoint"}
    lines = sorted({f"{s.call.file.rsplit('/', 1)[-1]}:{s.call.line}" for s in cand.sites})
    return kinds.get(cand.kind, cand.kind) + (f" ({', '.join(lines[:2])})" if lines else "")


def _meshes(devices: int) -> list[tuple[str, str]]:
    """(layout, mesh text) pairs of the standard layouts on `devices` devices."""
    out = [("dp", str(devices)), ("fsdp", str(devices))]
    out += [("fsdp_tp", f"{devices // m}x{m}") for m in TP_SIZES if devices % m == 0 and devices // m >= 1]
    return out


def _mesh_of(text: str | None) -> dict[str, int]:
    parts = [int(p) for p in (text or "").split("x") if p]
    return dict(zip(("data", "model"), parts))


def _layouts(fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int], device: str, budget: int, flops: int,
             sizes: dict[str, int], note: Callable[[str], None], deadline: float | None, result: MeshFitResult,
             judges: list[MeshJudge]) -> None:
    """Each standard layout as written; where none fits (nor any policy), the policy search
    again under the layout that came closest."""
    from jaxmem.fitting.layout_code import layout_code
    from jaxmem.xla.sharding import LAYOUT_NAMES

    rows = []
    for layout, mesh in _meshes(math.prod(sizes.values())):
        if deadline is not None and time.perf_counter() > deadline:
            result.left_out.append(f"{LAYOUT_NAMES[layout]} on {mesh}: out of time")
            continue
        judge = MeshJudge(device, mesh=mesh, layout=layout)
        judge.on_compiled = judges[0].on_compiled
        judges.append(judge)
        note(f"{LAYOUT_NAMES[layout]} on a {mesh} mesh")
        try:
            compiled = judge.compiled(fn, args, donate)
        except ShardingError as err:
            result.left_out.append(f"{LAYOUT_NAMES[layout]} on {mesh}: {err}")
            continue
        rows.append(_row(f"{LAYOUT_NAMES[layout]} on a {mesh} mesh", layout_code(layout, _mesh_of(mesh)), compiled,
                         0, flops, budget, None, _mesh_of(mesh), layout))
    result.candidates += rows
    if any(c.fits for c in result.candidates) or not rows:
        return
    closest = min(rows, key=lambda c: c.total_bytes)
    if deadline is not None and time.perf_counter() > deadline:
        result.left_out.append(f"policies under {LAYOUT_NAMES[closest.layout]}: out of time")
        return
    mesh_text = "x".join(str(v) for v in closest.mesh.values())
    judge = MeshJudge(device, mesh=mesh_text, layout=closest.layout)
    judge.on_compiled = judges[0].on_compiled
    judges.append(judge)
    for row in _policies(fn, args, donate, judge, budget, flops, sizes, closest.layout, note, deadline, result):
        row.label = f"{closest.label}, {row.label}"
        row.code = closest.code + "\n" + row.code
        result.candidates.append(row)


def _choose(result: MeshFitResult) -> None:
    fitting = [c for c in result.candidates if c.fits]
    if not fitting or result.before.fits:
        return
    moved = lambda c: c.collective_bytes if c.collective_bytes is not None else math.inf  # noqa: E731
    result.best = min(fitting, key=lambda c: (c.extra_flops, moved(c), c.total_bytes))
    fewer = min(fitting, key=lambda c: (moved(c), c.extra_flops))
    if fewer is not result.best and moved(fewer) < moved(result.best):
        result.fewer_collectives = fewer


def _flops(fn: Callable[..., Any], args: Sequence[Any]) -> int:
    from jaxmem.fitting.policy import _flops as traced_flops

    return traced_flops(fn, args)


def summary(result: MeshFitResult) -> dict[str, Any]:
    """`jaxmem fit --json`'s object for a step on a mesh."""
    def row(c: MeshCandidate) -> dict[str, Any]:
        return {"change": c.label, "code": c.code, "xla_total_bytes_per_device": c.total_bytes,
                "extra_flops": c.extra_flops, "extra_flops_ratio": c.extra_flops_ratio,
                "collective_bytes_per_device": c.collective_bytes, "fits": c.fits, "layout": c.layout,
                "mesh": c.mesh, "refused": c.refused or None}

    return {"fits": result.fits, "device": result.device, "judge": result.judge, "mesh": result.mesh,
            "devices": result.devices, "budget_bytes": result.budget_bytes, "before": row(result.before),
            "answer": row(result.best) if result.best else None,
            "fewer_collectives": row(result.fewer_collectives) if result.fewer_collectives else None,
            "candidates": [row(c) for c in result.candidates], "compiles": result.compiles,
            "cached": result.cached, "seconds": result.seconds, "left_out": result.left_out}


__all__ = ["MeshJudge", "MeshCandidate", "MeshFitResult", "fit_on_mesh", "summary"]
