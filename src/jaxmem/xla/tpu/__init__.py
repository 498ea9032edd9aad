"""XLA:TPU: `compile` (a deviceless compile for a TPU preset in a subprocess, `python -m
jaxmem.xla.tpu`), `factory` (the programs a factory ran before the step, compiled for the chip)
and `chip` (a real chip's recordings read back and compared with it).

It imports lower floors (`jaxmem.runtime`, `jaxmem.compiler.target`, `accelerators`, `errors`)
and, of `jaxmem.xla`, `start`, `cpu.compile` and `gpu.compile` (the child-process protocol, the
cache and the reference type the compiles share).
"""
