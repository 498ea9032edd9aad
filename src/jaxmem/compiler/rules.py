"""The one primitive table: what the planner, rematerialization and the costs know of each primitive.

One `Rule` per primitive name, with a conservative default (`UNKNOWN`) for names not in it:

- `storage`: how its outputs get memory. "view": the output is its operand's bytes under
  another shape and writes nothing; "elementwise": it may be written into an operand's buffer
  that dies here, as XLA's buffer assignment reuses a dying operand; "update": it writes into
  operand 0's buffer when that dies here (dynamic_update_slice, scatter); "loop": scan/while
  write their carries back into the initial carry's buffer; "fresh": a new buffer; "unknown":
  planned like "fresh" (inputs live through it) and reported.
- `fusion`, `absorbs`: the planner's fusion model. A "producer" may be recomputed inside its
  consumers instead of stored, where every consumer `absorbs` it (loop fusions, reductions); a
  "transpose" folds only into the operands of dot-like consumers (XLA's transpose folding).
- `cost`: how its FLOPs are counted (`costs.eqn_cost`): "elementwise" one per output element,
  "movement" none, "reduction" one per input element, "dot"/"conv" from the shapes, "sort",
  "scan"/"cond" from their bodies; "" one per output element (or what a nested jaxpr costs).
  Elementwise and movement ops are `cheap`: what XLA fuses, and what remat recomputes first.
- `recomputable`: False for ops whose second run would differ or have an effect.

Further columns, set per name by `_facet`, are read by one model each (the comment above each
says which); the sets other modules test names against are derived from the columns here, and
no other module keeps a collection of primitive names.

Adding a primitive is one row here (and, to run it without falling back to JAX, a kernel in
`execution/primitives.py`); `set_row` adds one at run time (a test's own primitive).

    >>> rule("reshape").storage, rule("add").storage, rule("my_custom_op").storage
    ('view', 'elementwise', 'unknown')
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable


@dataclass(frozen=True)
class Rule:
    storage: str = "unknown"
    fusion: str = ""
    absorbs: bool = False
    cost: str = ""
    recomputable: bool = True
    # -- columns read by XLA:GPU's model (xla/gpu/model/)
    # an elementwise op to XLA:GPU's loop fusion beside the `cost == "elementwise"` rows (a convert)
    gpu_elementwise: bool = False
    # data movement XLA:GPU computes inside its consumer (gpu_fusible.cc: IsFusible)
    gpu_movement: bool = False
    # a movement op with several outputs, one HLO slice each: each output is fused on its own
    gpu_slice_per_output: bool = False
    # a newer JAX primitive whose result a GEMM reads is stored: XLA computes it in a loop
    # fusion with the layout ops after it, and the GEMM reads that copy
    gpu_stored_for_gemm: bool = False
    # a transcendental (HloInstruction::IsExpensive)
    gpu_expensive: bool = False
    # a transcendental XLA expands into branches of many ops: never duplicated into readers
    gpu_not_duplicated: bool = False
    # read by a Triton GEMM through its operand fusion (gemm_fusion.cc)
    gpu_gemm_operand: bool = False
    # a bitcast in HLO (reshapes: hlo_query::IsEffectiveParameter looks through them)
    gpu_bitcast: bool = False
    # folded into a GEMM's dimension numbers (the algebraic simplifier's transpose folding)
    gpu_gemm_layout: bool = False
    # between a row reduction and its use, keeps it a row value of the same reduction
    gpu_row_pass: bool = False
    # an HLO reduce (argmax/argmin: a variadic one), which takes a split GEMM's reduce
    gpu_hlo_reduce: bool = False
    # reads the zeros of a relu (`max(x, 0)`, `x > 0`, `select(m, g, 0)`), which XLA's CSE
    # shares with a max-pool gradient's scatter zeros
    gpu_relu_zero_reader: bool = False
    # a scatter whose operand 0 XLA:GPU updates in place: no producer is computed into it
    gpu_scatter_in_place: bool = False
    # the HLO ops XLA:GPU emits for it, for the performance model's profile (empty: its own name)
    gpu_hlo_ops: tuple[str, ...] = ()
    # -- columns read by fitting/ (bound, reorder), remat's search and the executor
    # (and `body` by the front end and the planner)
    # `hero`: XLA:GPU never fuses it into a consumer as a producer; its result is materialized
    # (or takes elementwise consumers into its own fusion's epilogue): the bound's heroes.
    hero: bool = False
    # `view`: how its output can share operand 0's bytes, XLA writing nothing (or eliding the
    # write): "bitcast" (reshape, squeeze, expand_dims: the bytes under another shape),
    # "transpose", "slice", "split" (several slices), "dynamic_slice", "broadcast", "convert"
    # (a change of type or precision XLA may make a bitcast), "copy" (an HLO copy XLA may elide),
    # "barrier" (optimization_barrier's pass-through), "annotation" (the value itself: gradient
    # and sharding annotations); "" none. Each reader picks the kinds its model joins, in the
    # sets below.
    view: str = ""
    # `body`: "call", a call-like primitive whose jaxpr the front end inlines; "control", a
    # control-flow primitive whose bodies are planned on their own (scan, while, cond).
    body: str = ""
    # `folds_constants`: XLA's algebraic simplifier combines its constant operand with others'
    # (`(x * c1) * c2` -> `x * (c1 * c2)`, `x / c` -> `x * (1 / c)`).
    folds_constants: bool = False
    # `running_sum`: each output is a running sum (or product) along `axis`, whose rounding
    # grows with the axis' length.
    running_sum: bool = False
    # `widened`: XLA:GPU's expansion writes more than the op reads and writes
    # (`SelectAndScatterExpander`: index arrays and a zero buffer the operand's size).
    widened: bool = False
    # `examples`: how it treats a batch's examples (fitting/separable, which reads a loss for
    # gradient accumulation): "pass" (the value through: annotations, casts, negation), "sum"
    # (adds), "scale" (mul, div), "broadcast", "permute", "regroup" (reshape), "drop_axis",
    # "window" (slices), "padded", "new_axis", "last_axis" (top_k), "along:<param>" (an op along
    # the axis the parameter names), "reduction", "dot", "lookup" (gather), "conv", "scan_loop",
    # "while_loop", "branches" (cond); "":
    # elementwise by its cost, else not known to keep examples apart.
    examples: str = ""

    @property
    def cheap(self) -> bool:
        return self.cost in ("elementwise", "movement")

    @property
    def dot_like(self) -> bool:
        return self.cost in ("dot", "conv")


UNKNOWN = Rule()

# A fused value is recomputed in each of its readers; beyond this many (held) readers it is
# stored instead, in the planner's fusion model and in remat's model of XLA:CPU alike. 8 keeps
# one layer's fused chains fused and a transformer's residual stream held.
MAX_FUSED_READERS = 8


def _rows(names: str, rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(names.split(), rule)


# The name changed over releases (pjit -> jit, checkpoint -> remat2), so every spelling is listed.
_CALLS = """pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr remat remat2
            checkpoint custom_lin_call"""

RULES: dict[str, Rule] = {
    **_rows("""abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil
               clamp clz complex conj cos cosh digamma div eq eq_to erf erf_inv erfc exp exp2 expm1 floor ge gt
               igamma igammac imag integer_pow is_finite le le_to lgamma log log1p logistic lt lt_to max min mul ne neg
               nextafter not or polygamma population_count pow random_gamma_grad real reduce_precision
               regularized_incomplete_beta rem round rsqrt select_n shift_left shift_right_arithmetic
               shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh xor zeta""",
            Rule("elementwise", "producer", True, "elementwise")),
    **_rows("convert_element_type", Rule("elementwise", "producer", True, "movement")),
    **_rows("copy copy_p", Rule("elementwise", cost="movement")),
    # remat inserts barriers itself; recomputing one would defeat it
    **_rows("optimization_barrier", Rule("elementwise", recomputable=False)),
    **_rows("reshape squeeze expand_dims", Rule("view", "producer", True, "movement")),
    **_rows("bitcast_convert_type", Rule("view", cost="movement")),
    # sharding annotations: the value itself, on each device (any resharding they cause is a
    # collective XLA inserts, planned from its partitioned module where jaxmem has one)
    **_rows("pvary reshard sharding_constraint", Rule("view", cost="movement")),
    **_rows("broadcast_in_dim iota", Rule("fresh", "producer", True, "movement")),
    # newer JAX's own primitives for what it lowers to the ops above: `empty`/`empty2` a
    # broadcast zero, `tile` a reshape of a broadcast (jax/_src/lax/lax.py's lowerings)
    **_rows("empty empty2 tile", Rule("fresh", "producer", True, "movement")),
    **_rows("transpose", Rule("fresh", "transpose", True, "movement")),
    # `stack` lowers to a concatenate of its operands each reshaped
    **_rows("concatenate dynamic_slice pad rev slice stack", Rule("fresh", absorbs=True, cost="movement")),
    # `unstack` lowers to one slice and reshape per output, as `split`
    **_rows("device_put gather select_and_gather_add split unstack", Rule("fresh", cost="movement")),
    # jax.random.clone lowers to its operand
    **_rows("random_clone", Rule("view", cost="movement")),
    **_rows("dynamic_update_slice", Rule("update", absorbs=True, cost="movement")),
    **_rows("""scatter scatter-add scatter_add scatter-mul scatter_mul scatter-min scatter_min scatter-max
               scatter_max scatter-sub scatter_sub""", Rule("update", cost="reduction")),
    **_rows("""argmax argmin cumlogsumexp cummax cummin cumprod cumsum reduce_and reduce_max reduce_min
               reduce_or reduce_prod reduce_sum select_and_scatter_add""", Rule("fresh", absorbs=True, cost="reduction")),
    **_rows("reduce reduce_window reduce_window_max reduce_window_min reduce_window_sum reduce_xor",
            Rule("fresh", cost="reduction")),
    **_rows("dot_general", Rule("fresh", cost="dot")),
    **_rows("conv_general_dilated", Rule("fresh", cost="conv")),
    **_rows("sort", Rule("fresh", cost="sort")),
    **_rows("scan", Rule("loop", cost="scan")),
    # a while loop's FLOPs are one trip's (the trip count is unknown): never recomputed
    **_rows("while", Rule("loop", recomputable=False)),
    **_rows("cond", Rule("fresh", cost="cond")),
    # call-like primitives are inlined by the front end; one whose body does not line up with
    # its operands stays an op, planned fresh with its body as scratch
    **_rows(_CALLS, Rule("fresh")),
    **_rows("""after_all approx_top_k argsort axis_index cholesky create_token custom_linear_solve
               dot_general_p eig eigh fft hessenberg iota_2x32_shape lu mesh_cast nonzero platform_index
               pmax pmin qr ragged_dot ragged_dot_general random_bits random_fold_in random_gamma random_split schur svd
               threefry2x32 tie_in top_k triangular_solve tridiagonal tridiagonal_solve""", Rule("fresh")),
    # effects, collectives, and randomness that draws fresh state
    **_rows("""all_gather all_to_all debug_callback debug_print infeed io_callback outfeed ppermute psum
               psum_invariant pure_callback random_seed random_unwrap random_wrap reduce_scatter
               rng_bit_generator rng_uniform""",
            Rule("fresh", recomputable=False)),
    # read by name (checkpoint_name's tags, a program that is one shard_map) but planned as
    # unknown ops: their rows are the default
    **_rows("name shard_map", UNKNOWN),
}



def _facet(names: str, **columns: object) -> None:
    """Set further columns on rows already in `RULES` (every name must have its row: a column
    never adds a primitive the storage/fusion/cost columns above do not describe)."""
    for name in names.split():
        if name not in RULES:
            raise KeyError(f"{name!r} has no row in RULES")
        RULES[name] = replace(RULES[name], **columns)


# -- facets read by XLA:GPU's model (xla/gpu/model/)
_facet("convert_element_type", gpu_elementwise=True)
_facet("""broadcast_in_dim iota reshape squeeze expand_dims transpose gather dynamic_slice slice pad concatenate
          rev tile stack empty empty2 split unstack dynamic_update_slice""", gpu_movement=True)
_facet("split unstack", gpu_slice_per_output=True)
_facet("tile stack split unstack empty empty2", gpu_stored_for_gemm=True)
_facet("""exp exp2 expm1 log log1p logistic tanh erf erfc erf_inv pow sin cos tan atan2 asin acos atan sinh cosh
          asinh acosh atanh lgamma digamma igamma igammac bessel_i0e bessel_i1e cbrt polygamma zeta
          random_gamma_grad regularized_incomplete_beta""", gpu_expensive=True)
_facet("""erfc erf_inv lgamma digamma igamma igammac random_gamma_grad bessel_i0e bessel_i1e polygamma zeta
          regularized_incomplete_beta""", gpu_not_duplicated=True)
_facet("""reshape squeeze expand_dims transpose broadcast_in_dim convert_element_type gather dynamic_slice slice
          iota""", gpu_gemm_operand=True)
_facet("reshape squeeze expand_dims", gpu_bitcast=True)
_facet("transpose", gpu_gemm_layout=True)
_facet("broadcast_in_dim reshape expand_dims squeeze stop_gradient max min", gpu_row_pass=True)
_facet("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin", gpu_hlo_reduce=True)
_facet("max gt select_n", gpu_relu_zero_reader=True)
_facet("scatter scatter-add scatter_add", gpu_scatter_in_place=True)
# LogisticExpander: 1 / (1 + exp(-x)), as mlp_deep_train's dump shows
for _name, _hlo in {"tanh": "tanh", "exp": "exponential", "exp2": "exponential multiply",
                    "expm1": "exponential-minus-one", "log": "log", "log1p": "log-plus-one",
                    "logistic": "negate exponential add divide", "pow": "power", "rsqrt": "rsqrt", "sqrt": "sqrt",
                    "cbrt": "cbrt", "sin": "sine", "cos": "cosine", "tan": "tan", "atan2": "atan2", "div": "divide",
                    "add": "add", "add_any": "add", "sub": "subtract", "mul": "multiply"}.items():
    _facet(_name, gpu_hlo_ops=tuple(_hlo.split()))
del _name, _hlo


# -- facets read by fitting/ (bound, reorder), remat's search and the executor

_facet("""dot_general conv_general_dilated reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or
          reduce_xor argmax argmin reduce_window_sum reduce_window_max reduce_window_min reduce_window
          select_and_scatter_add select_and_gather_add scatter scatter-add scatter_add scatter-mul scatter_mul
          scatter-min scatter_min scatter-max scatter_max sort top_k fft cumsum cumprod cummax cummin
          cumlogsumexp""", hero=True)
_facet("reshape squeeze expand_dims", view="bitcast")
_facet("transpose", view="transpose")
_facet("slice", view="slice")
_facet("split", view="split")
_facet("dynamic_slice", view="dynamic_slice")
_facet("broadcast_in_dim", view="broadcast")
_facet("bitcast_convert_type convert_element_type reduce_precision real imag", view="convert")
_facet("copy copy_p", view="copy")
_facet("optimization_barrier", view="barrier")
_facet("stop_gradient sharding_constraint mesh_cast reshard pvary", view="annotation")
_facet("""neg convert_element_type copy copy_p stop_gradient reduce_precision optimization_barrier sharding_constraint
          name reshard pvary mesh_cast""", examples="pass")
_facet("add sub add_any", examples="sum")
_facet("mul div", examples="scale")
for _name, _kind in (("broadcast_in_dim", "broadcast"), ("transpose", "permute"), ("reshape", "regroup"),
                     ("squeeze", "drop_axis"), ("slice", "window"), ("dynamic_slice", "window"), ("pad", "padded"),
                     ("stack", "new_axis"), ("expand_dims", "new_axis"), ("top_k", "last_axis"), ("dot_general", "dot"),
                     ("gather", "lookup"), ("conv_general_dilated", "conv"), ("scan", "scan_loop"), ("while", "while_loop"),
                     ("cond", "branches")):
    _facet(_name, examples=_kind)
_facet("concatenate sort", examples="along:dimension")
_facet("cumsum cumprod cummax cummin cumlogsumexp split", examples="along:axis")
_facet("rev", examples="along:dimensions")
_facet("reduce_sum reduce_max reduce_min reduce_prod argmax argmin reduce_and reduce_or", examples="reduction")
_facet(_CALLS, body="call")
_facet("scan while cond", body="control")
_facet("add sub mul div pow", folds_constants=True)
_facet("cumsum cumprod cumlogsumexp", running_sum=True)
_facet("select_and_scatter_add", widened=True)

# The table's hot questions as sets (the planner and remat's search ask them per op, per trial).
# Each is one set object for the life of the process, refreshed in place by `set_row`, so the
# modules that imported it see a row added later; read them, never change them.
_DERIVED: list[tuple[set[str], Callable[[Rule], bool]]] = []


def _names(test: Callable[[Rule], bool]) -> set[str]:
    names = {name for name, r in RULES.items() if test(r)}
    _DERIVED.append((names, test))
    return names


DOT_LIKE = _names(lambda r: r.dot_like)
CHEAP = _names(lambda r: r.cheap)
ELEMENTWISE_COST = _names(lambda r: r.cost == "elementwise")
NOT_RECOMPUTABLE = _names(lambda r: not r.recomputable)
_VIEWS = _names(lambda r: r.storage == "view")
CALL_PRIMITIVES = _names(lambda r: r.body == "call")
LOOP_PRIMITIVES = _names(lambda r: r.body == "control")
HEROES = _names(lambda r: r.hero)
SCATTERS = _names(lambda r: r.hero and r.storage == "update")
# The bound's joins: a value and its view are one buffer (over-joining only weakens the bound);
# a split's several outputs and the annotations are not joined.
BOUND_VIEWS = _names(lambda r: r.view in ("bitcast", "transpose", "slice", "dynamic_slice", "broadcast", "convert",
                                          "copy", "barrier"))
# Remat's view chains: single-operand movement a transposed operand may be recomputed through,
# and the transposes whose output XLA:CPU may hold twice (two layouts).
CHAIN_VIEWS = _names(lambda r: r.view in ("bitcast", "transpose", "slice", "split"))
DOUBLED_VIEWS = _names(lambda r: r.view == "transpose")
# The executor's identity kernel: the output is the operand's value.
IDENTITY_VIEWS = _names(lambda r: r.view in ("copy", "annotation"))
FOLDS_CONSTANTS = _names(lambda r: r.folds_constants)
WIDENED = _names(lambda r: r.widened)


# XLA:GPU's model (xla/gpu/model/)
GPU_ELEMENTWISE = _names(lambda r: r.cost == "elementwise" or r.gpu_elementwise)
GPU_MOVEMENT = _names(lambda r: r.gpu_movement)
GPU_REDUCTIONS = _names(lambda r: r.cost == "reduction")
# what loop fusions compute inside them, and the consumers (loop, input and scatter fusions)
# that absorb any such producer
GPU_FUSIBLE_PRODUCERS = _names(lambda r: r.cost == "elementwise" or r.gpu_elementwise or r.gpu_movement)
GPU_LOOP_CONSUMERS = _names(lambda r: r.cost in ("elementwise", "reduction") or r.gpu_elementwise or r.gpu_movement)
GPU_SLICE_PER_OUTPUT = _names(lambda r: r.gpu_slice_per_output)
GPU_STORED_FOR_GEMM = _names(lambda r: r.gpu_stored_for_gemm)
GPU_EXPENSIVE = _names(lambda r: r.gpu_expensive)
GPU_NOT_DUPLICATED = _names(lambda r: r.gpu_not_duplicated)
GPU_GEMM_OPERAND = _names(lambda r: r.gpu_gemm_operand)
GPU_BITCASTS = _names(lambda r: r.gpu_bitcast)
GPU_GEMM_LAYOUT = _names(lambda r: r.gpu_gemm_layout)
GPU_VIEWS = _names(lambda r: r.gpu_bitcast or r.gpu_gemm_layout)   # what a GEMM reads a value through, unchanged
GPU_ROW_PASS = _names(lambda r: r.gpu_row_pass)
GPU_HLO_REDUCE = _names(lambda r: r.gpu_hlo_reduce)
GPU_RELU_ZERO_READERS = _names(lambda r: r.gpu_relu_zero_reader)
GPU_SCATTER_IN_PLACE = _names(lambda r: r.gpu_scatter_in_place)
# the consumers priority fusion merges a split-K's reduce (a loop fusion) into: loop fusions
# (elementwise ops; data movement other than an update in place) and HLO reduces
GPU_SPLITK_ABSORBING = _names(lambda r: r.cost == "elementwise" or r.gpu_elementwise or r.gpu_hlo_reduce
                              or (r.gpu_movement and r.storage != "update"))
# HLO ops (not primitives) XLA:GPU computes in float32 when given 16-bit floats (float
# normalization upcasts them); the `gpu_hlo_ops` column names them per primitive
GPU_UPCAST_HLO_OPS = frozenset("""tanh exponential exponential-minus-one log log-plus-one power rsqrt sqrt cbrt
                                  sine cosine tan atan2""".split())


def set_row(name: str, row: Rule | None) -> None:
    """Add (or replace) one primitive's row, or remove it (`row=None`), and refresh every set
    derived from the table. Tests use it for a primitive of their own; jaxmem's rows are above."""
    if row is None:
        RULES.pop(name, None)
    else:
        RULES[name] = row
    for names, test in _DERIVED:
        names.clear()
        names.update(n for n, r in RULES.items() if test(r))


def rule(primitive: str) -> Rule:
    """The primitive's rule, or the conservative `UNKNOWN` one."""
    return RULES.get(primitive, UNKNOWN)


def storage_rule(primitive: str) -> str:
    """How a primitive's outputs get storage: 'view', 'elementwise', 'update', 'loop', 'fresh'
    or 'unknown' (planned like 'fresh', and reported)."""
    return RULES.get(primitive, UNKNOWN).storage


def is_view(primitive: str, params: dict | None = None, in_dtype: str | None = None) -> bool:
    """True when the op only reinterprets its operand's bytes (never writes them). A
    convert_element_type to the operand's own dtype (a weak-type change) is one too."""
    if primitive == "convert_element_type" and in_dtype is not None and params:
        return str(params.get("new_dtype")) == in_dtype
    if primitive in _VIEWS:
        if primitive == "bitcast_convert_type":
            return True
        if primitive == "reshape" and params and params.get("dimensions") is not None:
            return False  # a reshape with a transposition moves data
        return True
    return False


def fusible_producer(primitive: str, params: dict | None = None, *, every_cheap_op: bool = False) -> bool:
    """Whether a value this primitive makes may be computed inside its readers instead of stored.

    The planner's fusion model fuses the table's "producer" and "transpose" roles (a transpose
    only into dot-like readers), but not a reshape that transposes, which moves data.
    `every_cheap_op=True` is remat's model of XLA:CPU's loop fusion, which fuses slices, pads,
    concatenates and copies as well: every `cheap` primitive.

        >>> fusible_producer("add"), fusible_producer("slice"), fusible_producer("slice", every_cheap_op=True)
        (True, False, True)
    """
    if every_cheap_op:
        return primitive in CHEAP
    fusion = RULES.get(primitive, UNKNOWN).fusion
    if fusion == "transpose":
        return True
    if fusion != "producer":
        return False
    return not (primitive == "reshape" and params and params.get("dimensions") is not None)


def inplace_candidates(primitive: str, params: dict, operands: list, num_outputs: int) -> list[list[int]]:
    """For each output, the operand positions whose buffer it may overwrite (if they die here).

    **Arguments:** the primitive name and params, the operand list, the number of outputs.

    **Returns:** one list of operand positions per output (empty: needs a fresh buffer).
    """
    storage = storage_rule(primitive)
    if storage == "elementwise":
        return [list(range(len(operands))) for _ in range(num_outputs)]
    if storage == "update":
        return [[0]] + [[] for _ in range(num_outputs - 1)]
    if primitive == "scan":
        num_consts, num_carry = int(params["num_consts"]), int(params["num_carry"])
        return [[num_consts + i] if i < num_carry else [] for i in range(num_outputs)]
    if primitive == "while":
        offset = int(params["cond_nconsts"]) + int(params["body_nconsts"])
        return [[offset + i] for i in range(num_outputs)]
    return [[] for _ in range(num_outputs)]
