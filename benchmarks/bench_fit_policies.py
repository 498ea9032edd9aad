"""jax.checkpoint policies and jaxmem.fit at the half-temp budget, judged by XLA:GPU and XLA:CPU.

For each training step: XLA's total (argument + output + temp - alias, its own
memory_analysis()) for the original; `jax.checkpoint` (default policy) on every layer: each
scan body, else each iteration of the layer loop, else each function called once per layer,
else the differentiated function; `dots_with_no_batch_dims_saveable` and `nothing_saveable` on
the same sites; then `jaxmem.fit(..., budget="half-temp")`: its policy answer and (unless
`--policy-only`) its rewrite, with extra FLOPs (counted on the jaxpr) and whether the values
equal the original's (run here with jax.jit on CPU). XLA:GPU compiles are deviceless
(JAX_PLATFORMS=cpu).

    .venv/bin/python benchmarks/bench_fit_policies.py scanned_transformer_train cnn_train --out results.jsonl
    .venv/bin/python benchmarks/bench_fit_policies.py transformer_train --device h100-80gb --policy-only
    .venv/bin/python benchmarks/bench_fit_policies.py --table results.jsonl
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: deviceless XLA:GPU compiles

import argparse
import json
import sys
import time
from typing import Any

import jax

from jaxmem.fitting.fit import fit
from jaxmem.examples.suite import ALL_PROGRAMS
from jaxmem.fitting.judge import Judge, compute_dtype, values_equal
from jaxmem.fitting.policy import _flops, find_sites, with_policy

DEFAULT = ["scanned_transformer_train", "transformer_train", "cnn_train", "convnet_bn_train", "moe_train"]
MiB = 2 ** 20




def run(name: str, device: str | None, rounds: int, policy_only: bool = False) -> dict[str, Any]:
    prog = ALL_PROGRAMS[name]
    fn, args = prog.factory()
    donate = prog.donate_argnums
    judge = Judge(device)
    started = time.perf_counter()
    sites = find_sites(fn, args)
    kind = next((k for k in ("scan", "loop", "layer", "grad") if any(s.kind == k for s in sites)), "grad")
    result = fit(fn, *args, budget="half-temp", donate_argnums=donate, device=device, max_rounds=rounds,
                 rewrite=not policy_only, exhaustive=False)
    found = result.policies
    base_flops = found.candidates[0].flops - found.candidates[0].extra_flops   # the step as written
    compared: dict[str, tuple[Any, Any]] = {}
    for policy in ("default", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
        done = next((c for c in found.candidates
                     if (c.kind, c.policy, c.keys, c.but_last, c.first, c.order) == (kind, policy, None, False, 0, "")
                     and not c.error and c.xla_total_bytes is not None), None)
        if done is not None and not result.rewrites:   # else fit's candidates start from its source rewrites
            compared[policy] = (done.xla_total_bytes, done.extra_flops_ratio)
            continue
        cand = with_policy(fn, policy, (kind,))
        try:
            compared[policy] = (judge.total(cand, args, donate), (_flops(cand, args) - base_flops) / base_flops)
        except Exception as err:  # noqa: BLE001 - a row says what failed rather than stopping the run
            print(f"{name}: {policy} on {kind} failed: {err}", file=sys.stderr)
            compared[policy] = (None, None)
    expected = jax.jit(fn)(*args)
    narrow = compute_dtype(fn, args)   # bf16 steps: values compared at bf16's precision
    best = found.best
    where = best.kind + best.where + (f" ({', '.join(s.function for s in best.sites)})" if best.keys else "") \
        + (f", reordered ({best.order})" if best.order else "")
    row = {
        "program": name, "judge": judge.name, "site": kind, "budget": result.budget_bytes,
        "original": result.xla_total_bytes_before,
        "checkpoint": compared["default"][0], "checkpoint_flops": compared["default"][1],
        "dots_no_batch": compared["dots_with_no_batch_dims_saveable"][0],
        "dots_no_batch_flops": compared["dots_with_no_batch_dims_saveable"][1],
        "nothing": compared["nothing_saveable"][0], "nothing_flops": compared["nothing_saveable"][1],
        "floor": result.floor_bytes,
        "policy": f"{best.policy} on {where}", "policy_total": best.xla_total_bytes,
        "policy_flops": best.extra_flops_ratio,
        "policy_equal": values_equal(expected, jax.jit(result.policy_fn)(*args), narrow),
        "compared_at": "f32" if narrow is None else str(narrow),
        "rewrite_total": None if policy_only else result.xla_total_bytes,
        "rewrite_flops": None if policy_only else result.recompute_flops_ratio,
        "rewrite_fits": None if policy_only else result.fits,
        "rewrite_equal": None if policy_only else values_equal(expected, jax.jit(result.fn)(*args), narrow),
        "rewrites": [{"kind": r.kind, "total": r.xla_total_bytes, "flops": r.extra_flops / base_flops,
                      "equal": r.values_equal} for r in result.rewrites],
        "infeasible": result.infeasible,   # the lower bound's proof, where it proves the budget infeasible
        "seconds": round(time.perf_counter() - started, 1),
    }
    return row


def _mib(v: Any) -> str:
    return "" if v is None else f"{v / MiB:.1f}"


def _pct(v: Any) -> str:
    return "" if v is None else f"{100 * v:.1f}%"


def _rewrite(r: dict[str, Any]) -> str:
    if r.get("rewrite_total") is None:
        return "not run"
    return f"{_mib(r['rewrite_total'])} {'fits' if r['rewrite_fits'] else 'over'} (+{_pct(r['rewrite_flops'])})"


def _first(r: dict[str, Any]) -> str:
    """fit's source rewrites, before its policy: "max pools (25.8) + "."""
    return "".join(f"{w['kind']} ({_mib(w['total'])}) + " for w in r.get("rewrites") or [])


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| program | judge | budget (half-temp) | original | jax.checkpoint on {site} | dots_with_no_batch_dims_saveable "
            "| nothing_saveable | fit: policy | fit: rewrite | values equal (policy / rewrite) | s |")
    out = [head, "|" + "---|" * 11]
    for r in rows:
        site = {"scan": "scan body", "loop": "loop body", "layer": "layer fn"}.get(r["site"], "loss fn")
        out.append(
            f"| {r['program']} | {r['judge']} | {_mib(r['budget'])} | {_mib(r['original'])} "
            f"| {_mib(r['checkpoint'])} ({site}, +{_pct(r['checkpoint_flops'])}) "
            f"| {_mib(r['dots_no_batch'])} (+{_pct(r['dots_no_batch_flops'])}) | {_mib(r['nothing'])} (+{_pct(r['nothing_flops'])}) "
            f"| {_mib(r['policy_total'])} {'fits' if r['policy_total'] <= r['budget'] else 'over'}: {_first(r)}{r['policy']} "
            f"({'+' if r['policy_flops'] >= 0 else ''}{_pct(r['policy_flops'])}) "
            f"| {_rewrite(r)} "
            f"| {r['policy_equal']} / {'-' if r['rewrite_equal'] is None else r['rewrite_equal']} | {r['seconds']} |")
    proofs = [f"- {r['program']} ({r['judge']}): {r['infeasible']}" for r in rows if r.get("infeasible")]
    return "\n".join(out + ([""] + proofs if proofs else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("programs", nargs="*", default=DEFAULT)
    parser.add_argument("--device", action="append", default=None,
                        help="GPU preset, or 'cpu' for XLA:CPU (default: h100-80gb and cpu)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--policy-only", action="store_true", help="skip the rewriting search")
    parser.add_argument("--out", default=None, help="append one JSON line per row")
    parser.add_argument("--table", default=None, metavar="JSONL", help="print the markdown table of a results file")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    for name in args.programs:
        for device in args.device or ["h100-80gb", "cpu"]:
            row = run(name, None if device == "cpu" else device, args.rounds, args.policy_only)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
