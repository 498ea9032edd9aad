"""Memory for free in a normalization: the small factors of an activation multiplied together first.

A batch norm written as users often write it, `(x - mean) * jax.lax.rsqrt(var + eps) * gain +
bias`, scales the activation twice by per-channel vectors. Its gradient then reduces
`g * xhat` for `gain` apart from the reductions the input gradient needs, and XLA:GPU fuses that
reduction beside the input gradient in one multi-output kernel (convnet_bn_train's
`input_add_reduce_fusion`): a kernel with two outputs reading the same operand cannot write over
it, so the activation, its gradient and the input gradient are all live at once (3 x 8 MiB in
the first stage). Written as Flax's `BatchNorm` is, `(x - mean) * (jax.lax.rsqrt(var + eps) *
gain) + bias`, every reduction is one the input gradient needs, the input gradient is a loop
kernel of its own, and XLA computes the activation's gradient inside each kernel that reads it
instead of storing it (two 8 MiB values at that instruction). The same holds for any
chain `x * a * b` (or `x / a * b`, ...) where `a` and `b` are broadcast along `x`: combined
first, the chain is one multiply of `x`, one fewer elementwise pass each way.

`scale_sites` finds such chains of a step by the user's line; `scales_combined` returns the step
with them combined (`jnp.multiply` and `jnp.true_divide`, which JAX arrays' `*` and `/` call,
hooked while the step is traced, as the user would write the parentheses there). The values move by a rounding (the factors are
multiplied in another order), which `fitting.rewrites` checks at the step's precision before
fit and optimize use it.

>>> sites = scale_sites(step, args)                          # doctest: +SKIP
>>> jax.jit(scales_combined(step, sites))(*args)             # doctest: +SKIP
"""

from __future__ import annotations

import ast
import contextvars
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import SourceLine
from jaxmem.fitting import jax_hooks


def is_small_factor(factor_shape: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether a `mul`/`div` operand of `factor_shape` is broadcast along an operand of `shape`
    (a scalar, or the same rank with each dimension 1 or the other's) and is smaller than it."""
    factor_shape, shape = tuple(factor_shape), tuple(shape)
    if factor_shape == ():
        return math.prod(shape) > 1
    return (len(factor_shape) == len(shape) and math.prod(factor_shape) < math.prod(shape)
            and all(f in (1, n) for f, n in zip(factor_shape, shape)))


@dataclass(frozen=True)
class ScaleSite:
    """One user line where an activation already scaled by a small factor is scaled again."""

    call: SourceLine
    shape: tuple[int, ...]             # the activation's shape (the first chain's)
    written_left: bool = True          # the activation is the left operand of both: `(x * a) * b`

    @property
    def key(self) -> tuple[str, int]:
        return (self.call.file, self.call.line)

    def code(self) -> str:
        """What to write: the line with its factors grouped, where the line alone shows which."""
        shape = "x".join(map(str, self.shape))
        # Which operand is the activation, the trace knows and the line does not: `2.0 * x * g`
        # is `x * (2.0 * g)`, not `2.0 * (x * g)`.
        grouped = grouped_line(self.call.text) if self.written_left else None
        how = (f"write `{grouped}`" if grouped else
               "multiply the small factors together first, then the activation once: "
               "`x * (a * b)` in place of `x * a * b` (the first factor may be applied on an earlier line)")
        written = f"  (as written: {self.call.text})" if self.call.text else ""
        return f"{self.call}: {how}, so the {shape} activation is scaled once{written}"


def grouped_line(text: str) -> str | None:
    """`text` with its one product chain `A * B * C` (or with `/`) written `A * (B * C)`, where
    the line is a whole statement with exactly one such chain; else None (the words say it)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    chains = [node for node in ast.walk(tree)
              if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div))
              and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, (ast.Mult, ast.Div))]
    if len(chains) != 1:
        return None
    (outer,) = chains
    inner = outer.left
    assert isinstance(inner, ast.BinOp)
    # x op1 a op2 b  ->  x op1 (a op2' b): x * a * b = x * (a * b); x * a / b = x * (a / b);
    # x / a * b = x * (b / a); x / a / b = x / (a * b).
    if isinstance(inner.op, ast.Mult):
        factor = ast.BinOp(inner.right, outer.op, outer.right)
        new = ast.BinOp(inner.left, ast.Mult(), factor)
    elif isinstance(outer.op, ast.Mult):
        new = ast.BinOp(inner.left, ast.Mult(), ast.BinOp(outer.right, ast.Div(), inner.right))
    else:
        new = ast.BinOp(inner.left, ast.Div(), ast.BinOp(inner.right, ast.Mult(), outer.right))

    class Swap(ast.NodeTransformer):
        def visit_BinOp(self, node: ast.BinOp) -> Any:
            return new if node is outer else self.generic_visit(node)

    return ast.unparse(Swap().visit(tree))


def combinable(first: Sequence[int], second: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether two factors of an activation of `shape`, multiplied together, are still small:
    a batch norm's two per-channel vectors are; a layer norm's per-row statistic and
    per-feature gain make a factor as large as the activation, nothing saved."""
    import numpy as np

    try:
        return is_small_factor(np.broadcast_shapes(tuple(first), tuple(second)), shape)
    except ValueError:
        return False


def scale_sites(fn: Callable[..., Any], args: Sequence[Any]) -> list[ScaleSite]:
    """The user's lines where `fn`, as traced, scales an activation already scaled by a small
    factor by another small factor (`x * a * b`, `x / a * b`, ...), the two factors still small
    together: what `scales_combined` rewrites (found by the same hook, recording)."""
    from jaxmem.fitting.attention import _function_at

    _install()
    trace = _Trace(None)

    def traced(*a: Any) -> Any:   # a new function: JAX runs the Python again, not its cached trace
        return fn(*a)

    with jax_hooks.active(_ACTIVE, trace):
        ja.make_closed_jaxpr(traced, *args)
    sites: dict[tuple[str, int], ScaleSite] = {}
    for line, shape, left in trace.found:
        if line is not None and line not in sites:
            sites[line] = ScaleSite(SourceLine(line[0], line[1], _function_at(line)), shape, left)
    return list(sites.values())


@dataclass
class _Trace:
    """While one call of a `scales_combined` step traces: its lines, and each scaled result
    made so far, by identity, with what it was made from (kept alive here, so no id is reused)."""

    lines: frozenset[tuple[str, int]] | None     # None: record where it would combine, change nothing
    # id -> (out, x, factor, op, whether x was the left operand)
    made: dict[int, tuple[Any, Any, Any, str, bool]] = field(default_factory=dict)
    found: list[tuple[tuple[str, int] | None, tuple[int, ...], bool]] = field(default_factory=list)


_ACTIVE: contextvars.ContextVar[_Trace | None] = contextvars.ContextVar("jaxmem_scales_combined", default=None)


def _padded(factor: Any, x: Any) -> tuple[int, ...]:
    """`factor`'s shape at `x`'s rank, as NumPy broadcasts it (its dimensions line up with x's last)."""
    import numpy as np

    fshape = tuple(np.shape(factor))
    return (1,) * (len(x.shape) - len(fshape)) + fshape


def _small(factor: Any, x: Any) -> bool:
    import numpy as np

    shape = getattr(x, "shape", None)
    if not shape or len(np.shape(factor)) > len(shape):
        return False
    return is_small_factor(_padded(factor, x), shape)


class _HookedUfunc:
    """`jnp.multiply` / `jnp.true_divide` as `x * a` and `x / a` on arrays call them (a module
    global of `jax._src.numpy.ufuncs`, looked up at each call), with everything else of the
    ufunc (`.reduce`, `.at`, ...) forwarded to it. Inside `scales_combined`, a small factor
    applied on one of its lines to an activation another small factor scaled is combined with
    that factor first; outside, the ufunc itself, at once. (Not `lax.mul_p.bind`: `jnp`'s
    operators run as jitted functions whose traces JAX caches, so their binds are not seen.)"""

    def __init__(self, original: Any, op: str) -> None:
        self.__jaxmem_original__ = original
        self._op = op
        self.__doc__ = original.__doc__     # help(jnp.multiply) stays JAX's

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__jaxmem_original__, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self.__jaxmem_original__
        trace = _ACTIVE.get()
        if trace is None or len(args) != 2 or kwargs:
            return original(*args, **kwargs)
        import jax.numpy as jnp

        mul, div = _ORIGINALS["mul"], _ORIGINALS["div"]
        a, b = args
        for x, factor in ((a, b), (b, a)) if self._op == "mul" else ((a, b),):
            try:
                if not _small(factor, x) or jnp.result_type(x, factor) != x.dtype:
                    continue
            except (TypeError, ValueError):
                continue
            seen = trace.made.get(id(x))
            chained = seen is not None and seen[0] is x and combinable(_padded(seen[2], x), _padded(factor, x), x.shape)
            line = jax_hooks.innermost_line() if chained else None
            if line is not None and trace.lines is None:
                assert seen is not None
                trace.found.append((line, tuple(x.shape), seen[4] and x is a))
            elif line is not None and trace.lines is not None and line in trace.lines:
                assert seen is not None
                _, base, first, first_op, _ = seen
                # x = base (first_op) first; x (op) factor is one scaling of base:
                if first_op == "mul":          # base * (f * g), base * (f / g)
                    combined, new_op = (mul if self._op == "mul" else div)(first, factor), "mul"
                elif self._op == "mul":        # base * (g / f)
                    combined, new_op = div(factor, first), "mul"
                else:                          # base / (f * g)
                    combined, new_op = mul(first, factor), "div"
                if jnp.result_type(base, combined) == x.dtype:
                    out = (mul if new_op == "mul" else div)(base, combined)
                    trace.made[id(out)] = (out, base, combined, new_op, True)
                    return out
            out = original(a, b)
            trace.made[id(out)] = (out, x, factor, self._op, x is a)
            return out
        return original(*args, **kwargs)


_ORIGINALS: dict[str, Any] = {}


def _install() -> None:
    """Hook, once per process, `jnp.multiply` and `jnp.true_divide` where the `*` and `/` of JAX
    arrays and tracers find them (`jax._src.numpy.ufuncs`) and where users call them by name
    (`jax.numpy.multiply`, `divide`, `true_divide`)."""
    import jax.numpy as jnp

    ufuncs = jax_hooks.numpy_ufuncs()
    _ORIGINALS.update(mul=jax_hooks.original(ufuncs.multiply), div=jax_hooks.original(ufuncs.true_divide))
    for module in (ufuncs, jnp):
        jax_hooks.hook(module, "multiply", lambda original: _HookedUfunc(original, "mul"))
        for name in ("true_divide", "divide"):
            jax_hooks.hook(module, name, lambda original: _HookedUfunc(original, "div"))


def scales_combined(fn: Callable[..., Any], sites: Sequence[ScaleSite]) -> Callable[..., Any]:
    """`fn` with the chains on `sites`' lines scaling their activation once, by the product of
    the factors, as if the user had grouped them there (the hook is active only while `fn` runs)."""
    _install()
    lines = frozenset(s.key for s in sites)
    return jax_hooks.while_set(fn, _ACTIVE, lambda: _Trace(lines))


def scale_lines(sites: Sequence[ScaleSite]) -> list[str]:
    """What to write in the user's code, one line per site."""
    return [s.code() for s in sites]
