"""Per-primitive storage rules: which outputs need no storage, which may overwrite an operand.

Three rule tables and a conservative default:

- `VIEW`: the output is its operand's bytes under another shape (reshape, squeeze, ...); it
  shares the operand's buffer and writes nothing.
- `ELEMENTWISE`: the output may be written into an operand's buffer when that operand (and
  everything sharing its buffer) is read for the last time by this op, as XLA's buffer
  assignment reuses a dying operand.
- `UPDATE`: dynamic_update_slice / scatter write into operand 0's buffer when it dies there;
  loops write their carries back into the initial carry's buffer.
- Anything in `KNOWN` but not above gets a fresh buffer. A primitive in no table is unknown: it
  is planned the same conservative way (fresh outputs, inputs live through it) and reported.

    >>> storage_rule("reshape"), storage_rule("add"), storage_rule("my_custom_op")
    ('view', 'elementwise', 'unknown')
"""

from __future__ import annotations

from jaxmem.compiler.jaxpr_adapter import CALL_PRIMITIVES, LOOP_PRIMITIVES

VIEW = frozenset({"reshape", "squeeze", "expand_dims", "bitcast_convert_type"})

ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "complex", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh",
    "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge",
    "gt", "igamma", "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "population_count", "pow", "real", "reduce_precision", "rem", "round", "rsqrt", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt",
    "square", "stop_gradient", "sub", "tan", "tanh", "xor", "clz", "bessel_i0e", "bessel_i1e",
    "random_gamma_grad", "polygamma", "zeta", "regularized_incomplete_beta", "optimization_barrier",
})

UPDATE = frozenset({
    "dynamic_update_slice", "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
    "scatter-min", "scatter_min", "scatter-max", "scatter_max", "scatter_sub", "scatter-sub",
})

# Producers XLA-style loop fusion recomputes inside their consumer instead of storing.
FUSIBLE_PRODUCERS = (ELEMENTWISE - {"copy", "copy_p", "optimization_barrier"}) | {
    "broadcast_in_dim", "iota", "reshape", "squeeze", "expand_dims",
}
# Consumers that can absorb a fused producer: loop fusions and reductions (input fusion).
FUSIBLE_CONSUMERS = FUSIBLE_PRODUCERS | {
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "argmax", "argmin", "transpose", "slice", "dynamic_slice", "concatenate", "pad",
    "rev", "dynamic_update_slice", "select_and_scatter_add", "cumsum", "cumprod", "cummax",
    "cumlogsumexp", "cummin",
}

# Consumers whose operands may be transposed for free (dimension numbers absorb the transpose).
DOT_LIKE = frozenset({"dot_general", "conv_general_dilated"})

OTHER_KNOWN = frozenset({
    "dot_general", "conv_general_dilated", "transpose", "broadcast_in_dim", "iota", "slice",
    "dynamic_slice", "gather", "concatenate", "pad", "rev", "sort", "argsort", "argmax",
    "argmin", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "reduce_precision", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
    "select_and_scatter_add", "select_and_gather_add", "random_bits", "random_seed",
    "random_wrap", "random_unwrap", "random_split", "random_fold_in", "threefry2x32",
    "rng_bit_generator", "rng_uniform", "top_k", "split", "squeeze", "cholesky", "eigh",
    "lu", "qr", "svd", "triangular_solve", "fft", "custom_linear_solve", "reduce",
    "argsort", "clamp", "erf_inv", "device_put", "sharding_constraint", "mesh_cast",
    "convert_element_type", "copy", "tie_in", "axis_index", "psum", "pmax", "pmin",
    "all_gather", "ppermute", "all_to_all", "pure_callback", "io_callback", "debug_callback",
    "platform_index", "approx_top_k", "nonzero", "create_token", "after_all",
    "iota_2x32_shape", "erf", "population_count", "dot_general_p", "ragged_dot_general",
    "ragged_dot", "tridiagonal", "tridiagonal_solve", "schur", "eig", "hessenberg",
    "debug_print", "square", "logistic", "cumlogsumexp", "erf_inv", "reduce_and", "argsort",
})

KNOWN = VIEW | ELEMENTWISE | UPDATE | OTHER_KNOWN | LOOP_PRIMITIVES | CALL_PRIMITIVES


def storage_rule(primitive: str) -> str:
    """How a primitive's outputs get storage: 'view', 'elementwise', 'update', 'loop', 'fresh'
    or 'unknown' (planned like 'fresh', and reported)."""
    if primitive in VIEW:
        return "view"
    if primitive in ELEMENTWISE:
        return "elementwise"
    if primitive in UPDATE:
        return "update"
    if primitive in ("scan", "while"):
        return "loop"
    if primitive in KNOWN:
        return "fresh"
    return "unknown"


def is_view(primitive: str, params: dict | None = None, in_dtype: str | None = None) -> bool:
    """True when the op only reinterprets its operand's bytes (never writes them). A
    convert_element_type to the operand's own dtype (a weak-type change) is one too."""
    if primitive == "convert_element_type" and in_dtype is not None and params:
        return str(params.get("new_dtype")) == in_dtype
    if primitive in VIEW:
        if primitive == "bitcast_convert_type":
            return True
        if primitive == "reshape" and params and params.get("dimensions") is not None:
            return False  # a reshape with a transposition moves data
        return True
    return False


def inplace_candidates(primitive: str, eqn_params: dict, operands: list, num_outputs: int) -> list[list[int]]:
    """For each output, the operand positions whose buffer it may overwrite (if they die here).

    **Arguments:** the primitive name and params, the operand list, the number of outputs.

    **Returns:** one list of operand positions per output (empty: needs a fresh buffer).
    """
    rule = storage_rule(primitive)
    if rule == "elementwise":
        return [list(range(len(operands))) for _ in range(num_outputs)]
    if rule == "update":
        return [[0]] + [[] for _ in range(num_outputs - 1)]
    if primitive == "scan":
        num_consts, num_carry = int(eqn_params["num_consts"]), int(eqn_params["num_carry"])
        return [[num_consts + i] if i < num_carry else [] for i in range(num_outputs)]
    if primitive == "while":
        offset = int(eqn_params["cond_nconsts"]) + int(eqn_params["body_nconsts"])
        return [[offset + i] for i in range(num_outputs)]
    return [[] for _ in range(num_outputs)]
