"""A run's device memory as it happens, and what is left of it when it fails.

The run-time side of jaxmem: recording a program's device memory while it runs (the recorder),
a post-mortem of the memory at an out-of-memory, leaks (arrays that outlive the step that made
them), and explaining the out-of-memory texts JAX, XLA and the TPU and GPU runtimes print
(`oom_text` reads them, `explain` says what happened and what to change). Nothing here plans a
program: the planner and XLA's figures live on lower floors.
"""
