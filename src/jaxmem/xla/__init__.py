"""XLA's own figures, for reference beside jaxmem's planner, one package per compiler:

- `cpu/`: XLA:CPU (`compile`: its `memory_analysis()`, in process or in a fresh subprocess;
  `plan`: the public `jaxmem.plan`, the compiler's plan with XLA:CPU's figures beside it);
- `gpu/`: XLA:GPU (`compile`: deviceless compiles for a GPU preset, with XLA's target
  descriptions in `gpu/targets/`; `model/`: jaxmem's model of XLA:GPU, no compile;
  `hlo_memory_schedulers`: XLA's memory schedulers rebuilt over a dump);
- `tpu/`: XLA:TPU (`compile`: deviceless compiles for a TPU preset; `chip`: a real chip's
  recordings read back);

and the modules no one compiler owns: `start` (starting JAX without the CUDA plugin's noise),
`sharding` (sharded compiles on GPU or TPU targets) and `maxbatch` (the search for the largest
value that fits).

What each may import: anything on a lower floor (docs/architecture.md, "Floors"); inside `xla/`,
`start` imports nothing of `xla/`, a compiler's package imports `start` and the other compilers'
`compile` modules only (their shared child-process and reference helpers), and `sharding`
imports the compilers' `compile` modules.
"""
