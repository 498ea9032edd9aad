"""The front end, and the one module that touches JAX's jaxpr classes.

Tracing (`trace`: one error policy), donation (`donated_flat`), inlining of call-like
primitives into the one program representation (`inline` -> `program.Program`), value sizes
and user source lines (`source_line`: one skip rule) all live here. JAX renames and merges its
classes between releases, so everything else in jaxmem asks this module instead of importing
`jax.extend.core` or `jax._src` itself.

    >>> traced = trace(lambda x: x * 2, (np.ones(3, np.float32),))
    >>> [op.primitive for op in inline(traced.closed_jaxpr).ops]
    ['mul']
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import site
import sysconfig
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.extend import core as _extend_core

from jaxmem.compiler.plan_types import Const, SourceLine
from jaxmem.compiler.program import INPUT, Program
# Call-like primitives whose body the planner inlines into the caller's schedule, and the
# control flow whose bodies are planned on their own: the table's `body` column.
from jaxmem.compiler.rules import CALL_PRIMITIVES, LOOP_PRIMITIVES
from jaxmem.errors import PlanError


class _Core:
    """`jax.extend.core`, and where a name is missing from it (JAX 0.8 and 0.9 have no
    `DropVar`, `new_jaxpr_eqn` there), `jax._src.core`'s: one place absorbs the difference."""

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(_extend_core, name)
        except AttributeError:
            from jax._src import core

            return getattr(core, name)


jcore: Any = _Core()


_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))
_JAXMEM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP_DIRS = (
    _JAX_DIR + os.sep,
    os.path.join(os.path.dirname(_JAX_DIR), "jaxlib") + os.sep,
    _JAXMEM_DIR + os.sep,
)
# jaxmem's bundled example programs are user code as far as source lines go, and so is the
# package a TARGET was loaded from (`claim_user_code`), wherever it is installed.
_USER_DIRS: list[str] = [os.path.join(_JAXMEM_DIR, "examples") + os.sep]


def _installed_dirs() -> tuple[str, ...]:
    """Where installed libraries and the standard library live: their frames are not the user's."""
    paths = set(site.getsitepackages()) | {site.getusersitepackages()}
    paths |= {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(os.path.abspath(p) + os.sep for p in paths if p))


_INSTALLED_DIRS = _installed_dirs()


@dataclass
class Traced:
    """One traced call: the ClosedJaxpr, the pytree structures, and which flat inputs are donated."""

    closed_jaxpr: Any
    in_tree: Any                   # structure of the positional arguments (a tuple)
    out_tree: Any
    in_avals: list[Any]
    out_avals: list[Any]
    donated: tuple[int, ...]       # flat input positions donated


def trace(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
          donate_argnums: int | Sequence[int] = ()) -> Traced:
    """Trace `fn(*args, **kwargs)` to a ClosedJaxpr. Every failure is one `PlanError` line.

    Keyword arguments whose leaves are all arrays are inputs, as `jax.jit` treats them (they
    follow the positional ones, by sorted name); any other keyword (a flag, a Python number
    mixed with non-arrays) is closed over as a constant.

    **Arguments:** `fn`, the positional `args` (pytrees of arrays), `kwargs`, and
    `donate_argnums`, positional arguments whose buffers the caller donates.

    **Returns:** a `Traced`, whose jaxpr's invars are the flattened positional, then array
    keyword, arguments.
    """
    if not callable(fn):
        raise PlanError(f"expected a function, got {type(fn).__name__}")
    donated = donated_flat(args, donate_argnums)
    dynamic, static = split_kwargs(kwargs or {})

    def target(*flat_args: Any) -> Any:
        *positional, named = flat_args
        return fn(*positional, **named, **static)

    try:
        if kwargs:
            closed, shapes = jax.make_jaxpr(target, return_shape=True)(*args, dynamic)
        else:  # `fn` itself, so JAX's trace cache (per function object) applies
            closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # the user's function failed to trace (SystemExit too): one line
        first = first_sentence(str(err))
        raise PlanError(f"cannot trace {getattr(fn, '__name__', fn)!r}: {type(err).__name__}: {first}") from err
    return Traced(closed, jax.tree_util.tree_structure(tuple(args)), jax.tree_util.tree_structure(shapes),
                  [v.aval for v in closed.jaxpr.invars], [v.aval for v in closed.jaxpr.outvars], donated)


def make_closed_jaxpr(fn: Callable, *args: Any, return_shape: bool = False,
                      axis_env: Sequence[tuple[str, int]] | None = None) -> Any:
    """`jax.make_jaxpr(fn)(*args)`: the ClosedJaxpr of `fn` on `args` (pytrees of arrays or
    `jax.ShapeDtypeStruct`s), for callers that want JAX's own error, not `trace`'s `PlanError`
    line, and no donation or pytree bookkeeping. The one place outside `trace` that traces.

    **Arguments:** `return_shape`: also return the output's pytree of `jax.ShapeDtypeStruct`s;
    `axis_env`: named axes bound while tracing, (name, size) pairs (a per-device program that
    calls collectives over a mesh's axes).

    **Returns:** the ClosedJaxpr, or (ClosedJaxpr, output shapes) with `return_shape`. Like
    `jax.make_jaxpr`, tracing one function object twice may come from JAX's trace cache: hand
    a fresh function where the Python must run again (hooks that record what it calls).

        >>> [eqn_name(e) for e in jaxpr_eqns(make_closed_jaxpr(lambda x: x * 2, 1.0))]
        ['mul']
    """
    if axis_env is None:
        return jax.make_jaxpr(fn, return_shape=return_shape)(*args)
    return jax.make_jaxpr(fn, axis_env=list(axis_env), return_shape=return_shape)(*args)


def first_sentence(text: str, limit: int = 600) -> str:
    """An error message's first line, as one line, continued while it leaves a bracket open:
    JAX's first line can be a cut multi-line repr ("Error interpreting argument to
    _JitWrapper(" for an equinox filter_jit step), the rest of its sentence, naming the
    argument's path, on the lines below.

        >>> first_sentence("Error interpreting argument to f(\\n  a=1\\n) as an array at path x.\\nMore.")
        'Error interpreting argument to f( a=1 ) as an array at path x.'
        >>> first_sentence("not traceable\\nsecond line")
        'not traceable'
    """
    lines: list[str] = []
    depth = 0
    for line in text.splitlines():
        lines.append(line.strip())
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if depth <= 0:
            break
    out = " ".join(part for part in lines if part)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def donate_positions(num_args: int, donate_argnums: int | Sequence[int]) -> tuple[int, ...]:
    """`donate_argnums` checked (each a positional index, negative from the end) and made
    non-negative, in the order given. A bad entry is a `PlanError`."""
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    donate_argnums = tuple(donate_argnums)
    for k in donate_argnums:
        if not isinstance(k, int) or isinstance(k, bool) or not -num_args <= k < num_args:
            raise PlanError(f"donate_argnums {donate_argnums!r}: {k!r} is not a positional argument "
                            f"index (0..{num_args - 1})")
    return tuple(k % num_args for k in donate_argnums)


def donated_flat(args: Sequence[Any], donate_argnums: int | Sequence[int]) -> tuple[int, ...]:
    """Flat leaf positions of the positional arguments in `donate_argnums`, in order."""
    wanted = set(donate_positions(len(args), donate_argnums))
    flat, start = [], 0
    for k, count in enumerate(flat_arg_counts(args)):
        if k in wanted:
            flat.extend(range(start, start + count))
        start += count
    return tuple(flat)


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(array keywords, traced as inputs; the others, closed over as static)."""
    dynamic = {k: v for k, v in kwargs.items() if _all_arrays(v)}
    return dynamic, {k: v for k, v in kwargs.items() if k not in dynamic}


def _all_arrays(tree: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)


def flat_arg_counts(args: Sequence[Any]) -> list[int]:
    """Number of flattened leaves in each positional argument (to map donate_argnums)."""
    return [len(jax.tree_util.tree_leaves(a)) for a in args]


def is_tracer(value: Any) -> bool:
    """Whether `value` is one of JAX's tracers (a traced value, not an array)."""
    return isinstance(value, jcore.Tracer)


def is_literal(atom: Any) -> bool:
    return isinstance(atom, jcore.Literal)


def literal_value(atom: Any) -> Any:
    return atom.val


def is_dropvar(var: Any) -> bool:
    return isinstance(var, jcore.DropVar)


def eqn_name(eqn: Any) -> str:
    return eqn.primitive.name


def eqn_params(eqn: Any) -> dict[str, Any]:
    """An equation's parameters (read-only), for readers outside the front end."""
    return eqn.params


def eqn_in_avals(eqn: Any) -> list[Any]:
    """The abstract values an equation reads, in operand order (None where an atom has none)."""
    return [getattr(v, "aval", None) for v in eqn.invars]


def eqn_out_avals(eqn: Any) -> list[Any]:
    """The abstract values an equation writes, in output order (None where a var has none)."""
    return [getattr(v, "aval", None) for v in eqn.outvars]


def eqn_binder(eqn: Any) -> tuple[Callable[..., Any], bool]:
    """(bind, multiple_results) of an equation's primitive: `bind(*args, **params)` runs it."""
    return eqn.primitive.bind, bool(eqn.primitive.multiple_results)


def eqn_name_stack(eqn: Any) -> str | None:
    """JAX's name stack of an equation as text (e.g. "transpose(jvp(loss))"), or None."""
    name_stack = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    return None if name_stack is None else str(name_stack)


def eqn_effectful(eqn: Any) -> bool:
    """True when the equation has effects (never dropped, never recomputed)."""
    return bool(getattr(eqn, "effects", None))


def jaxpr_eqns(jaxpr: Any) -> list[Any]:
    """The equations of a jaxpr, closed or open."""
    return getattr(jaxpr, "jaxpr", jaxpr).eqns


def walk_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a jaxpr (closed or open), nested jaxprs included (scan and while
    bodies, cond branches, call and checkpoint bodies, custom rules): each equation, then the
    equations of the jaxprs in its parameters, depth first, in program order. The one walk
    over a jaxpr for readers outside the front end.

        >>> import jax.numpy as jnp
        >>> closed = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, y: (c * y, None), x, x)[0])(jnp.ones(3))
        >>> [eqn_name(e) for e in walk_eqns(closed)]
        ['scan', 'mul']
    """
    for eqn, _ in walk_eqns_enclosed(jaxpr):
        yield eqn


def walk_eqns_enclosed(jaxpr: Any, enclosing: tuple[str, ...] = ()) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """`walk_eqns` with, for each equation, the primitive names of the equations whose nested
    jaxprs hold it, outermost first (`()` at the top level; `("scan",)` inside a scan body)."""
    for eqn in jaxpr_eqns(jaxpr):
        yield eqn, enclosing
        subs = nested_jaxprs(eqn)
        if subs:
            inner = enclosing + (eqn_name(eqn),)
            for sub in subs:
                yield from walk_eqns_enclosed(sub, inner)


def eval_closed_jaxpr(closed_jaxpr: Any, args: Sequence[Any],
                      after_eqn: Callable[[Any, list[Any]], list[Any]] | None = None) -> list[Any]:
    """Run a ClosedJaxpr on its flat arguments (arrays or tracers) equation by equation with
    `bind` (sub-functions re-bound, so only for tracing it again), `after_eqn(eqn, outputs)`
    given each top-level equation's outputs and returning those to keep (fit tags the dots of a
    scan body this way). Its outputs, as a list."""
    jaxpr, consts = split_closed(closed_jaxpr)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(atom: Any) -> Any:
        return literal_value(atom) if is_literal(atom) else env[atom]

    for eqn in jaxpr.eqns:
        outs = bind(eqn, [read(a) for a in eqn.invars], subfuns_ok=True)
        if after_eqn is not None:
            outs = after_eqn(eqn, outs)
        for var, out in zip(eqn.outvars, outs):
            if not is_dropvar(var):
                env[var] = out
    return [read(a) for a in jaxpr.outvars]


def eqn_is(eqn: Any, primitive: Any) -> bool:
    """Whether an equation binds exactly this primitive object (not only one of its name)."""
    return eqn.primitive is primitive


def jaxpr_debug_info(jaxpr: Any) -> Any:
    """JAX's debug information of a jaxpr, closed or open (`func_src_info`, `traced_for`), or None."""
    return getattr(getattr(jaxpr, "jaxpr", jaxpr), "debug_info", None)


def jaxpr_outvars(jaxpr: Any) -> list[Any]:
    """The output atoms (variables or literals) of a jaxpr, closed or open."""
    return list(getattr(jaxpr, "jaxpr", jaxpr).outvars)


def jaxpr_in_avals(jaxpr: Any) -> list[Any]:
    """The abstract values of a jaxpr's inputs, closed or open."""
    return [v.aval for v in getattr(jaxpr, "jaxpr", jaxpr).invars]


@dataclass
class OutputOrigin:
    """Where one output of a program comes from: the input it passes through unchanged
    (`passed_input`), or the source line of the equation that made it; its bytes."""

    passed_input: int | None
    source: SourceLine | None
    nbytes: int


def output_origins(closed_jaxpr: Any) -> list[OutputOrigin]:
    """For each output of a closed jaxpr: the input it returns as it came in, else the user's
    line that made it (the outer equation's; None for a constant)."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    inputs = {v: k for k, v in enumerate(jaxpr.invars)}
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    origins = []
    for atom in jaxpr.outvars:
        nbytes = aval_bytes(atom.aval)
        if is_literal(atom):
            origins.append(OutputOrigin(None, None, nbytes))
        elif atom in inputs:
            origins.append(OutputOrigin(inputs[atom], None, nbytes))
        else:
            eqn = made.get(atom)
            origins.append(OutputOrigin(None, source_line(eqn) if eqn is not None else None, nbytes))
    return origins


def constant_output(closed_jaxpr: Any, j: int) -> tuple[Any, Any]:
    """(value, aval) of output `j` of a closed jaxpr, when it is a literal or a constant."""
    jaxpr, consts = split_closed(closed_jaxpr)
    atom = jaxpr.outvars[j]
    if is_literal(atom):
        return literal_value(atom), atom.aval
    return dict(zip(jaxpr.constvars, consts))[atom], atom.aval


def eqn_in_shapes(eqn: Any) -> list[tuple[int, ...]]:
    """The shapes an equation reads, in operand order (0 for a dimension that is not a number)."""
    return [aval_shape_dtype(v)[0] for v in eqn.invars]


def aval_shape_dtype(atom: Any) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, bytes) of a variable or literal; tokens and refs without data are 0 bytes."""
    return _shape_dtype_bytes(atom.aval)


@functools.lru_cache(maxsize=256)
def element_bits(dtype: Any) -> int:
    """Bits one element of `dtype` takes in device memory. XLA packs sub-byte types (int4,
    uint4, int2, float4_e2m1fn: two or four to a byte, `memory_analysis()` counts them so),
    where numpy's itemsize says one byte; a typed PRNG key (key<fry>) is its key data's bytes,
    which `dtype.itemsize` gives though `np.dtype` cannot read it."""
    try:
        bytes_ = int(dtype.itemsize)
    except (AttributeError, TypeError):
        return 32  # an extended dtype we cannot size: assume one 32-bit word per element
    if bytes_ == 1 and isinstance(dtype, np.dtype):
        import ml_dtypes

        for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
            try:
                return min(8, int(info(dtype).bits))
            except (ValueError, TypeError):
                continue
    return 8 * bytes_


def aval_bytes(aval: Any) -> int:
    """Bytes of one value of this abstract type (0 for tokens and other values without data).
    The one value-size rule; fast, since costs ask it for every operand of every equation."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        bits = element_bits(dtype)
    except TypeError:  # an unhashable dtype
        bits = element_bits.__wrapped__(dtype)
    count = 1
    for d in shape:
        count *= int(d) if isinstance(d, (int, np.integer)) else 0
    return -(-count * bits // 8)  # packed: whole bytes per array, as XLA's ByteSizeOf


def _shape_dtype_bytes(aval: Any) -> tuple[tuple[int, ...], str, int]:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return (), type(aval).__name__, 0
    try:
        return _sized(tuple(shape), dtype)
    except TypeError:  # a dimension or dtype that cannot be hashed: size it afresh
        return _sized.__wrapped__(tuple(shape), dtype)


@functools.lru_cache(maxsize=4096)
def _sized(shape: tuple[Any, ...], dtype: Any) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, bytes) of one (shape, dtype): a program asks it for every value, and
    has few distinct ones (`str(dtype)` and the size are most of inlining's own time)."""
    aval = types.SimpleNamespace(shape=shape, dtype=dtype)
    return tuple(int(d) if isinstance(d, (int, np.integer)) else 0 for d in shape), str(dtype), aval_bytes(aval)


def split_closed(obj: Any) -> tuple[Any, list[Any]]:
    """(open jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    if isinstance(obj, jcore.ClosedJaxpr):
        return obj.jaxpr, list(obj.consts)
    return obj, []


def call_body(eqn: Any) -> tuple[Any, list[Any]] | None:
    """The (jaxpr, consts) a call-like equation runs on its operands, or None if it is not one.

    The body's invars line up with the equation's invars, its outvars with the outvars.
    """
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if isinstance(body, (jcore.ClosedJaxpr, jcore.Jaxpr)):
            jaxpr, consts = split_closed(body)
            if len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
                return jaxpr, consts
    return None


def loop_bodies(eqn: Any) -> list[Any]:
    """The ClosedJaxprs a scan/while/cond equation runs (scan: [body]; while: [cond, body];
    cond: its branches)."""
    name = eqn.primitive.name
    if name == "scan":
        return [eqn.params["jaxpr"]]
    if name == "while":
        return [eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]]
    if name == "cond":
        return list(eqn.params["branches"])
    return []


def inline(closed_jaxpr: Any) -> Program:
    """The program of a ClosedJaxpr with call-like primitives inlined (dead code kept: see
    `program.drop_dead`).

    **Arguments:** `closed_jaxpr`, as `jax.make_jaxpr` returns it (read-only).

    **Returns:** a `Program`: one op per equation that runs, literals and constants as `Const`.
    """
    jaxpr, consts = split_closed(closed_jaxpr)
    p = Program(closed_jaxpr=closed_jaxpr)
    env: dict[Any, int | Const] = {}
    for var, const in zip(jaxpr.constvars, consts):
        env[var] = Const(const, var.aval)
    for var in jaxpr.invars:
        vid = p.new_value(*_shape_dtype_bytes(var.aval), var.aval, INPUT, None)
        env[var] = vid
        p.var_ids[var] = vid
        p.invars.append(vid)
    _inline_into(p, jaxpr, env)
    p.outvars = [_resolve(env, atom) for atom in jaxpr.outvars]
    p.outvar_bytes = [aval_shape_dtype(atom)[2] for atom in jaxpr.outvars]
    p.num_eqns = count_eqns(jaxpr)
    return p


def _resolve(env: dict[Any, int | Const], atom: Any) -> int | Const:
    if isinstance(atom, jcore.Literal):
        return Const(atom.val, atom.aval)
    return env[atom]


def _walk_calls(jaxpr: Any, env: dict[Any, Any], outer: Any, constant: Callable[[Any, Any], Any],
                resolve: Callable[[dict[Any, Any], Any], Any],
                on_call_output: Callable[[Any, Any], None] | None = None
                ) -> Iterator[tuple[Any, list[Any], Any, dict[Any, Any]]]:
    """The one inliner: yields `(eqn, operands, outer, env)` for every equation of `jaxpr` that
    is not call-like, with call bodies walked in their place. `env` maps variables to the caller's
    handles (value ids, fresh variables); the caller must put each yielded equation's outputs into
    the `env` yielded with it (the scope of the body it is in) before taking the next.

    `outer` is the innermost enclosing call equation that has a user frame: JAX records only the
    innermost frames of a traceback, so an equation deep inside a library call (jax.nn.relu's
    body) may have no user frame of its own and takes its caller's. `constant(var, value)` makes
    the handle of a body's closed-over constant."""
    for eqn in jaxpr.eqns:
        operands = [resolve(env, a) for a in eqn.invars]
        body = call_body(eqn)
        if body is None:
            yield eqn, operands, outer, env
            continue
        inner, consts = body
        inner_env = {var: constant(var, const) for var, const in zip(inner.constvars, consts)}
        inner_env.update(zip(inner.invars, operands))
        yield from _walk_calls(inner, inner_env, eqn if source_line(eqn) is not None else outer,
                               constant, resolve, on_call_output)
        for var, atom in zip(eqn.outvars, inner.outvars):
            if not isinstance(var, jcore.DropVar):
                env[var] = resolve(inner_env, atom)
                if on_call_output is not None:
                    on_call_output(var, env[var])


def _inline_into(p: Program, jaxpr: Any, env: dict[Any, int | Const]) -> None:
    """Add the equations of `jaxpr`, calls inlined, to `p` as ops."""
    outer_lines: dict[int, SourceLine | None] = {}

    def call_output(var: Any, handle: int | Const) -> None:
        if not isinstance(handle, Const):
            p.var_ids[var] = handle

    for eqn, operands, outer, scope in _walk_calls(jaxpr, env, None, lambda var, c: Const(c, var.aval), _resolve,
                                                   call_output):
        index = len(p.ops)
        source = source_line(eqn)
        if source is None and outer is not None:
            if id(outer) not in outer_lines:
                outer_lines[id(outer)] = source_line(outer)
            source = outer_lines[id(outer)]
        outputs: list[int | None] = []
        for var in eqn.outvars:
            if isinstance(var, jcore.DropVar):
                outputs.append(None)
                continue
            aval = var.aval
            vid = p.new_value(*_shape_dtype_bytes(aval), aval, index, source)
            scope[var] = vid
            p.var_ids[var] = vid
            outputs.append(vid)
        p.add_op(eqn, eqn.primitive.name, operands, outputs, source, bool(getattr(eqn, "effects", None)))


def count_eqns(jaxpr: Any) -> int:
    """Equations in a jaxpr, counting those inside nested jaxprs too."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in nested_jaxprs(eqn):
            total += count_eqns(sub)
    return total


def bind(eqn: Any, args: Sequence[Any], subfuns_ok: bool = False) -> list[Any]:
    """Run one equation's primitive on `args` (arrays or tracers): its outputs, as a list.
    `subfuns_ok`: also re-bind primitives that take sub-functions (shard_map), as JAX's own
    evaluator does; only for tracing, where they are traced again."""
    prim = eqn.primitive
    # JAX releases differ: get_bind_params returns params, or (subfuns, params) with subfuns
    # empty for every primitive the front end leaves un-inlined.
    params = prim.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):
        subfuns, params = params
        if subfuns and not subfuns_ok:
            raise PlanError(f"cannot re-run primitive {prim.name}: it binds sub-functions")
    result = prim.bind(*subfuns, *args, **params)
    return list(result) if prim.multiple_results else [result]


def as_closed(obj: Any) -> Any:
    """A ClosedJaxpr for an open Jaxpr (no consts) or the ClosedJaxpr itself."""
    if isinstance(obj, jcore.ClosedJaxpr):
        return obj
    return jcore.ClosedJaxpr(obj, [])


def nested_jaxprs(eqn: Any) -> list[Any]:
    """Every jaxpr (open) found in an equation's parameters, for counting and discovery."""
    return [split_closed(j)[0] for j in jcore.jaxprs_in_params(eqn.params)]


def scan_counts(eqn: Any) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan equation."""
    return int(eqn.params["num_consts"]), int(eqn.params["num_carry"])


def while_counts(eqn: Any) -> tuple[int, int]:
    """(cond_nconsts, body_nconsts) of a while equation."""
    return int(eqn.params["cond_nconsts"]), int(eqn.params["body_nconsts"])


def claim_user_code(path: str) -> None:
    """Count `path` (a package's folder, or one module's file) as the user's own code, even where
    it lies among installed libraries: the package a TARGET was loaded from."""
    path = os.path.abspath(path)
    prefix = path + os.sep if os.path.isdir(path) else path
    if prefix not in _USER_DIRS:
        _USER_DIRS.append(prefix)
        _frame_kind.cache_clear()


_INTERNAL, _LIBRARY, _USER = 0, 1, 2


def is_internal_frame(filename: str) -> bool:
    """True for a frame of JAX, jaxmem or the interpreter itself: never the user's call site."""
    return _frame_kind(filename) == _INTERNAL


def is_library_frame(filename: str) -> bool:
    """True for a frame of an installed library other than JAX and jaxmem (Flax, Equinox)."""
    return _frame_kind(filename) == _LIBRARY


@functools.lru_cache(maxsize=4096)
def _frame_kind(filename: str) -> int:
    """Whose code a file is: JAX's or jaxmem's own (never shown), an installed library's, or
    the user's."""
    if not filename or filename.startswith("<frozen"):
        return _INTERNAL  # the interpreter's own frozen modules
    if filename.startswith("<"):
        return _USER  # code typed into a notebook cell or `exec`ed: the user's, with no file
    path = os.path.abspath(filename)
    if path.startswith(tuple(_USER_DIRS)):
        return _USER
    if path.startswith(_SKIP_DIRS):
        return _INTERNAL
    if path.startswith(_INSTALLED_DIRS) or f"{os.sep}site-packages{os.sep}" in path \
            or f"{os.sep}dist-packages{os.sep}" in path:
        return _LIBRARY
    return _USER


def _frames(eqn: Any) -> Iterator[tuple[int, str, int, str]]:
    """(kind, file, line, function) of each frame outside JAX and jaxmem, innermost first."""
    info = getattr(eqn, "source_info", None)
    tb = getattr(info, "traceback", None)
    if tb is None:
        return
    try:
        codes, lastis = tb.raw_frames()
    except (AttributeError, TypeError):
        return
    for code, lasti in zip(codes, lastis):
        kind = _frame_kind(code.co_filename)
        if kind != _INTERNAL:
            yield kind, code.co_filename, _line(tb, code, lasti), code.co_name


def source_line(eqn: Any) -> SourceLine | None:
    """The user's frame that made this equation: the innermost frame of the user's own code,
    with the innermost library frame below it kept as `library` (a Flax layer's `__call__`).
    An equation made by library code alone gets that library's frame. Runs once per equation,
    so it stops at the first user frame."""
    library = None
    for kind, file, line, function in _frames(eqn):
        if kind == _USER:
            return SourceLine(file, line, function, library)
        if library is None:
            library = SourceLine(file, line, function)
    return library


def user_frames(eqn: Any, limit: int = 64) -> tuple[tuple[str, int, str], ...]:
    """The user's Python stack that made this equation, innermost first, as (file, line,
    function): from the frame `source_line` takes outwards, for pprof profiles, which want the
    whole stack (library frames between the user's are kept: they are the path of the call).

    For an equation made in `loss_fn` at line 42 of train.py, the first frame is
    `('/home/me/train.py', 42, 'loss_fn')`.
    """
    frames = [f for f in itertools.islice(_frames(eqn), 4 * limit)]
    first_user = next((i for i, f in enumerate(frames) if f[0] == _USER), 0)
    return tuple((file, line, function) for _, file, line, function in frames[first_user:first_user + limit])


def _line(tb: Any, code: Any, lasti: int) -> int:
    try:
        return int(tb.code_addr2line(code, lasti))
    except (AttributeError, TypeError, ValueError):
        return code.co_firstlineno


def inline_calls(closed_jaxpr: Any) -> Any:
    """A flat copy of a ClosedJaxpr: call-like equations replaced by their bodies (with fresh
    variables per call, so one body inlined twice stays two sets of values). Loops and other
    primitives with nested jaxprs stay one equation. An inlined equation with no user frame of
    its own takes its caller's source information.

    >>> import jax.numpy as jnp
    >>> flat = inline_calls(jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0))
    >>> [eqn_name(e) for e in flat.jaxpr.eqns]
    ['sin', 'mul']
    """
    jaxpr, consts = split_closed(closed_jaxpr)
    constvars, constvals, eqns = list(jaxpr.constvars), list(consts), []

    def resolve(env: dict[Any, Any], atom: Any) -> Any:
        return atom if isinstance(atom, jcore.Literal) else env.get(atom, atom)

    def constant(var: Any, value: Any) -> Any:
        constvars.append(jcore.Var(var.aval))
        constvals.append(value)
        return constvars[-1]

    env: dict[Any, Any] = {}
    for eqn, operands, outer, scope in _walk_calls(jaxpr, env, None, constant, resolve):
        outs = []
        for var in eqn.outvars:
            if isinstance(var, jcore.DropVar):
                outs.append(var)
            else:
                scope[var] = jcore.Var(var.aval)
                outs.append(scope[var])
        info = outer.source_info if outer is not None and source_line(eqn) is None else eqn.source_info
        eqns.append(eqn.replace(invars=operands, outvars=outs, source_info=info))
    flat = jcore.Jaxpr(constvars, list(jaxpr.invars), [resolve(env, a) for a in jaxpr.outvars], eqns,
                       jaxpr.effects, jaxpr.debug_info)
    return jcore.ClosedJaxpr(flat, constvals)


def with_avals(closed_jaxpr: Any, shapes: dict[Any, tuple[int, ...]],
               extra: dict[int, list[tuple[str, int]]] | None = None) -> Any:
    """A copy of a flat ClosedJaxpr (see `inline_calls`) whose variables have the shapes in
    `shapes` (others keep theirs), for planning a per-device program. `extra[i]` lists buffers
    `(primitive name, bytes)` that equation i reads besides its operands (collectives' buffers):
    each becomes an equation of that name, after equation i's operands, and an operand of i.
    The copy is for planning only: parameters still describe the original shapes.
    """
    jaxpr, consts = split_closed(closed_jaxpr)
    extra = extra or {}
    env: dict[Any, Any] = {}
    prims: dict[str, Any] = {}

    def var(old: Any) -> Any:
        if isinstance(old, (jcore.Literal, jcore.DropVar)):
            return old
        if old not in env:
            aval = old.aval
            shape = shapes.get(old)
            if shape is not None and tuple(shape) != tuple(aval.shape):
                aval = jax.core.ShapedArray(tuple(shape), aval.dtype, weak_type=getattr(aval, "weak_type", False))
            env[old] = jcore.Var(aval)
        return env[old]

    eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        operands = [var(a) for a in eqn.invars]
        for name, nbytes in extra.get(i, ()):
            prim = prims.setdefault(name, jcore.Primitive(name))
            buf = jcore.Var(jax.core.ShapedArray((int(nbytes),), np.uint8))
            sources = [a for a in operands if not isinstance(a, jcore.Literal)]
            eqns.append(jcore.new_jaxpr_eqn(sources, [buf], prim, {}, frozenset(), eqn.source_info))
            operands.append(buf)
        eqns.append(eqn.replace(invars=operands, outvars=[var(v) for v in eqn.outvars]))
    new = jcore.Jaxpr([var(v) for v in jaxpr.constvars], [var(v) for v in jaxpr.invars],
                      [var(a) for a in jaxpr.outvars], eqns, jaxpr.effects, jaxpr.debug_info)
    return jcore.ClosedJaxpr(new, consts)


def flat_structure(closed_jaxpr: Any) -> tuple[list[Any], list[tuple[list[Any], list[Any]]], dict[Any, tuple[int, ...]]]:
    """A flat ClosedJaxpr's data flow with its variables as opaque keys: the inputs, each
    equation's operands and outputs (literals and dropped outputs left out), and every
    variable's shape. For passes outside the compiler that only need who reads what.

    >>> import jax.numpy as jnp
    >>> ins, eqns, shapes = flat_structure(jax.make_jaxpr(lambda x: jnp.sin(x) + 1)(jnp.ones(3)))
    >>> len(ins), len(eqns), shapes[ins[0]]
    (1, 2, (3,))
    """
    jaxpr, _ = split_closed(closed_jaxpr)
    shapes: dict[Any, tuple[int, ...]] = {v: tuple(int(d) for d in v.aval.shape) for v in jaxpr.invars}
    eqns = []
    for eqn in jaxpr.eqns:
        operands = [a for a in eqn.invars if not is_literal(a)]
        outputs = [v for v in eqn.outvars if not is_dropvar(v)]
        shapes.update((v, tuple(int(d) for d in v.aval.shape)) for v in outputs)
        eqns.append((operands, outputs))
    return list(jaxpr.invars), eqns, shapes


def run_with_scopes(closed_jaxpr: Any, prefix: str) -> Callable[..., list[Any]]:
    """A function of the flat arguments that runs a flat ClosedJaxpr (`inline_calls`) with
    equation i bound under `jax.named_scope(f"{prefix}{i}")`: the same program for XLA (names
    are metadata), with every HLO instruction traceable to its equation."""
    jaxpr, consts = split_closed(closed_jaxpr)

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(atom: Any) -> Any:
            return literal_value(atom) if is_literal(atom) else env[atom]

        for i, eqn in enumerate(jaxpr.eqns):
            with jax.named_scope(f"{prefix}{i}"):
                outs = bind(eqn, [read(a) for a in eqn.invars], subfuns_ok=True)
            for var, out in zip(eqn.outvars, outs):
                if not is_dropvar(var):
                    env[var] = out
        return [read(a) for a in jaxpr.outvars]

    return run


def single_shard_map_body(closed_jaxpr: Any) -> Any | None:
    """The body (a ClosedJaxpr, per-device shapes) of a program that is one `shard_map`, else None."""
    eqns = closed_jaxpr.jaxpr.eqns
    if len(eqns) != 1 or eqns[0].primitive.name != "shard_map":
        return None
    return as_closed(eqns[0].params["jaxpr"])


def checkpoint_names(closed_jaxpr: Any) -> list[str]:
    """The names the user tagged with `jax.ad_checkpoint.checkpoint_name`, in first-seen order
    (nested jaxprs included), for `save_only_these_names`."""
    found: list[str] = []
    for eqn in walk_eqns(closed_jaxpr):
        if eqn.primitive.name == "name":
            name = str(eqn.params.get("name"))
            if name not in found:
                found.append(name)
    return found


def is_user_file(filename: str) -> bool:
    """True for a frame of the user's own code (not JAX, jaxmem, an installed library or the
    interpreter): where a checkpoint site's call can be written."""
    return _frame_kind(filename) == _USER


def scope_runs(closed_jaxpr: Any, prefix: str) -> dict[int, tuple[int, int]]:
    """For each name scope `f"{prefix}{n}"` on the top-level equations, the range [start, end)
    of the equations made under it (a Python call traced inside `jax.named_scope`)."""
    import re

    pattern = re.compile(re.escape(prefix) + r"(\d+)(?![\d])")
    runs: dict[int, tuple[int, int]] = {}
    for i, eqn in enumerate(jaxpr_eqns(closed_jaxpr)):
        for n in {int(m) for m in pattern.findall(eqn_name_stack(eqn) or "")}:
            start, _ = runs.get(n, (i, i))
            runs[n] = (start, i + 1)
    return runs


@dataclass(frozen=True)
class ScanEqn:
    """A top-level `scan` equation: where, what it iterates (`traced_for`: "scan" or
    "fori_loop"), the name of the body the user handed it and where that body is defined
    ("file:line", "?" where JAX does not say)."""

    index: int
    source: SourceLine | None
    traced_for: str
    body: str
    defined: str = "?"


def scan_eqns(closed_jaxpr: Any) -> list[ScanEqn]:
    """The top-level `scan` equations of a jaxpr (from `lax.scan` however imported, and from
    `fori_loop` with static bounds)."""
    found = []
    for i, eqn in enumerate(jaxpr_eqns(closed_jaxpr)):
        if eqn.primitive.name != "scan":
            continue
        info = getattr(eqn.params["jaxpr"].jaxpr, "debug_info", None)
        src = str(getattr(info, "func_src_info", "") or "")
        name, _, where = src.partition(" at ")
        found.append(ScanEqn(i, source_line(eqn), str(getattr(info, "traced_for", "scan") or "scan"),
                             name or "body", where or "?"))
    return found


def run_checkpointed(closed_jaxpr: Any, runs: Sequence[tuple[int, int]], scans: Sequence[int],
                     checkpoint: Callable[[Callable[..., Any]], Callable[..., Any]],
                     run_checkpoints: dict[int, Callable[[Callable[..., Any]], Callable[..., Any]]] | None = None,
                     ) -> Callable[..., list[Any]]:
    """A function of the flat arguments that runs a ClosedJaxpr with each range of top-level
    equations in `runs` evaluated as one function under `checkpoint(fn)` (a user's call wrapped
    in `jax.checkpoint`; `run_checkpoints[start]`, where given, in place of `checkpoint` for the
    range beginning there), and each scan equation in `scans` run again through `lax.scan` with
    `checkpoint(body)`. Ranges must not overlap; everything else is bound as traced."""
    jaxpr, consts = split_closed(closed_jaxpr)
    eqns = list(jaxpr.eqns)
    starts = {s: e for s, e in runs}
    per_run = run_checkpoints or {}
    scan_set = set(scans)

    def read_from(env: dict[Any, Any], atom: Any) -> Any:
        return literal_value(atom) if is_literal(atom) else env[atom]

    def write(env: dict[Any, Any], eqn: Any, outs: Sequence[Any]) -> None:
        for var, out in zip(eqn.outvars, outs):
            if not is_dropvar(var):
                env[var] = out

    def later_reads(end: int) -> set[Any]:
        used = {a for e in eqns[end:] for a in e.invars if not is_literal(a)}
        return used | {a for a in jaxpr.outvars if not is_literal(a)}

    def run_range(env: dict[Any, Any], start: int, end: int) -> None:
        block = eqns[start:end]
        made = {v for e in block for v in e.outvars if not is_dropvar(v)}
        ins = list(dict.fromkeys(a for e in block for a in e.invars if not is_literal(a) and a not in made))
        needed = later_reads(end)
        outs = [v for e in block for v in e.outvars if not is_dropvar(v) and v in needed]

        def call(*values: Any) -> list[Any]:
            local = dict(zip(ins, values))
            for e in block:
                write(local, e, bind(e, [read_from(local, a) for a in e.invars], subfuns_ok=True))
            return [local[v] for v in outs]

        for var, value in zip(outs, per_run.get(start, checkpoint)(call)(*[env[a] for a in ins])):
            env[var] = value

    def run_scan(env: dict[Any, Any], eqn: Any) -> None:
        body = eqn.params["jaxpr"]
        n_consts, n_carry = scan_counts(eqn)
        values = [read_from(env, a) for a in eqn.invars]
        consts_, init, xs = values[:n_consts], values[n_consts:n_consts + n_carry], values[n_consts + n_carry:]

        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outs = jcore.jaxpr_as_fun(body)(*consts_, *carry, *x)
            return list(outs[:n_carry]), list(outs[n_carry:])

        carry, ys = jax.lax.scan(checkpoint(step), init, xs, length=eqn.params["length"],
                                 reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
        write(env, eqn, [*carry, *ys])

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        i = 0
        while i < len(eqns):
            if i in starts:
                run_range(env, i, starts[i])
                i = starts[i]
                continue
            eqn = eqns[i]
            if i in scan_set:
                run_scan(env, eqn)
            else:
                write(env, eqn, bind(eqn, [read_from(env, a) for a in eqn.invars], subfuns_ok=True))
            i += 1
        return [read_from(env, a) for a in jaxpr.outvars]

    return run


def run_recording_programs(run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """`run()`'s result, and the StableHLO text of every program JAX compiled while it ran (an
    eager op is a program of its own; JAX's `jax_dump_ir_to` option, restored after)."""
    import glob
    import shutil
    import tempfile

    from jax._src import config

    folder = tempfile.mkdtemp(prefix="jaxmem-ir-")
    before = (config.jax_dump_ir_to.value, config.jax_dump_ir_modes.value)
    jax.config.update("jax_dump_ir_to", folder)
    jax.config.update("jax_dump_ir_modes", "stablehlo")
    try:
        result = run()
        jax.block_until_ready([x for x in jax.tree.leaves(result) if isinstance(x, jax.Array)])
        texts = []
        for path in sorted(glob.glob(os.path.join(folder, "*.mlir"))):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        return result, texts
    finally:
        jax.config.update("jax_dump_ir_to", before[0])
        jax.config.update("jax_dump_ir_modes", before[1])
        shutil.rmtree(folder, ignore_errors=True)


def compile_text_for(device: Any, text: str) -> Any:
    """XLA's compiled memory stats (`generated_code_size_in_bytes`, `temp_size_in_bytes`, ...)
    of a StableHLO program text compiled for one compile-only device (a TPU topology's)."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    # The options `jax.jit` compiles one device's program with (SPMD, Shardy, the device).
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1,
                                           device_assignment=np.array([[device]]), backend=device.client)
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        executable = device.client.compile(module, executable_devices=xc.DeviceList((device,)),
                                           compile_options=options)
    return executable.get_compiled_memory_stats()


def compile_text_executable(device: Any, text: str, options: dict[str, Any] | None = None) -> Any:
    """A StableHLO program text compiled for one compile-only device (a GPU's or a TPU chip's),
    with `options` (XLA's debug options, as `Lowered.compile(compiler_options=...)` takes
    them): JAX's executable, read through `executable_figures`.

    The options are the ones `jax.jit` compiles one device's program with (SPMD, Shardy, the
    device), so the figures equal those of `jax.jit(f).lower(...).compile()` for the program
    the text was lowered from.
    """
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    compile_options = compiler.get_compile_options(
        num_replicas=1, num_partitions=1, device_assignment=np.array([[device]]), backend=device.client,
        env_options_overrides=dict(options or {}))
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        return device.client.compile(module, executable_devices=xc.DeviceList((device,)),
                                     compile_options=compile_options)


def compile_partitioned_text(devices: Sequence[Any], text: str, options: dict[str, Any] | None,
                             inputs: int, outputs: int) -> Any:
    """A StableHLO program text with shardings (`sdy.sharding`, `mhlo.num_partitions`)
    compiled as `jax.jit` compiles a program partitioned over `devices` (compile-only GPUs or
    TPU chips, or this host's CPU devices): one replica, N partitions in mesh order, the
    `inputs` kept arguments' shardings as written, the `outputs`' propagated by XLA."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    client = devices[0].client
    compile_options = compiler.get_compile_options(
        num_replicas=1, num_partitions=len(devices), device_assignment=np.array([list(devices)], dtype=object),
        env_options_overrides=dict(options or {}), backend=client)
    build = compile_options.executable_build_options
    build.allow_spmd_sharding_propagation_to_parameters = [False] * max(1, inputs)
    build.allow_spmd_sharding_propagation_to_output = [True] * max(1, outputs)
    # Host devices are real: their client compiles and loads (compile-only GPUs and TPU chips
    # only compile).
    real = devices[0].platform == "cpu" and hasattr(client, "compile_and_load")
    compile = client.compile_and_load if real else client.compile
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        return compile(module, executable_devices=xc.DeviceList(tuple(devices)), compile_options=compile_options)


def output_partition_specs(executable: Any, mesh: Any) -> list[tuple[Any, ...]]:
    """Each output's `PartitionSpec` over `mesh` (as a tuple), as XLA's partitioner left it in
    a `compile_partitioned_text` executable."""
    from jax._src.sharding_impls import parse_flatten_op_sharding

    return [tuple(parse_flatten_op_sharding(s, mesh)[0]) for s in (executable.get_output_shardings() or [])]


@contextlib.contextmanager
def traceback_frames_kept() -> Iterator[None]:
    """JAX's traceback filtering off in this thread for the duration (the setting given back
    after), so that the frames an error passed through can be read (a collective over a mesh
    axis that does not exist raises a bare AssertionError; `xla.sharding._unknown_axis` reads
    the axis from those frames)."""
    try:
        from jax._src.config import traceback_filtering
    except ImportError:   # JAX moved it: the frames are then filtered as the user has them
        yield
        return
    with traceback_filtering("off"):
        yield


def executable_figures(executable: Any) -> tuple[Any, str, list[Any], list[Any]]:
    """(memory stats, optimized HLO text, parameter layouts, output layouts) of an executable
    `compile_text_executable` made; a layout is a `jax.experimental.layout.Layout` (None where
    the executable gives none)."""
    from jax.experimental.layout import Layout

    def layouts(read: Callable[[], Any]) -> list[Any]:
        try:
            return [Layout.from_pjrt_layout(p) for p in read()]
        except Exception:  # no layouts from this compile: JAX's own bytes stand
            return []

    modules = executable.hlo_modules()
    hlo = modules[0].to_string() if modules else ""
    return (executable.get_compiled_memory_stats(), hlo, layouts(executable.get_parameter_layouts),
            layouts(executable.get_output_layouts))


def compile_keeping_lowered_shardings(lowered: Any, **kwargs: Any) -> Any:
    """`lowered.compile(**kwargs)` with the outputs' shardings JAX lowered with, not those it
    would build from the compiled executable's memory kinds (JAX 0.8 builds them from the
    device's memory kinds, which a compile-only CUDA device does not list; JAX's own fallback
    when it cannot is the lowered ones)."""
    from jax._src.interpreters import pxla

    real = pxla.get_out_shardings_from_executable
    pxla.get_out_shardings_from_executable = lambda *args, **kw: None
    try:
        return lowered.compile(**kwargs)
    finally:
        pxla.get_out_shardings_from_executable = real


def in_own_thread(work: Callable[[], Any]) -> Any:
    """`work()` run in a thread of its own: JAX records each equation's Python stack, and the
    caller's frames (a notebook cell, a test, the command line) would otherwise land in the
    lowered program's locations, so that the same program, analysed from two places, never
    hits the compile cache (keyed by the program text)."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = work()
        except BaseException as err:  # handed back to the caller's thread
            box["err"] = err

    worker = threading.Thread(target=run, name="jaxmem-trace")
    worker.start()
    worker.join()
    if "err" in box:
        raise box["err"]
    return box["out"]
