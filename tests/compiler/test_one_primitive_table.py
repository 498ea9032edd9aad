"""`compiler/rules.py` is the one primitive table: no other source file keeps its own collection of
primitive names, every name the code compares an equation's primitive with has a row, and a
primitive new to jaxmem is one row there, planned, predicted and bounded as the row says."""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxmem.compiler import rules
# imported before the test's row is added, so their sets of names are built without it: a row
# added later must reach them through the table (`rules.set_row`)
from jaxmem.compiler.planner import plan_jaxpr
from jaxmem.fitting.bound import lower_bound
from jaxmem.xla.gpu.model.predict import predict

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "jaxmem"
TABLE = SRC / "compiler" / "rules.py"
# A collection holding this many primitive names is a table of its own.
MOST_NAMES = 3


def _jax_primitive_names() -> set[str]:
    """The name of every `Primitive` instance in JAX's imported modules (its public modules
    imported first, so their implementation modules are loaded)."""
    for name in ("jax.numpy", "jax.lax", "jax.random", "jax.scipy.special", "jax.nn", "jax.ad_checkpoint",
                 "jax.experimental.shard_map", "jax.lax.linalg"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    names = set()
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "jax" or module_name.startswith("jax.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Primitive):
                names.add(value.name)
    return names


PRIMITIVE_NAMES = frozenset(rules.RULES) | _jax_primitive_names()


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != TABLE)


def _strings(nodes: list[ast.expr | None]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _split_strings(tree: ast.AST) -> dict[str, str]:
    """Module-level names bound to a string constant (a later `NAME.split()` makes them a list)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _collected_names(node: ast.AST, bound_strings: dict[str, str]) -> list[str]:
    """The primitive names a collection literal (set, list, tuple, dict keys) or a split string holds."""
    if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        words = _strings(node.elts)
    elif isinstance(node, ast.Dict):
        words = _strings(node.keys)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "split":
        target = node.func.value
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            words = target.value.split()
        elif isinstance(target, ast.Name) and target.id in bound_strings:
            words = bound_strings[target.id].split()
        else:
            words = []
    else:
        words = []
    return [w for w in words if w in PRIMITIVE_NAMES]


def test_the_scan_knows_jax_primitives():
    # the truth the scans below lean on: JAX's own names are found, not only the table's
    assert {"add", "dot_general", "scan", "custom_jvp_call", "name", "erf_inv", "cumsum"} <= PRIMITIVE_NAMES
    assert "addupdate" in PRIMITIVE_NAMES - set(rules.RULES)  # a JAX primitive jaxmem has no row for


def test_no_collection_of_primitive_names_outside_the_table():
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        bound = _split_strings(tree)
        for node in ast.walk(tree):
            names = _collected_names(node, bound)
            if len(names) >= MOST_NAMES:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: {names}")
    assert not offenders, "collections of primitive names outside compiler/rules.py (make them columns " \
                          "of rules.RULES):\n" + "\n".join(offenders)


def test_the_scan_finds_a_collection():
    # the scan itself, on a file that has one of each kind
    tree = ast.parse('A = {"add", "mul", "sin"}\nB = ("x", "exp", "tanh", "neg")\nC = {"sub": 1, "div": 2, "log": 3}\n'
                     'D = "abs cos floor"\nE = D.split()\nF = "reshape slice transpose".split()\nG = ("add", "y")\n')
    bound = _split_strings(tree)
    found = [names for node in ast.walk(tree) if len(names := _collected_names(node, bound)) >= MOST_NAMES]
    assert sorted(map(sorted, found)) == sorted(map(sorted, [
        ["add", "mul", "sin"], ["exp", "tanh", "neg"], ["sub", "div", "log"], ["abs", "cos", "floor"],
        ["reshape", "slice", "transpose"]]))


# -- names compared with an equation's primitive -------------------------------------------------

# Parameters that hold a primitive's name (rules.py's own helpers, fusion's producer/consumer).
_NAME_PARAMETERS = {"primitive", "prim_name"}


def _is_primitive_expr(node: ast.expr, named: set[str]) -> bool:
    """`x.primitive`, `x.primitive.name`, `eqn_name(...)`, or a local bound to one of them."""
    if isinstance(node, ast.Attribute) and node.attr == "primitive":
        return True
    if isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "primitive":
        return True
    if isinstance(node, ast.Call):
        func = node.func
        return (isinstance(func, ast.Name) and func.id == "eqn_name") or \
            (isinstance(func, ast.Attribute) and func.attr == "eqn_name")
    return isinstance(node, ast.Name) and node.id in named


def _primitive_locals(fn: ast.AST) -> set[str]:
    """The locals of a function (or module) bound to a primitive's name."""
    named: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        named |= {a.arg for a in fn.args.args + fn.args.kwonlyargs} & _NAME_PARAMETERS
    for _ in range(2):  # a local bound from another such local
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if isinstance(target, ast.Name) and _is_primitive_expr(node.value, named):
                    named.add(target.id)
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts):
                        if isinstance(t, ast.Name) and _is_primitive_expr(v, named):
                            named.add(t.id)
    return named


def _compared_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) for every string compared (==, !=, in, not in) with a primitive's name (a
    comparison in a nested function is seen from each enclosing one: counted once)."""
    out: dict[tuple[int, int, str], None] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        named = _primitive_locals(fn)
        for node in ast.walk(fn):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if not any(_is_primitive_expr(s, named) for s in sides):
                continue
            for side in sides:
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                out.update(dict.fromkeys((node.lineno, node.col_offset, s) for s in _strings(elts)))
    return [(line, name) for line, _, name in out]


def test_every_name_compared_with_a_primitive_has_a_row():
    missing, seen = [], set()
    for path in [*_sources(), TABLE]:
        for line, name in _compared_names(ast.parse(path.read_text(), str(path))):
            seen.add(name)
            if name not in rules.RULES:
                missing.append(f"{path.relative_to(SRC)}:{line}: {name!r}")
    assert not missing, "primitive names compared in src/ without a row in rules.RULES:\n" + "\n".join(missing)
    # the scan sees the comparisons it is meant to (planner's loop kinds, fit's checkpoint names)
    assert {"cond", "scan", "while", "transpose", "dot_general", "name", "shard_map"} <= seen


def test_the_comparison_scan_follows_locals():
    tree = ast.parse('def f(eqn, primitive):\n'
                     '    name, params = ja.eqn_name(eqn), eqn.params\n'
                     '    other = name\n'
                     '    if other in ("a1", "a2") or primitive == "a3" or eqn.primitive.name != "a4":\n'
                     '        return "no" == params\n')
    assert sorted(n for _, n in _compared_names(tree)) == ["a1", "a2", "a3", "a4"]


# -- the derived sets are the sets the modules kept before -----------------------------------------

def test_derived_sets_are_the_former_hand_written_ones():
    # the sets fitting/bound.py, remat_search.py, reorder.py, the executor and the front end
    # spelled out before the table had their columns (behaviour kept name for name)
    assert rules.HEROES == {
        "dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
        "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin", "reduce_window_sum", "reduce_window_max",
        "reduce_window_min", "reduce_window", "select_and_scatter_add", "select_and_gather_add", "scatter",
        "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
        "scatter_max", "sort", "top_k", "fft", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
    assert rules.SCATTERS == {n for n in rules.HEROES if n.startswith("scatter")}
    assert rules.DOT_LIKE == {"dot_general", "conv_general_dilated"}
    assert rules.BOUND_VIEWS == {
        "reshape", "squeeze", "expand_dims", "transpose", "bitcast_convert_type", "copy", "copy_p",
        "optimization_barrier", "broadcast_in_dim", "slice", "dynamic_slice", "convert_element_type",
        "reduce_precision", "real", "imag"}
    assert rules.CHAIN_VIEWS == {"transpose", "reshape", "slice", "split", "squeeze", "expand_dims"}
    assert rules.DOUBLED_VIEWS == {"transpose"}
    assert rules.IDENTITY_VIEWS == {"copy", "copy_p", "stop_gradient", "sharding_constraint", "mesh_cast",
                                    "reshard", "pvary"}
    assert rules.FOLDS_CONSTANTS == {"add", "sub", "mul", "div", "pow"}
    assert rules.WIDENED == {"select_and_scatter_add"}
    assert rules.CALL_PRIMITIVES == {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                                     "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint", "custom_lin_call"}
    assert rules.LOOP_PRIMITIVES == {"scan", "while", "cond"}
    assert {n for n, r in rules.RULES.items() if r.running_sum} == {"cumsum", "cumprod", "cumlogsumexp"}


# -- a primitive of the test's own, one row in the table ------------------------------------------

TEST_ADD = "jaxmem_test_add"
test_add_p = Primitive(TEST_ADD)
test_add_p.def_abstract_eval(lambda x, y: jax.core.ShapedArray(x.shape, x.dtype))
test_add_p.def_impl(lambda x, y: jnp.add(x, y))
mlir.register_lowering(test_add_p, mlir.lower_fun(lambda x, y: jnp.add(x, y), multiple_results=False))


@pytest.fixture
def test_add_row():
    """`TEST_ADD` with add's row (elementwise storage, a fusible producer, elementwise cost)."""
    rules.set_row(TEST_ADD, rules.RULES["add"])
    yield
    rules.set_row(TEST_ADD, None)


def _step(add):
    """A forward step (JAX has no derivative for the test's primitive): a GEMM, its bias added
    and fused into what reads it, and an update of the donated weights."""
    def step(w, x, b):
        h = jnp.tanh(add(x @ w, b))
        return add(h * h, x).sum(axis=0), add(w, w * 0.5)
    return step


ARGS = (jnp.ones((128, 128), jnp.float32), jnp.ones((64, 128), jnp.float32), jnp.ones((64, 128), jnp.float32))


def _jaxprs():
    ours = jax.make_jaxpr(_step(test_add_p.bind))(*ARGS)
    added = jax.make_jaxpr(_step(jnp.add))(*ARGS)
    names = [e.primitive.name for e in ours.jaxpr.eqns]
    # the same program, `add` spelled as the test's primitive
    assert names.count(TEST_ADD) == 3
    assert [n.replace(TEST_ADD, "add") for n in names] == [e.primitive.name for e in added.jaxpr.eqns]
    return ours, added


def test_the_row_is_added_and_removed(test_add_row):
    assert rules.rule(TEST_ADD) == rules.rule("add")
    assert TEST_ADD in rules.CHEAP and TEST_ADD in rules.ELEMENTWISE_COST and TEST_ADD in rules.FOLDS_CONSTANTS
    rules.set_row(TEST_ADD, None)
    assert TEST_ADD not in rules.CHEAP and rules.rule(TEST_ADD) is rules.UNKNOWN
    rules.set_row(TEST_ADD, rules.RULES["add"])


def test_a_new_row_plans_as_add(test_add_row):
    ours, added = (plan_jaxpr(j, donated=[True, False, False]) for j in _jaxprs())
    assert ours.valid and added.valid and not ours.unknown_primitives
    as_add = lambda p: [(s.primitive.replace(TEST_ADD, "add"), s.fused) for s in p.schedule]  # noqa: E731
    assert as_add(ours) == as_add(added)
    assert any(s.fused for s in ours.schedule if s.primitive == TEST_ADD)  # fused, as add is here
    assert (ours.peak_bytes, ours.arena_bytes) == (added.peak_bytes, added.arena_bytes)


def test_without_its_row_it_is_unknown():
    ours, _ = _jaxprs()
    assert plan_jaxpr(ours).unknown_primitives == [TEST_ADD]


def test_a_new_row_predicts_as_add_on_gpu(test_add_row):
    ours, added = (predict(j, donated=[True, False, False], device="h100-80gb") for j in _jaxprs())
    assert (ours.temp_bytes, ours.total_bytes, ours.fused_values) == \
        (added.temp_bytes, added.total_bytes, added.fused_values)


def test_a_new_row_bounds_as_add(test_add_row):
    ours = lower_bound(_step(test_add_p.bind), ARGS, donate_argnums=(0,))
    added = lower_bound(_step(jnp.add), ARGS, donate_argnums=(0,))
    assert (ours.bytes, ours.floor_bytes, ours.held_bytes) == (added.bytes, added.floor_bytes, added.held_bytes)
    assert ours.bytes > 0
    np.testing.assert_equal(ours.op.replace(TEST_ADD, "add"), added.op)
