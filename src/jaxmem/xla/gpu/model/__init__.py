"""jaxmem's model of XLA:GPU's memory, one module per XLA pass (`predict` runs them: fusion,
scratch, scheduling, heap; its docstring lists the modules).

- `predict`: the model's entry (`predict`, `plan_on_gpu`, `predict_plan`);
- `ops`: what every pass reads of a program; it imports no other pass;
- `fusion` and its rules in `fusion_producers`, `fusion_cost`, `fusion_softmax`,
  `fusion_gemm`, `fusion_concat`; `splitk` (split-K); `conv` (cuDNN's convolutions);
  `scratch` (workspaces, loop bodies); `schedule` (the orders XLA's memory scheduler tries);
  `heap` (liveness to XLA's temp block) placed by `heap_simulator` (XLA's heap simulator);
- `performance` (XLA:GPU's performance model) and `reduction` (how a reduction kernel runs).

It imports `jaxmem.compiler` (the one front end and program representation), `accelerators`,
`units`, `errors` and, of `jaxmem.xla`, only `gpu.compile` (a target's description).
"""
