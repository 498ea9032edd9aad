"""FLOP and byte cost of one jaxpr equation, by its primitive's `rules.Rule.cost`.

The rematerialization pass ranks what to recompute by these numbers, and reports the extra
compute of a rewrite as a ratio of them, so they need to be right in proportion rather than
exact: matrix products and convolutions from their shapes, elementwise operations from their
element counts, reductions from their input size, pure data movement as zero FLOPs (it still
has a byte cost). A primitive not in the table costs one FLOP per output element and is never
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

from jaxmem.compiler.jaxpr_adapter import (aval_bytes, eqn_effectful, eqn_in_avals, eqn_name, eqn_out_avals,
                                           eqn_params, jaxpr_eqns)
from jaxmem.compiler.rules import CHEAP, NOT_RECOMPUTABLE, rule


@dataclass(frozen=True)
class Cost:
    """What one equation costs: arithmetic (`flops`) and memory traffic (`bytes`, read + written)."""

    flops: int
    bytes: int


def _elements(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    return int(math.prod(shape)) if shape else 1


def _dot_flops(params: dict[str, Any], ins: list[Any], outs: list[Any]) -> int:
    lhs = ins[0]
    (lhs_contract, _), _ = params["dimension_numbers"]
    contract = math.prod(lhs.shape[d] for d in lhs_contract) if lhs_contract else 1
    return 2 * _elements(outs[0]) * int(contract)


def _conv_flops(params: dict[str, Any], ins: list[Any], outs: list[Any]) -> int:
    rhs = ins[1]
    dnums = params.get("dimension_numbers")
    out_feature_dim = dnums.rhs_spec[0] if dnums is not None else 0
    # Each output element is a dot over the kernel's input features and spatial window; the
    # kernel's input-feature dim already counts only one feature group's channels.
    per_output = math.prod(rhs.shape) // max(1, rhs.shape[out_feature_dim])
    return 2 * _elements(outs[0]) * int(per_output)


def _subjaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns"):
                found.append(jaxpr)
    return found


# XLA runs no kernel for these: a barrier's results are its operands' buffers, so it computes and
# moves nothing (a reordering that adds barriers adds no FLOPs).
NO_KERNEL = frozenset({"optimization_barrier"})


def jaxpr_flops(jaxpr: Any) -> int:
    """Sum of `eqn_cost(...).flops` over a jaxpr's equations (nested jaxprs included).

    >>> import jax, jax.numpy as jnp
    >>> jaxpr_flops(jax.make_jaxpr(lambda x: x * 2 + 1)(jnp.ones(10)).jaxpr)
    20
    """
    return sum(eqn_cost(e).flops for e in jaxpr_eqns(jaxpr))


def eqn_cost(eqn: Any) -> Cost:
    """The cost of one equation: FLOPs from its primitive's rule, bytes read plus written.

    Args:
        eqn: a jaxpr equation (`jax.extend.core.JaxprEqn`).

    Returns:
        A `Cost`. Unknown primitives cost one FLOP per output element; an `optimization_barrier`
        costs nothing.

    >>> import jax, jax.numpy as jnp
    >>> tied = jax.make_jaxpr(lambda x, y: jax.lax.optimization_barrier((x, y)))(jnp.ones(8), jnp.ones(8))
    >>> eqn_cost(tied.jaxpr.eqns[0])
    Cost(flops=0, bytes=0)
    """
    if eqn_name(eqn) in NO_KERNEL:
        return Cost(0, 0)
    kind = rule(eqn_name(eqn)).cost
    params, ins, outs = eqn_params(eqn), eqn_in_avals(eqn), eqn_out_avals(eqn)
    out_elems = sum(_elements(a) for a in outs)
    nbytes = sum(aval_bytes(a) for a in (*ins, *outs))
    if kind == "dot":
        flops = _dot_flops(params, ins, outs)
    elif kind == "conv":
        flops = _conv_flops(params, ins, outs)
    elif kind == "elementwise":
        flops = out_elems
    elif kind == "movement":
        flops = 0
    elif kind == "reduction":
        flops = sum(_elements(a) for a in ins)
    elif kind == "sort":
        n = _elements(ins[0])
        flops = int(n * max(1.0, math.log2(max(n, 2))))
    elif kind == "scan":
        flops = int(params.get("length", 1)) * sum(jaxpr_flops(j) for j in _subjaxprs(params))
    elif kind == "cond":
        flops = max((jaxpr_flops(j) for j in _subjaxprs(params)), default=out_elems)
    elif _subjaxprs(params):
        # pjit, remat, custom_jvp_call and friends: what they call; a while loop: one trip,
        # which undercounts, so while loops are never recomputed (`rules`).
        flops = sum(jaxpr_flops(j) for j in _subjaxprs(params))
    else:
        flops = out_elems
    return Cost(int(flops), int(nbytes))


def is_cheap(eqn: Any) -> bool:
    """True for elementwise arithmetic and data movement: what XLA fuses, cheap to recompute."""
    return eqn_name(eqn) in CHEAP


def is_recomputable(eqn: Any) -> bool:
    """True when running the equation a second time gives the same value and has no effect."""
    return eqn_name(eqn) not in NOT_RECOMPUTABLE and not eqn_effectful(eqn)
