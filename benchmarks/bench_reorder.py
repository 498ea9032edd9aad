"""Reordering alone: XLA's total before and after `fitting.reorder` (jaxmem's planned order chained
with optimization_barrier), per program and chaining share.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_reorder.py cnn_train,mlp_deep_train h100-80gb 0,0.01,0.05
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_reorder.py cnn_train cpu 0
"""
import sys, time
from jaxmem.examples.suite import ALL_PROGRAMS
from jaxmem.fitting.reorder import reorder
dev = sys.argv[2] if sys.argv[2] != "cpu" else None
for name in sys.argv[1].split(","):
  p = ALL_PROGRAMS[name]
  fn, args = p.factory()
  for share in [float(x) for x in sys.argv[3].split(",")]:
    t=time.time()
    r = reorder(fn, *args, donate_argnums=p.donate_argnums, device=dev, min_share=share)
    M=2**20
    print(p.name, r.judge, share, "plan", round(r.planned_peak_bytes/M,1), "before", round(r.xla_total_bytes_before/M,1), "after", round(r.xla_total_bytes_after/M,1), "share", round(r.share_of_gap,3), r.chained_steps, r.steps, round(time.time()-t), flush=True)
