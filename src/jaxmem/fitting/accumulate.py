"""Gradient accumulation at a grad site: the gradient of a batch as the mean of its micro-batches'.

A step that differentiates a loss over a batch holds every activation of the whole batch between
the forward and the backward pass. Run over `steps` micro-batches, one after another in a
`lax.scan`, it holds one micro-batch's and a running sum of the gradients: the same FLOPs, the
activations divided by `steps`, the matrix products smaller (and, on a mesh, each micro-batch
gathers the weights again). Where the loss averages over its batch, the mean of the micro-batch
gradients is the batch's gradient.

Fit offers it at a grad site (`jax.grad(loss)(params, batch)`, `jax.value_and_grad`) whose
non-differentiated arguments carry the batch: each argument whose every leaf has the same leading
dimension, the one most of them share (`batch_split`). A batch the loss closes over instead is not
split (fit says so). Two forms compute the same values:

- `ACCUMULATE_SOURCE`, the helper the user pastes, which runs their gradient function once per
  micro-batch;
- `accumulated`, what fit traces at the grad site while judging (the gradient function is JAX's,
  entered through `fitting.sites`' hook): the loss of the micro-batches, plus a term whose value
  is zero and whose gradient is their mean gradient, so `grad`, `value_and_grad` and `has_aux`
  hand back what the helper does.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import types
from collections import Counter
from typing import Any, Callable, ContextManager, Sequence

import jax
import jax.numpy as jnp

from jaxmem.errors import PlanError

ACCUMULATE = "accumulate_gradients"   # the candidate's policy name in fit's tables
MAX_STEPS = 64   # micro-batches fit tries at most (doubling from 2)

# What the user pastes, once, beside their step. The fit tests exec this very text.
ACCUMULATE_SOURCE = '''\
def accumulate(grad_fn, steps, split):
    """grad_fn(*args, **kwargs) over `steps` micro-batches of the arguments at `split`
    (positions or keyword names): each micro-batch takes every steps-th row of their leading
    axis, so a batch sharded over devices stays where it is. Float results (the loss, the
    gradients) are the mean over micro-batches, as the batch's are where the loss averages
    over its batch; other results are summed."""
    import jax
    import jax.numpy as jnp

    def run(*args, **kwargs):
        def micro(x):
            return x.reshape(x.shape[0] // steps, steps, *x.shape[1:]).swapaxes(0, 1)

        parts = tuple(jax.tree.map(micro, args[i] if isinstance(i, int) else kwargs[i]) for i in split)

        def call(part):
            a, k = list(args), dict(kwargs)
            for i, value in zip(split, part):
                if isinstance(i, int):
                    a[i] = value
                else:
                    k[i] = value
            return grad_fn(*a, **k)

        shapes = jax.eval_shape(call, jax.tree.map(lambda x: x[0], parts))
        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def one(total, part):
            return jax.tree.map(jnp.add, total, call(part)), None

        total, _ = jax.lax.scan(one, zero, parts)
        return jax.tree.map(lambda t: t / steps if jnp.issubdtype(t.dtype, jnp.inexact) else t, total)

    return run
'''


def _leading(value: Any) -> int | None:
    """The leading dimension every leaf of `value` shares where each is an array, or None.
    Any value at all may come here (a closure holds modules, functions, configs): looking never
    raises."""
    try:
        leaves = jax.tree.leaves(value)
        shapes = [tuple(x.shape) for x in leaves if isinstance(getattr(x, "shape", None), tuple)
                  and hasattr(x, "dtype")]
    except Exception:   # a half-built pytree, a shape that is not one
        return None
    if not leaves or len(shapes) != len(leaves) or any(not s for s in shapes) or len({s[0] for s in shapes}) != 1:
        return None
    return int(shapes[0][0])


def closed_over(f: Callable[..., Any]) -> dict[str, Any]:
    """The values a function reads from the function around it (its closure), by name."""
    code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
    out = {}
    for name, cell in zip(getattr(code, "co_freevars", ()), cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:   # a cell not yet filled
            continue
    return out


def batch_split(args: Sequence[Any], kwargs: dict[str, Any], dyn_argnums: Sequence[int],
                closed: dict[str, Any] | None = None) -> tuple[tuple[int | str, ...], tuple[str, ...], int]:
    """(the arguments to split, the closed-over names to split, the batch size) at a grad site:
    among the arguments not differentiated and the values the loss closes over, those whose
    every array leaf has the leading dimension most of them share (ties: none, the batch is not
    clear). ((), (), 0) where none carries a batch.

    >>> import numpy as np
    >>> batch_split((np.ones((4, 3)), np.ones((32, 8)), np.ones(32), 0.5), {}, (0,))
    ((1, 2), (), 32)
    >>> batch_split((np.ones((4, 3)),), {"x": np.ones((16, 2))}, (0,), {"y": np.ones(16), "n": 3})
    (('x',), ('y',), 16)
    """
    dyn = set(dyn_argnums)
    found: list[tuple[str, int | str, int]] = []
    places = [*(("arg", i, a) for i, a in enumerate(args) if i not in dyn), *(("arg", k, v) for k, v in kwargs.items()),
              *(("closed", k, v) for k, v in (closed or {}).items())]
    for kind, where, value in places:
        dim = _leading(value)
        if dim is not None and dim >= 2:
            found.append((kind, where, dim))
    counts = Counter(dim for _, _, dim in found).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return (), (), 0
    batch = counts[0][0]
    return (tuple(w for k, w, d in found if d == batch and k == "arg"),
            tuple(str(w) for k, w, d in found if d == batch and k == "closed"), batch)


def step_counts(batch: int, shards: int = 1, limit: int = MAX_STEPS) -> list[int]:
    """The micro-batch counts fit tries: 2, 4, 8, ... up to `limit`, each leaving micro-batches
    of a whole multiple of `shards` rows (the devices the batch is split over: each keeps its
    own rows, as many of each micro-batch).

    >>> step_counts(96), step_counts(6), step_counts(7), step_counts(160, shards=8)
    ([2, 4, 8, 16, 32], [2], [], [2, 4])
    """
    out, k = [], 2
    while k <= min(batch, limit):
        if batch % k == 0 and (batch // k) % max(shards, 1) == 0:
            out.append(k)
        k *= 2
    return out


def batch_shards(args: Sequence[Any]) -> dict[int, int]:
    """For each leading dimension of the arguments' leaves, the most devices a `NamedSharding`
    splits it over (none where nothing is sharded)."""
    found: dict[int, int] = {}
    for leaf in jax.tree.leaves(args):
        sharding, shape = getattr(leaf, "sharding", None), getattr(leaf, "shape", ())
        spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
        if not shape or spec is None or mesh is None or not len(spec) or spec[0] is None:
            continue
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        count = 1
        for axis in axes:
            count *= int(sizes.get(axis, 1))
        found[int(shape[0])] = max(found.get(int(shape[0]), 1), count)
    return found


def _micro(x: Any, steps: int) -> Any:
    return x.reshape(x.shape[0] // steps, steps, *x.shape[1:]).swapaxes(0, 1)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _with_closure(f: Callable[..., Any], values: dict[str, Any]) -> Callable[..., Any]:
    """`f` with the closed-over `values` in place of its own (the same code, fresh cells)."""
    if not values:
        return f
    cells = tuple(types.CellType(values[name]) if name in values else cell
                  for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()))
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, cells)
    g.__kwdefaults__ = f.__kwdefaults__
    return g


def accumulated(f: Callable[..., Any], dyn_argnums: Sequence[int], has_aux: bool, steps: int,
                split: Sequence[int | str], closed: Sequence[str] = (),
                outside: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Callable[..., Any]:
    """`f` (a loss, differentiated at `dyn_argnums`) as fit judges it accumulated over `steps`
    micro-batches of the arguments at `split` and the values it closes over named in `closed`:
    its value (and aux) is the mean over the micro-batches, its gradient their mean gradient,
    computed one micro-batch at a time in a `lax.scan`. `outside()` is entered while the
    micro-batches are differentiated (fit's hooks must not see that inner gradient)."""
    around = closed_over(f)

    def run(*args: Any, **kwargs: Any) -> Any:
        fixed = list(args)
        for i in dyn_argnums:
            fixed[i] = jax.tree.map(jax.lax.stop_gradient, args[i])
        whole = [args[i] if isinstance(i, int) else kwargs[i] for i in split] + [around[n] for n in closed]
        parts = tuple(jax.tree.map(lambda x: _micro(x, steps), v) for v in whole)

        def loss(dyn: tuple[Any, ...], part: tuple[Any, ...]) -> Any:
            a, k = list(fixed), dict(kwargs)
            for i, value in zip(dyn_argnums, dyn):
                a[i] = value
            for i, value in zip(split, part):
                if isinstance(i, int):
                    a[i] = value
                else:
                    k[i] = value
            return _with_closure(f, dict(zip(closed, part[len(split):])))(*a, **k)

        dyn = tuple(fixed[i] for i in dyn_argnums)
        with outside():
            _check_separable(loss, dyn, tuple(whole))
            value_and_grad = jax.value_and_grad(loss, has_aux=has_aux)
            try:
                shapes = jax.eval_shape(value_and_grad, dyn, jax.tree.map(lambda x: x[0], parts))
            except Exception as err:
                rows = jax.tree.leaves(parts)[0].shape[1]
                raise PlanError(f"the loss does not run on a micro-batch of {rows} (does it fix its batch size, as "
                                f"a reshape to a number does?): {' '.join(str(err).split())[:160]}") from None
            zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def one(total: Any, part: Any) -> tuple[Any, None]:
                return jax.tree.map(jnp.add, total, value_and_grad(dyn, part)), None

            total, _ = jax.lax.scan(one, zero, parts)
        (out, grads) = jax.tree.map(lambda t: t / steps if _is_float(t) else t, total)
        value, aux = out if has_aux else (out, None)
        if getattr(value, "shape", None) != () or not _is_float(value):
            raise PlanError("gradient accumulation needs a loss that is one float; this one is "
                            f"{getattr(value, 'dtype', type(value).__name__)}{list(getattr(value, 'shape', []))}")
        # Zero in value; its gradient at args[dyn_argnums] is the mean gradient.
        pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(tuple(args[i] for i in dyn_argnums)))
        linear = sum((jnp.vdot(g, p - jax.lax.stop_gradient(p)).astype(value.dtype)
                      for g, p in pairs if _is_float(p)), jnp.zeros((), value.dtype))
        return (value + linear, aux) if has_aux else value + linear

    run.__name__ = getattr(f, "__name__", "loss")
    return run


def _check_separable(loss: Callable[..., Any], dyn: tuple[Any, ...], whole: tuple[Any, ...]) -> None:
    """Raise where the loss over the whole batch is not the mean of its examples' parts
    (`fitting.separable`): then micro-batches would change the step's values."""
    from jaxmem.compiler.jaxpr_adapter import make_closed_jaxpr
    from jaxmem.fitting.separable import why_not_separable

    closed = make_closed_jaxpr(loss, dyn, whole)
    flags = [False] * len(jax.tree.leaves(dyn)) + [True] * len(jax.tree.leaves(whole))
    batch = jax.tree.leaves(whole)[0].shape[0]
    why = why_not_separable(closed, flags, batch)
    if why is not None:
        raise PlanError(f"micro-batches would change the step's values: {why}")


def accumulate_line(text: str, span: tuple[int, int] | None, steps: int, split: Sequence[int | str],
                    extra: Sequence[str] = ()) -> str | None:
    """The user's line with the gradient call at `span` (its columns) run through `accumulate`,
    the names in `extra` passed after its positional arguments (None where the call cannot be
    read back from the line).

    >>> accumulate_line("    loss, g = jax.value_and_grad(f)(p, batch)", (14, 45), 4, (1,))
    '    loss, g = accumulate(jax.value_and_grad(f), steps=4, split=(1,))(p, batch)'
    >>> accumulate_line("g = jax.grad(lambda p, x: f(p, x))(w, s=2)", (4, 42), 2, (1,), ["x"])
    'g = accumulate(jax.grad(lambda p, x: f(p, x)), steps=2, split=(1,))(w, x, s=2)'
    """
    if span is None:
        return None
    raw = text.encode()
    segment = raw[span[0]:span[1]].decode(errors="replace")
    try:
        node = ast.parse(segment, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
        return None
    part = lambda n: ast.get_source_segment(segment, n) or ast.unparse(n)  # noqa: E731
    args = [part(a) for a in node.args] + list(extra) + [part(k) for k in node.keywords]
    call = f"accumulate({part(node.func)}, steps={steps}, split={tuple(split)!r})({', '.join(args)})"
    return (raw[:span[0]].decode(errors="replace") + call + raw[span[1]:].decode(errors="replace")).rstrip()


def _function_node(file: str, first_line: int) -> ast.AST | None:
    """The def (or the one lambda) whose code starts on `first_line` of `file`."""
    try:
        tree = ast.parse("".join(linecache.getlines(file)))
    except (SyntaxError, ValueError):
        return None
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and min([n.lineno, *(d.lineno for d in n.decorator_list)]) == first_line]
    lambdas = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == first_line]
    found = defs or lambdas
    return found[0] if len(found) == 1 else None


def signature_edit(defined: str, positional: int, names: Sequence[str]) -> tuple[int, int, str] | None:
    """Where the loss defined at `defined` ("file:line") takes `names` as parameters after its
    own: (its last parameter's line, the column after it, the text to insert). None where its
    parameters are not `positional` plain ones on one line (defaults, *args, keyword-only:
    appending would change what its callers pass)."""
    file, _, line = defined.rpartition(":")
    if not line.isdigit():
        return None
    node = _function_node(file, int(line))
    args = getattr(node, "args", None)
    if args is None or args.vararg or args.kwarg or args.kwonlyargs or args.defaults:
        return None
    params = [*args.posonlyargs, *args.args]
    if len(params) != positional or not params or params[-1].end_col_offset is None:
        return None
    last = params[-1]
    return last.lineno, last.end_col_offset, "".join(f", {n}" for n in names)


def _insert(text: str, column: int, what: str) -> str:
    raw = text.encode()
    return raw[:column].decode(errors="replace") + what + raw[column:].decode(errors="replace")


def _site_lines(s: Any, steps: int) -> list[str] | None:
    """The lines to write at one grad site (None where they cannot be read back)."""
    if s.span is None:
        return None
    try:
        positional = len(ast.parse(f"f({s.args})", mode="eval").body.args)
    except SyntaxError:
        return None
    split = [*s.split, *range(positional, positional + len(s.closed))]
    text, span, lines = s.text, s.span, []
    if s.closed:
        edit = signature_edit(s.defined, positional, s.closed)
        if edit is None:
            return None
        line, column, what = edit
        if line == s.call.line and span[0] <= column <= span[1]:   # a lambda inside the call
            text, span = _insert(text, column, what), (span[0], span[1] + len(what.encode()))
        else:
            file = s.defined.rpartition(":")[0]
            def_text = _insert(linecache.getline(file, line).rstrip("\n"), column, what)
            lines.append(f"{file}:{line} ({s.function}): {def_text.strip()}  # {', '.join(s.closed)}: the batch "
                         f"{s.function} read from the function around it, now its argument{'s' * (len(s.closed) > 1)}")
    new = accumulate_line(text, span, steps, split, s.closed)
    return None if new is None else lines + [f"{s}: {new.strip()}"]


def accumulation_lines(sites: Sequence[Any], steps: int) -> list[str]:
    """What to write: each grad site's line with its call through `accumulate` (and, for a loss
    that closes over its batch, the loss's parameters with the batch added), then the helper."""
    lines = []
    for s in sites:
        written = _site_lines(s, steps)
        extra = f" passing {', '.join(s.closed)} as arguments after its own" if s.closed else ""
        lines += written or [f"{s}: call the gradient function of {s.function} through accumulate(<the gradient "
                             f"function>, steps={steps}, split=<the positions of the batch arguments>)(<its arguments>)"
                             f"{extra}"]
    batch = max((s.batch for s in sites), default=0)
    lines.append(f"{steps} micro-batches of {batch // steps} (of the batch of {batch}, split along its leading "
                 "axis); the loss must average over its batch (then the mean of the micro-batches' gradients is "
                 "the batch's). accumulate, pasted once beside the step:")
    return lines + ACCUMULATE_SOURCE.rstrip().splitlines()


__all__ = ["ACCUMULATE", "ACCUMULATE_SOURCE", "accumulation_lines", "batch_shards", "MAX_STEPS", "accumulate_line", "accumulated", "batch_split", "step_counts"]
