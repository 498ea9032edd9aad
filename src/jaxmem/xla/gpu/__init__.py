"""XLA:GPU: `compile` (a deviceless compile for a GPU preset in a subprocess, `python -m
jaxmem.xla.gpu`, cached; XLA's target descriptions in `targets/`; the child-process protocol and
cache the TPU and sharded compiles share), `model/` (jaxmem's model of XLA:GPU's memory, no
compile) and `hlo_memory_schedulers` (XLA's three memory schedulers rebuilt over a dumped module,
`python -m jaxmem.xla.gpu.hlo_memory_schedulers DUMP.txt`).

It imports lower floors (`jaxmem.compiler`, `accelerators`, `units`, `errors`) and, of
`jaxmem.xla`, `start` and `cpu.compile` only.
"""
