"""XLA's own figures, for reference beside jaxmem's planner, one package per compiler:

- `cpu/`: XLA:CPU (`compile`: its `memory_analysis()`, in process or in a fresh subprocess;
  `plan`: the public `jaxmem.plan`, the compiler's plan with XLA:CPU's figures beside it);
- `gpu/`: XLA:GPU (`compile`: deviceless compiles for a GPU preset, with XLA's target
  descriptions in `gpu/targets/`; `model/`: jaxmem's model of XLA:GPU, no compile;
  `hlo_memory_schedulers`: XLA's memory schedulers rebuilt over a dump);
- `tpu/`: XLA:TPU (`compile`: deviceless compiles for a TPU preset; `chip`: a real chip's
  recordings read back);

- `sharding/`: sharded programs on GPU, TPU or host targets (`__init__`: tracing over a mesh,
  the per-device program and its compile from a TARGET; `lowered`: the path `jaxmem.analyze`,
  `maxbatch` and `fit` take, the program lowered here and compiled in a child; `collectives`: the
  bytes a device's collectives carry per step);

and the modules no one compiler owns: `start` (starting JAX without the CUDA plugin's noise),
`lowered` (a one-device program lowered here, compiled in a child), `compilers` (the deviceless
compilers' folder) and `maxbatch` (the search for the largest value that fits).

What each may import: anything on a lower floor (docs/architecture.md, "Floors"); inside `xla/`,
`start` imports nothing of `xla/`, a compiler's package imports `start` and the other compilers'
`compile` modules only (their shared child-process and reference helpers), and `sharding`
imports the compilers' `compile` modules.
"""
