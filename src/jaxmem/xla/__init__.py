"""XLA's own figures, for reference beside jaxmem's planner: `cpu` (XLA:CPU, in process or a fresh
subprocess), `gpu` (deviceless XLA:GPU compiles for a GPU preset), `start` (starting JAX without
the CUDA plugin's noise), `targets/` (XLA's GPU target descriptions) and `maxbatch` (the search for
the largest value that fits)."""
