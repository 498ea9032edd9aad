"""Issue 12: the lower bound's later terms (`fitting.bound`): free argument/output allocations
take a buffer only whole and no larger, and two GEMMs read by one later op hold the later one's
result beside a value made from the other's. Sound: never above XLA:GPU's own total (deviceless
memory_analysis()) of any `jax.checkpoint` policy or reordering of the step measured here, nor
above any XLA:GPU total recorded in `benchmarks/results/*.jsonl`."""

from __future__ import annotations

import pytest

CHILD = r"""
import json, sys
sys.path.insert(0, "{tests}")
from bound_programs import attention_lm, deep_mlp
from jaxmem.fitting.bound import lower_bound
from jaxmem.fitting.judge import Judge
from jaxmem.fitting.policy import with_policy
from jaxmem.errors import ConfigError
from jaxmem.fitting.reorder import ORDERS, reordered

judge = Judge("h100-80gb")
programs = {{"attention_lm donated": (attention_lm(), (0, 1)), "attention_lm": (attention_lm(), ()),
            "deep_mlp": (deep_mlp(), ())}}
FULL = {full!r}
out = {{}}
for name, ((fn, args), donate) in programs.items():
    figures = judge.figures(fn, args, donate)
    bound = lower_bound(fn, args, donate, figures.floor)
    variants = {{"original": fn}}
    for policy in ("nothing_saveable", "dots_with_no_batch_dims_saveable")[:2 if FULL else 1]:
        variants[policy + " on loop"] = with_policy(fn, policy, ("loop",))
    if FULL:
        variants["nothing_saveable on loop but the last"] = with_policy(fn, "nothing_saveable", ("loop",), but_last=True)
    for order in ORDERS[:2] if FULL else ():   # the two plans' orders (constants tied alone changes little)
        try:
            variants[order] = reordered(fn, *args, order=order, donate_argnums=donate, device="h100-80gb")
        except ConfigError:  # an order this step's plans do not give
            pass
    totals = {{}}
    for label, f in variants.items():
        totals[label] = judge.total(f, args, donate)
        print(name, label, totals[label], file=sys.stderr, flush=True)
    out[name] = {{"floor": figures.floor, "bound": bound.bytes, "line": bound.describe(),
                 "held": bound.held_bytes, "totals": totals}}
print(json.dumps(out))
"""


@pytest.mark.slow  # benchmark-sized: XLA compiles of whole steps; in the slow pass
def test_the_tighter_bound_never_exceeds_xla_gpu_totals_of_the_original_and_nothing_saveable(run_gpu_script):
    """Each step as written and with `nothing_saveable` on its layers (six XLA:GPU compiles)."""
    _check(run_gpu_script(CHILD.replace("{full!r}", "False")))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_tighter_bound_never_exceeds_xla_gpu_totals_of_policies_and_orders(run_gpu_script):
    """Each step in up to six variants: policies and jaxmem's plan orders (about 17 compiles)."""
    _check(run_gpu_script(CHILD.replace("{full!r}", "True")))


def _check(got: dict) -> None:
    for name, r in got.items():
        for label, total in r["totals"].items():
            assert r["bound"] <= total, (name, label, r["bound"], total, r["line"])
    # The pair term sets the attention steps' bound: the softmax backward reads the scores'
    # GEMM and the incoming gradient's GEMM, each [1, 2, 512, 512] f32 (2 MiB).
    for name in ("attention_lm donated", "attention_lm"):
        assert "reads both dot_general" in got[name]["line"], got[name]["line"]
        assert got[name]["bound"] >= got[name]["floor"] + 2 * 2 ** 20
    # Not donated, deep_mlp's free output allocations are [512, 512] f32 (1 MiB): a GEMM's
    # [1024, 512] result and operand (2 MiB each) fit in none, so the bound leaves the floor.
    assert got["deep_mlp"]["bound"] >= got["deep_mlp"]["floor"] + 4 * 2 ** 20


def _recorded() -> dict[str, dict[str, int]]:
    """Per suite program: its smallest XLA:GPU total over every recorded candidate, and its floor."""
    from bound_programs import recorded_xla_gpu_rows

    rows: dict[str, dict[str, int]] = {}
    keys = ("original", "checkpoint", "dots_no_batch", "nothing", "policy_total", "rewrite_total")
    for r in recorded_xla_gpu_rows():
        totals = [r[k] for k in keys if isinstance(r.get(k), int)]
        e = rows.setdefault(r["program"], {"min": min(totals), "floor": r.get("floor")})
        e["min"] = min(e["min"], *totals)
        e["floor"] = e["floor"] or r.get("floor")
    return rows


@pytest.mark.slow
def test_the_bound_is_below_every_recorded_xla_gpu_total():
    from jaxmem.examples.suite import ALL_PROGRAMS
    from jaxmem.fitting.bound import lower_bound

    rows = {k: v for k, v in _recorded().items() if k in ALL_PROGRAMS}
    assert len(rows) >= 15
    for name, r in rows.items():
        program = ALL_PROGRAMS[name]
        fn, args = program.factory()
        bound = lower_bound(fn, args, program.donate_argnums, r["floor"])
        assert bound.bytes <= r["min"], (name, bound.bytes, r["min"], bound.describe())
