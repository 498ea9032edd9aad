"""FLOP and byte cost of one jaxpr equation, by primitive, with a conservative default.

The rematerialization pass ranks what to recompute by these numbers, and reports the extra
compute of a rewrite as a ratio of them, so they need to be right in proportion rather than
exact: matrix products and convolutions from their shapes, elementwise operations from their
element counts, reductions from their input size, pure data movement as zero FLOPs (it still
has a byte cost). A primitive not in any table costs one FLOP per output element and is never
treated as cheap.

>>> import jax, jax.numpy as jnp
>>> eqn = jax.make_jaxpr(jnp.dot)(jnp.ones((4, 8)), jnp.ones((8, 2))).jaxpr.eqns[0]
>>> eqn_cost(eqn).flops
128
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Cost:
    """What one equation costs: arithmetic (`flops`) and memory traffic (`bytes`, read + written)."""

    flops: int
    bytes: int


# Elementwise arithmetic: one FLOP per output element. XLA fuses these into their consumers, so
# recomputing a chain of them is close to free; they are the first things remat recomputes.
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp",
    "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma",
    "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "pow", "real", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square",
    "sub", "tan", "tanh", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "population_count", "clz", "conj", "complex", "add_any", "stop_gradient", "reduce_precision",
})

# Pure data movement: no arithmetic, only bytes. Also fused by XLA or free (a bitcast).
MOVEMENT = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "convert_element_type",
    "bitcast_convert_type", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad",
    "rev", "iota", "copy", "copy_p", "gather", "select_and_gather_add", "device_put",
    "sharding_constraint", "pvary", "split",
})

# Reductions: one FLOP per input element.
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "reduce_precision", "scatter-add", "scatter_add", "scatter", "scatter_mul", "scatter_min",
    "scatter_max", "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "reduce",
})

# Never recomputed: effects, randomness that draws fresh state, loops of unknown trip count,
# and the barrier remat itself inserts.
NOT_RECOMPUTABLE = frozenset({
    "while", "optimization_barrier", "rng_uniform", "rng_bit_generator", "random_seed",
    "random_wrap", "random_unwrap", "io_callback", "pure_callback", "debug_callback",
    "debug_print", "infeed", "outfeed", "psum", "all_gather", "all_to_all", "ppermute",
})


def _elements(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    return int(math.prod(shape)) if shape else 1


def aval_bytes(aval: Any) -> int:
    """Bytes of one value of this abstract type (0 for tokens and other non-arrays)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys
        itemsize = getattr(dtype, "itemsize", 4) or 4
    return _elements(aval) * int(itemsize)


def _var_aval(v: Any) -> Any:
    return getattr(v, "aval", None)


def _dot_flops(eqn: Any) -> int:
    lhs = _var_aval(eqn.invars[0])
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    contract = math.prod(lhs.shape[d] for d in lhs_contract) if lhs_contract else 1
    return 2 * _elements(_var_aval(eqn.outvars[0])) * int(contract)


def _conv_flops(eqn: Any) -> int:
    rhs = _var_aval(eqn.invars[1])
    dnums = eqn.params.get("dimension_numbers")
    out_feature_dim = dnums.rhs_spec[0] if dnums is not None else 0
    # Each output element is a dot over the kernel's input features and spatial window; the
    # kernel's input-feature dim already counts only one feature group's channels.
    per_output = math.prod(rhs.shape) // max(1, rhs.shape[out_feature_dim])
    return 2 * _elements(_var_aval(eqn.outvars[0])) * int(per_output)


def _subjaxprs(eqn: Any) -> list[Any]:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns"):
                found.append(jaxpr)
    return found


def jaxpr_flops(jaxpr: Any) -> int:
    """Sum of `eqn_cost(...).flops` over a jaxpr's equations (nested jaxprs included).

    >>> import jax, jax.numpy as jnp
    >>> jaxpr_flops(jax.make_jaxpr(lambda x: x * 2 + 1)(jnp.ones(10)).jaxpr)
    20
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(eqn_cost(e).flops for e in jaxpr.eqns)


def eqn_cost(eqn: Any) -> Cost:
    """The cost of one equation: FLOPs from its primitive's rule, bytes read plus written.

    Args:
        eqn: a jaxpr equation (`jax.extend.core.JaxprEqn`).

    Returns:
        A `Cost`. Unknown primitives cost one FLOP per output element.
    """
    name = eqn.primitive.name
    out_elems = sum(_elements(_var_aval(v)) for v in eqn.outvars)
    nbytes = sum(aval_bytes(_var_aval(v)) for v in (*eqn.invars, *eqn.outvars))
    if name == "dot_general":
        flops = _dot_flops(eqn)
    elif name == "conv_general_dilated":
        flops = _conv_flops(eqn)
    elif name in ELEMENTWISE:
        flops = out_elems
    elif name in MOVEMENT:
        flops = 0
    elif name in REDUCTIONS:
        flops = sum(_elements(_var_aval(v)) for v in eqn.invars)
    elif name == "sort":
        n = _elements(_var_aval(eqn.invars[0]))
        flops = int(n * max(1.0, math.log2(max(n, 2))))
    elif name == "scan":
        flops = int(eqn.params.get("length", 1)) * sum(jaxpr_flops(j) for j in _subjaxprs(eqn))
    elif name == "cond":
        flops = max((jaxpr_flops(j) for j in _subjaxprs(eqn)), default=out_elems)
    elif _subjaxprs(eqn):
        # pjit, remat, custom_jvp_call and friends: what they call; a while loop: one trip,
        # which undercounts, so while loops are never recomputed (NOT_RECOMPUTABLE).
        flops = sum(jaxpr_flops(j) for j in _subjaxprs(eqn))
    else:
        flops = out_elems
    return Cost(int(flops), int(nbytes))


def is_cheap(eqn: Any) -> bool:
    """True for elementwise arithmetic and data movement: what XLA fuses, cheap to recompute."""
    name = eqn.primitive.name
    return name in ELEMENTWISE or name in MOVEMENT


def is_recomputable(eqn: Any) -> bool:
    """True when running the equation a second time gives the same value and has no effect."""
    if eqn.primitive.name in NOT_RECOMPUTABLE:
        return False
    return not getattr(eqn, "effects", None)
