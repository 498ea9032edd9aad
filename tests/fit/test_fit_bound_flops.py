"""Issue 12: the FLOP-capped lower bound (`fitting.bound.flop_lower_bound`): over every
`jax.checkpoint` policy and order that adds at most +15% FLOPs (counted on the jaxpr, as fit
counts them), XLA:GPU's total stays at or above it. Checked against XLA:GPU's own totals
(deviceless memory_analysis()) of policies and reorderings of three steps, against every XLA:GPU
total recorded in `benchmarks/results/*.jsonl` within the cap, and its knapsack against brute
force. On mlp_train_donated it proves the issue's half-temp budget infeasible within the cap,
and fit prints that line."""

from __future__ import annotations

import itertools
import random

import pytest

CAP = 0.15

CHILD = r"""
import json, sys
sys.path.insert(0, "{tests}")
from bound_programs import attention_lm, deep_mlp
from jaxmem.compiler.costs import jaxpr_flops
from jaxmem.compiler.jaxpr_adapter import trace
from jaxmem.errors import ConfigError
from jaxmem.examples.suite import ALL_PROGRAMS
from jaxmem.fitting.bound import flop_lower_bound, infeasible_line, lower_bound
from jaxmem.fitting.judge import Judge
from jaxmem.fitting.policy import with_policy
from jaxmem.fitting.reorder import ORDERS, reordered

judge = Judge("h100-80gb")
mlp = ALL_PROGRAMS["mlp_train_donated"]
programs = {{"mlp_train_donated": (mlp.factory(), mlp.donate_argnums), "deep_mlp donated": (deep_mlp(), (0, 1)),
            "attention_lm donated": (attention_lm(), (0, 1))}}
programs = {{k: v for k, v in programs.items() if k in {names!r}}}
FULL = {full!r}

def flops(f, args):
    return jaxpr_flops(trace(f, tuple(args), {{}}, ()).closed_jaxpr.jaxpr)

out = {{}}
for name, ((fn, args), donate) in programs.items():
    figures = judge.figures(fn, args, donate)
    capped = flop_lower_bound(fn, args, donate, figures.floor)
    plain = lower_bound(fn, args, donate, figures.floor)
    base = flops(fn, args)
    variants = {{"original": fn}}
    for policy in ("nothing_saveable", "dots_with_no_batch_dims_saveable")[:2 if FULL else 0]:
        variants[policy + " on loop"] = with_policy(fn, policy, ("loop",))
    for k in (1, 2)[:2 if FULL else 1]:   # part of the layers recomputed: within the cap or just above it
        variants[f"nothing_saveable on the first {{k}}"] = with_policy(fn, "nothing_saveable", ("loop",), first=k)
    if FULL:
        variants["nothing_saveable on loop but the last"] = with_policy(fn, "nothing_saveable", ("loop",), but_last=True)
    for order in ORDERS[:2] if FULL else ["cpu plan order"]:
        try:
            variants[order] = reordered(fn, *args, order=order, donate_argnums=donate, device="h100-80gb")
        except ConfigError:  # an order this step's plans do not give
            pass
    rows = {{}}
    for label, f in variants.items():
        rows[label] = (judge.total(f, args, donate), (flops(f, args) - base) / base)
        print(name, label, rows[label], file=sys.stderr, flush=True)
    out[name] = {{"floor": figures.floor, "budget": figures.half_temp, "capped": capped.bytes,
                 "plain": plain.bytes, "line": capped.describe(), "rows": rows,
                 "infeasible": infeasible_line(figures.half_temp, capped, judge.name)}}
from jaxmem.fitting.fit import fit
fn, args = programs["mlp_train_donated"][0]
result = fit(fn, *args, budget="half-temp", donate_argnums=(0, 1), device="h100-80gb", policies=False, rewrite=False)
out["fit"] = {{"infeasible": result.infeasible, "budget": result.budget_bytes}}
print(json.dumps(out))
"""


def _child(names: list[str], full: bool) -> str:
    """The child script over `names`, each in every variant (`full`) or in the three closest to
    its budget."""
    return CHILD.replace("{names!r}", repr(names)).replace("{full!r}", repr(full))


def _check(got: dict, least_within: int) -> None:
    verdict = got.pop("fit")
    within = 0
    for name, r in got.items():
        for label, (total, extra) in r["rows"].items():
            if extra <= CAP:
                within += 1
                assert r["capped"] <= total, (name, label, r["capped"], total, extra, r["line"])
        # It counts more than the floor on each: GEMM results held across the pivot.
        assert r["capped"] > r["floor"], (name, r["line"])
    # Each step has, besides the original, a policy recomputing part of it within the cap.
    assert within >= least_within
    mlp = got["mlp_train_donated"]
    # The FLOP term is what proves mlp_train_donated: the bound over every policy stays below
    # its budget, the capped one goes above; and no variant XLA measured within the cap meets it.
    assert mlp["plain"] <= mlp["budget"] < mlp["capped"]
    assert all(total > mlp["budget"] for total, extra in mlp["rows"].values() if extra <= CAP)
    assert "without host offload, or order, with at most +15% FLOPs" in mlp["infeasible"]
    assert verdict["budget"] == mlp["budget"] and verdict["infeasible"] == mlp["infeasible"]


@pytest.mark.slow
def test_the_capped_bound_proves_mlp_train_donated_below_what_xla_gpu_gives_within_the_cap(run_gpu_script):
    """The proof itself, against the variants closest to the budget: the original, a policy on the
    first layer (+7%), and jaxmem's CPU plan order (the least measured within the cap)."""
    _check(run_gpu_script(_child(["mlp_train_donated"], full=False)), 3)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_capped_bound_never_exceeds_xla_gpu_totals_within_the_cap(run_gpu_script):
    """Three steps, each in up to eight variants (about 5 minutes of XLA:GPU compiles)."""
    _check(run_gpu_script(_child(["mlp_train_donated", "deep_mlp donated", "attention_lm donated"], full=True)), 3 * 3)


def _recorded() -> dict[str, dict[str, object]]:
    """Per suite program: every recorded XLA:GPU total with its extra FLOPs, its floor and budget."""
    from bound_programs import recorded_xla_gpu_rows

    rows: dict[str, dict[str, object]] = {}
    for r in recorded_xla_gpu_rows():
        totals = [(r["original"], 0.0)]
        for key in ("checkpoint", "dots_no_batch", "nothing", "policy", "rewrite"):
            total = r.get(key if key in ("checkpoint", "dots_no_batch", "nothing") else f"{key}_total")
            extra = r.get(f"{key}_flops")
            if isinstance(total, int) and isinstance(extra, float):
                totals.append((total, extra))
        e = rows.setdefault(r["program"], {"totals": [], "floor": None, "budget": r["budget"]})
        e["totals"] += totals
        e["floor"] = e["floor"] or r.get("floor")
    return rows


@pytest.mark.slow
def test_the_capped_bound_is_below_every_recorded_xla_gpu_total_within_the_cap():
    from jaxmem.examples.suite import ALL_PROGRAMS
    from jaxmem.fitting.bound import flop_lower_bound

    rows = {k: v for k, v in _recorded().items() if k in ALL_PROGRAMS}
    assert len(rows) >= 15
    proven = []
    for name, r in rows.items():
        program = ALL_PROGRAMS[name]
        fn, args = program.factory()
        bound = flop_lower_bound(fn, args, program.donate_argnums, r["floor"])
        if bound is None:  # a step that already recomputes: no FLOP floor for its variants
            continue
        for total, extra in r["totals"]:
            if extra <= CAP:
                assert bound.bytes <= total, (name, bound.bytes, total, extra, bound.describe())
        if bound.bytes > r["budget"]:
            proven.append(name)
    assert "mlp_train_donated" in proven


def _brute_least_held(items: list[tuple[int, float]], allowance: float, free: list[int]) -> int:
    """Every subset recomputed within the allowance, every assignment of the rest to free
    allocations (one buffer each, whole, no larger): the fewest bytes left."""
    best = None
    n = len(items)
    for mask in range(1 << n):
        if sum(items[k][1] for k in range(n) if mask >> k & 1) > allowance:
            continue
        rest = [items[k][0] for k in range(n) if not mask >> k & 1]
        least = sum(rest)
        for slots in itertools.product(range(len(free) + 1), repeat=len(rest)):
            used = [s for s in slots if s < len(free)]
            if len(used) != len(set(used)) or any(s < len(free) and rest[i] > free[s] for i, s in enumerate(slots)):
                continue
            least = min(least, sum(b for b, s in zip(rest, slots) if s == len(free)))
        best = least if best is None else min(best, least)
    return best


def test_least_held_matches_brute_force():
    from jaxmem.fitting.bound import _least_held

    rng = random.Random(7)
    for _ in range(150):
        items = [(rng.choice([1, 2, 4, 8]), float(rng.choice([1, 2, 3, float("inf")]))) for _ in range(rng.randint(0, 5))]
        free = [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(0, 2))]
        allowance = float(rng.randint(0, 6))
        assert _least_held(items, allowance, free) == _brute_least_held(items, allowance, free), (items, allowance, free)
