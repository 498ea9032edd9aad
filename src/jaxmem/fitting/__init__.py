"""Fitting a training step to a memory budget with the user's own tools: a `jax.checkpoint`
policy to paste (`policy`), judged by XLA:GPU or XLA:CPU (`judge`), and reordering alone
(`reorder`). `jaxmem.fit` (`fit.py`) runs them beside the compiler's rewriting search."""
