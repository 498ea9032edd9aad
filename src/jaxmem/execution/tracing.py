"""Arguments and results between the user and the executor: cache keys, host inputs, outputs.

Tracing, donation and inlining are the compiler's front end (`jaxpr_adapter.trace`, `inline`);
this module converts what crosses the boundary (numpy inputs of the traced dtypes, typed key
outputs, constants as numpy arrays). Shared by `jit`, `eager` and `verify`.

    >>> signature((np.ones((2, 3), np.float32),))[1]
    (((2, 3), 'float32', False),)
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from jaxmem.errors import PlanError
from jaxmem.execution.primitives import is_key_dtype, key_impl, storage


def signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """The cache key of a call: the pytree structure and each leaf's shape, dtype and weakness.

    >>> signature((np.ones((2, 3), np.float32),))[1]
    (((2, 3), 'float32', False),)
    """
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    sig = []
    for leaf in leaves:
        if isinstance(leaf, (bool, int, float, complex)):
            sig.append(((), type(leaf).__name__, True))  # Python scalars trace as weak types
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            leaf = np.asarray(leaf)
            dtype = leaf.dtype
        sig.append((tuple(np.shape(leaf)), str(dtype), bool(getattr(leaf, "weak_type", False))))
    return tree, tuple(sig)


def host_inputs(args: Sequence[Any], in_avals: Sequence[Any]) -> list[np.ndarray]:
    """The flat arguments as numpy arrays of their traced dtypes (keys as their raw data)."""
    leaves = jax.tree_util.tree_leaves(tuple(args))
    if len(leaves) != len(in_avals):
        raise PlanError(f"expected {len(in_avals)} array arguments, got {len(leaves)}")
    out = []
    for leaf, aval in zip(leaves, in_avals):
        if is_key_dtype(aval.dtype):
            out.append(np.asarray(jax.random.key_data(leaf)))
            continue
        dtype, shape = storage(aval)
        arr = np.asarray(leaf)
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        if arr.shape != shape:
            raise PlanError(f"argument of shape {arr.shape} where the trace had {shape}")
        out.append(arr)
    return out


def to_user(value: np.ndarray, aval: Any) -> Any:
    """An output as the user gets it: a numpy array, or a typed key array for PRNG keys."""
    if is_key_dtype(aval.dtype):
        return jax.random.wrap_key_data(value, impl=key_impl(aval.dtype))
    return value


def const_array(value: Any, aval: Any) -> np.ndarray:
    """A literal or closed-over constant as a numpy array of the aval's storage dtype."""
    if is_key_dtype(aval.dtype):
        return np.asarray(jax.random.key_data(value))
    dtype, shape = storage(aval)
    arr = np.asarray(value, dtype=dtype)
    if arr.shape != shape:
        arr = np.broadcast_to(arr, shape)
    return arr
