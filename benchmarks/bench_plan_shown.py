"""Where jaxmem shows its own plan beside XLA's figure for the device, and where it withholds it
(`jaxmem.reports.plan_check`: more than 1.25x XLA's total). Per program, as `jaxmem analyze
TARGET --device D --json` reports it: XLA's total for the device, jaxmem's plan and their ratio,
shown or withheld. Sets: the suite (`jaxmem.examples.suite`, with its donation), the held-out
TPU steps (`benchmarks/tpu_models/eval`, never used for this rule), and the mesh examples
(`jaxmem.examples.sharded`, per device).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_plan_shown.py --out benchmarks/results/plan_shown.jsonl
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDED = ("constraint_step", "dp_step", "fsdp_step", "tp_step")


def targets() -> list[tuple[str, str, list[str]]]:
    from jaxmem.examples.suite import PROGRAMS

    rows = [("suite", p.target, ["--donate", ",".join(map(str, p.donate_argnums))] if p.donate_argnums else [])
            for p in PROGRAMS.values()]
    rows += [("held-out", f"{path}:make", []) for path in sorted(glob.glob(os.path.join(HERE, "tpu_models", "eval", "*.py")))]
    rows += [("mesh", f"jaxmem.examples.sharded:{name}", []) for name in SHARDED]
    return rows


def one(target: str, flags: list[str], device: str) -> dict:
    cmd = [sys.executable, "-m", "jaxmem", "analyze", target, "--device", device, "--json", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    data = json.loads(proc.stdout)
    xla = data.get("xla_tpu") or data.get("xla_gpu")
    withheld = data.get("plan_withheld") or ({"peak_bytes": data["plan"]["withheld_peak_bytes"]}
                                             if data.get("plan", {}).get("withheld") else None)
    plan = data["peak_bytes"] if data.get("peak_bytes") is not None else (withheld or {}).get("peak_bytes")
    total = xla["total_bytes"] if xla and not xla.get("oom") else None
    return {"xla_total_bytes": total, "plan_peak_bytes": plan, "shown": withheld is None and plan is not None,
            "ratio": round(plan / total, 4) if plan and total else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="tpu-v5e-16gb")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for group, target, flags in targets():
        row = {"set": group, "target": os.path.relpath(target, HERE) if target.startswith("/") else target,
               "flags": " ".join(flags), "device": args.device, **one(target, flags, args.device)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(r) + "\n" for r in rows)
    for group in ("suite", "held-out", "mesh"):
        got = [r for r in rows if r["set"] == group and r.get("ratio")]
        shown = [r["ratio"] for r in got if r["shown"]]
        withheld = ", ".join(f"{r['ratio']:.2f}x" for r in got if not r["shown"])
        print(f"{group}: {len(got)} programs; plan shown on {len(shown)}"
              + (f" (plan / XLA {min(shown):.3f}-{max(shown):.3f})" if shown else "")
              + f", withheld on {len(got) - len(shown)}" + (f" ({withheld})" if withheld else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
