"""XLA:CPU: `compile` (its `memory_analysis()` for a function, in process or per scheduler in a
fresh subprocess: `python -m jaxmem.xla.cpu`) and `plan` (the public `jaxmem.plan`: the
compiler's plan with that figure in `Plan.xla`).

It imports `jaxmem.compiler` and `jaxmem.errors`, and nothing else of `jaxmem.xla`.
"""
