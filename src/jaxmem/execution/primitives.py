"""How to run each JAX primitive on host memory: a table from primitive name to kernel maker.

A kernel maker looks at one equation (its params and abstract values, never its data) and returns a
`Kernel`, or None when numpy cannot do exactly what the primitive means for these params and
dtypes; the equation then runs through JAX on the CPU (`jax_kernel`), so an unknown primitive
is slower, never wrong and never a crash.

    >>> closed = jax.make_jaxpr(lambda a, b: a * b)(np.ones(3, np.float32), np.ones(3, np.float32))
    >>> kernel = kernel_for(closed.jaxpr.eqns[0])
    >>> out = np.empty(3, np.float32); _ = kernel.into(out, np.ones(3, np.float32), np.full(3, 2, np.float32))
    >>> out
    array([2., 2., 2.], dtype=float32)

Kernels compute either a fresh result (`compute(*ins)`, which may return a view of an input
when `views` is set) or write straight into an output array (`into(out, *ins)`). `overlap_safe`
says `into` stays right when `out` shares memory with an input (numpy ufuncs buffer overlapping
operands themselves); the executor uses a temporary otherwise.
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
import scipy.special as sps

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.rules import IDENTITY_VIEWS

Array = np.ndarray


@dataclass(frozen=True)
class Kernel:
    """How one equation runs.

    Attributes:
        compute: `(*inputs) -> output` (a tuple for multi-output primitives).
        into: `(out, *inputs) -> None` writing the single output in place, or None.
        overlap_safe: `into` is right even when `out` overlaps an input.
        views: `compute` may return a view of an input instead of fresh memory.
        alias_ok: input positions that may be exactly `out`'s memory (an update in place).
        same_bytes: the output's bytes are input 0's bytes (reshape, bitcast, copy): when the
            plan puts both at one offset there is nothing to do.
        ufunc: the numpy ufunc itself when `into` is `ufunc(*inputs, out=out)`, so the executor
            can call it without a wrapper.
        name: "numpy" or "jax" (the fallback), for reports and tests.
    """

    compute: Callable[..., Any]
    into: Callable[..., None] | None = None
    overlap_safe: bool = False
    views: bool = False
    alias_ok: frozenset[int] = frozenset()
    same_bytes: bool = False
    ufunc: Any = None
    name: str = "numpy"
    jitted: Any = None


KernelMaker = Callable[[Any], "Kernel | None"]
# The executor's kernel table (what the planner knows of a primitive is `compiler.rules.KERNELS`).
KERNELS: dict[str, KernelMaker] = {}


def kernel_of(*names: str) -> Callable[[KernelMaker], KernelMaker]:
    def register(fn: KernelMaker) -> KernelMaker:
        for n in names:
            KERNELS[n] = fn
        return fn
    return register


# ---- abstract values -------------------------------------------------------------------------

def is_key_dtype(dtype: Any) -> bool:
    """True for JAX's typed PRNG key dtypes (key<fry>), which numpy cannot hold directly."""
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


@functools.lru_cache(maxsize=None)
def _key_impls() -> dict[str, str]:
    """str(key dtype) -> PRNG implementation name, learned from JAX's public API."""
    names = {}
    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
        try:
            names[str(jax.random.key(0, impl=impl).dtype)] = impl
        except (ValueError, TypeError, KeyError):
            continue
    return names


def key_impl(dtype: Any) -> str:
    return _key_impls()[str(dtype)]


@functools.lru_cache(maxsize=None)
def _key_storage(shape: tuple[int, ...], dtype_str: str, dtype: Any) -> tuple[np.dtype, tuple[int, ...]]:
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
    return np.dtype(data.dtype), tuple(data.shape)


def storage(aval: Any) -> tuple[np.dtype, tuple[int, ...]]:
    """(numpy dtype, shape) a value of abstract value `aval` is stored as on the host.

    PRNG keys are stored as their raw key data (uint32[..., 2] for threefry), which is exactly
    their byte size.
    """
    shape = tuple(int(d) for d in aval.shape)
    if is_key_dtype(aval.dtype):
        return _key_storage(shape, str(aval.dtype), aval.dtype)
    return np.dtype(aval.dtype), shape


_in_avals, _out_avals, _params = ja.eqn_in_avals, ja.eqn_out_avals, ja.eqn_params


def _touches_keys(eqn: Any) -> bool:
    return any(is_key_dtype(a.dtype) for a in _in_avals(eqn) + _out_avals(eqn) if hasattr(a, "dtype"))


def _dt(aval: Any) -> np.dtype:
    return np.dtype(aval.dtype)


def _is_ml_float(dtype: np.dtype) -> bool:
    # bfloat16, float8_* from ml_dtypes: numpy does not know they are floats
    return dtype.kind == "V" or dtype.name.startswith(("bfloat16", "float8", "float4", "float6"))


def _numpy_native(dtype: np.dtype) -> bool:
    """Dtypes numpy computes natively and exactly like XLA (ml_dtypes floats go to JAX)."""
    return dtype.kind in "biufc" and not _is_ml_float(dtype)


# ---- the JAX fallback ------------------------------------------------------------------------

def _hashable_params(params: dict[str, Any]) -> Any:
    items = []
    for k in sorted(params):
        v = params[k]
        if isinstance(v, np.ndarray):
            v = (v.dtype.str, v.shape, v.tobytes())
        hash(v)
        items.append((k, v))
    return tuple(items)


_JAX_KERNELS: dict[Any, Kernel] = {}


def jax_kernel(eqn: Any) -> Kernel:
    """Run `eqn` with JAX on the CPU: one `jax.jit` of the primitive's bind, cached by signature.

    Key-typed operands travel as their raw key data and are wrapped/unwrapped inside the jitted
    function, so the host side only ever sees numpy arrays.
    """
    in_avals, out_avals = _in_avals(eqn), _out_avals(eqn)
    try:
        key = (ja.eqn_name(eqn), _hashable_params(_params(eqn)),
               tuple((tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False))) for a in in_avals))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _JAX_KERNELS:
        return _JAX_KERNELS[key]
    bind, multiple = ja.eqn_binder(eqn)
    params = dict(_params(eqn))
    in_keys = [key_impl(a.dtype) if is_key_dtype(a.dtype) else None for a in in_avals]
    out_keys = [is_key_dtype(a.dtype) for a in out_avals]

    def body(*xs: Any) -> list[Any]:
        xs = [jax.random.wrap_key_data(x, impl=k) if k else x for x, k in zip(xs, in_keys)]
        out = bind(*xs, **params)
        outs = list(out) if multiple else [out]
        return [jax.random.key_data(o) if isk else o for o, isk in zip(outs, out_keys)]

    jitted = jax.jit(body)

    def compute(*ins: Array) -> Any:
        res = jitted(*ins)
        if multiple:
            return tuple(np.asarray(r) for r in res)
        return np.asarray(res[0])

    # views=True: XLA may hand back its input's own buffer (an identity), which for a 64-byte
    # aligned numpy input is the arena's memory itself, so the executor treats it like a view.
    kernel = Kernel(compute=compute, name="jax", jitted=jitted, views=True)
    if key is not None:
        _JAX_KERNELS[key] = kernel
    return kernel


def kernel_for(eqn: Any) -> Kernel:
    """The kernel for one equation: its numpy kernel when one applies, else the JAX fallback."""
    name = ja.eqn_name(eqn)
    make = KERNELS.get(name)
    if make is not None and not _touches_keys(eqn):
        try:
            kernel = make(eqn)
        except (TypeError, ValueError, KeyError, AttributeError):
            # A param layout this kernel maker does not know (a newer JAX): JAX runs it instead.
            kernel = None
        if kernel is not None:
            return kernel
    if name in KEY_COPY and _touches_keys(eqn):
        return KEY_COPY[name](eqn)
    return jax_kernel(eqn)


# ---- elementwise -----------------------------------------------------------------------------

# Elementwise ops on at least this many elements are split across threads (numpy releases the
# GIL inside a ufunc loop), as XLA spreads a large elementwise loop over the CPU's cores.
PARALLEL_SIZE = 1 << 18
THREADS = max(1, min(4, os.cpu_count() or 1))
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=THREADS - 1, thread_name_prefix="jaxmem-ufunc")
    return _POOL


def _split_ufunc(f: Callable[..., Any], out: Array, xs: tuple[Any, ...]) -> None:
    """`f(*xs, out=out)`, cut along out's first axis into one piece per thread.

    Only when no input shares memory with `out` other than element for element (the same
    array, in place): a piece must never read what another piece writes.
    """
    n = out.shape[0]
    base = out.__array_interface__["data"][0]
    for x in xs:
        if isinstance(x, np.ndarray) and np.may_share_memory(x, out) and not (
                x.shape == out.shape and x.strides == out.strides and x.__array_interface__["data"][0] == base):
            f(*xs, out=out)
            return
    bounds = [n * k // THREADS for k in range(THREADS + 1)]

    def piece(lo: int, hi: int) -> None:
        args = [x[lo:hi] if isinstance(x, np.ndarray) and x.ndim == out.ndim and x.shape[0] == n else x for x in xs]
        f(*args, out=out[lo:hi])

    pool = _pool()
    futures = [pool.submit(piece, bounds[k], bounds[k + 1]) for k in range(1, THREADS)]
    piece(bounds[0], bounds[1])
    for fut in futures:
        fut.result()


def _ufunc(f: Callable[..., Any], eqn: Any = None) -> Kernel:
    """A kernel for a numpy ufunc; large outputs are computed by several threads."""
    direct = Kernel(compute=f, into=lambda out, *xs: f(*xs, out=out), overlap_safe=True,
                    ufunc=f if isinstance(f, np.ufunc) else None)
    if eqn is None or THREADS == 1 or len(_out_avals(eqn)) != 1:
        return direct
    aval = _out_avals(eqn)[0]
    shape = tuple(aval.shape)
    if math.prod(shape) < PARALLEL_SIZE or not shape or shape[0] < THREADS:
        return direct
    dtype = np.dtype(aval.dtype)

    def into(out: Array, *xs: Any) -> None:
        _split_ufunc(f, out, xs)

    def compute(*xs: Any) -> Array:
        out = np.empty(shape, dtype)
        _split_ufunc(f, out, xs)
        return out

    return Kernel(compute=compute, into=into, overlap_safe=True)


def _native_all(eqn: Any) -> bool:
    return all(_numpy_native(_dt(a)) for a in _in_avals(eqn) + _out_avals(eqn))


# scipy's special functions run element by element, 10-50x slower than XLA's vectorised
# approximations: past this many elements JAX computes them.
SPECIAL_SIZE = 4096


def _simple(ufunc: Callable[..., Any], kinds: str = "biufc", max_size: int | None = None) -> KernelMaker:
    """A ufunc's kernel for inputs of `kinds`; none from `max_size` output elements on."""
    def make(eqn: Any) -> Kernel | None:
        if not _native_all(eqn):
            return None
        if max_size is not None and math.prod(_out_avals(eqn)[0].shape) >= max_size:
            return None
        if any(_dt(a).kind not in kinds for a in _in_avals(eqn)):
            return None
        return _ufunc(ufunc, eqn)
    return make


for _name, _uf, _kinds in [
    ("add", np.add, "iufc"), ("add_any", np.add, "iufc"), ("sub", np.subtract, "iufc"),
    ("mul", np.multiply, "iufc"), ("neg", np.negative, "iufc"),
    ("max", np.maximum, "biufc"), ("min", np.minimum, "biufc"),
    ("exp", np.exp, "fc"), ("exp2", np.exp2, "f"), ("log", np.log, "fc"), ("log1p", np.log1p, "fc"),
    ("expm1", np.expm1, "fc"), ("tanh", np.tanh, "fc"), ("sin", np.sin, "fc"), ("cos", np.cos, "fc"),
    ("tan", np.tan, "fc"), ("asin", np.arcsin, "f"), ("acos", np.arccos, "f"), ("atan", np.arctan, "f"),
    ("sinh", np.sinh, "f"), ("cosh", np.cosh, "f"), ("asinh", np.arcsinh, "f"), ("acosh", np.arccosh, "f"),
    ("atanh", np.arctanh, "f"), ("atan2", np.arctan2, "f"), ("sqrt", np.sqrt, "fc"), ("cbrt", np.cbrt, "f"),
    ("abs", np.abs, "iuf"), ("floor", np.floor, "f"), ("ceil", np.ceil, "f"),
    ("is_finite", np.isfinite, "f"), ("nextafter", np.nextafter, "f"),
    ("eq", np.equal, "biuf"), ("ne", np.not_equal, "biuf"), ("lt", np.less, "biuf"),
    ("le", np.less_equal, "biuf"), ("gt", np.greater, "biuf"), ("ge", np.greater_equal, "biuf"),
    ("and", np.bitwise_and, "biu"), ("or", np.bitwise_or, "biu"), ("xor", np.bitwise_xor, "biu"),
    ("not", np.invert, "biu"), ("square", np.square, "iufc"),
    ("real", np.real, "c"), ("imag", np.imag, "c"), ("conj", np.conjugate, "c"),
]:
    if _uf is not None:
        KERNELS[_name] = _simple(_uf, _kinds)
for _name, _uf in [("erf", sps.erf), ("erfc", sps.erfc), ("erf_inv", sps.erfinv), ("logistic", sps.expit)]:
    KERNELS[_name] = _simple(_uf, "f", max_size=SPECIAL_SIZE)


def _float_or_int(eqn: Any, float_kinds: str, float_ufunc: Any, int_compute: Any) -> Kernel | None:
    """A NumPy ufunc for the float kinds `float_kinds`, `int_compute(dtype, a, b)` for integers
    (XLA's integer rules), None for anything else or operands NumPy cannot hold."""
    dtype = _dt(_out_avals(eqn)[0])
    if not _native_all(eqn):
        return None
    if dtype.kind in float_kinds:
        return _ufunc(float_ufunc, eqn)
    if dtype.kind in "iu":
        return Kernel(compute=functools.partial(int_compute, dtype))
    return None


@kernel_of("div")
def _div(eqn: Any) -> Kernel | None:
    return _float_or_int(eqn, "fc", np.true_divide, _int_div)


def _int_div(dtype: np.dtype, a: Array, b: Array) -> Array:
    # XLA integer division truncates toward zero; x / 0 is -1 (all ones for unsigned) and
    # INT_MIN / -1 wraps to INT_MIN.
    a, b = np.broadcast_arrays(np.asarray(a, dtype), np.asarray(b, dtype))
    zero = b == 0
    safe = np.where(zero, dtype.type(1), b)
    with np.errstate(all="ignore"):
        if dtype.kind == "u":
            q = a // safe
        else:
            q = np.fmod(a, safe)  # C remainder keeps the dividend's sign
            q = (a - q) // safe    # exact: a - rem is a multiple of b
    minus_one = np.array(-1).astype(dtype) if dtype.kind == "i" else np.array(np.iinfo(dtype).max, dtype)
    return np.where(zero, minus_one, q).astype(dtype, copy=False)


@kernel_of("rem")
def _rem(eqn: Any) -> Kernel | None:
    return _float_or_int(eqn, "f", np.fmod, _int_rem)  # C fmod: the sign of the dividend, as lax.rem


def _int_rem(dtype: np.dtype, a: Array, b: Array) -> Array:
    # XLA: x % 0 is x; INT_MIN % -1 is 0.
    a, b = np.broadcast_arrays(np.asarray(a, dtype), np.asarray(b, dtype))
    zero = b == 0
    safe = np.where(zero, dtype.type(1), b)
    with np.errstate(all="ignore"):
        r = np.fmod(a, safe)
    return np.where(zero, a, r).astype(dtype, copy=False)


@kernel_of("pow")
def _pow(eqn: Any) -> Kernel | None:
    a, b = _in_avals(eqn)
    if _dt(a).kind in "fc" and _dt(b) == _dt(a) and _native_all(eqn):
        return _ufunc(np.power, eqn)
    return None


@kernel_of("integer_pow")
def _integer_pow(eqn: Any) -> Kernel | None:
    y = int(_params(eqn)["y"])
    dtype = _dt(_in_avals(eqn)[0])
    if not _native_all(eqn) or dtype.kind not in "iufc":
        return None
    if dtype.kind in "iu" and y < 0:
        return None
    if y == 0:
        return Kernel(compute=lambda x: np.ones_like(x), into=lambda out, x: out.fill(1), overlap_safe=True)
    if y == 2:
        return _ufunc(np.square, eqn)
    n = abs(y)

    def compute(x: Array) -> Array:
        # Square-and-multiply, as XLA expands integer_pow (libm pow is slower and rounds apart).
        acc, base, k = None, np.asarray(x), n
        while k:
            if k & 1:
                acc = np.array(base, copy=True) if acc is None else np.multiply(acc, base, out=acc)
            k >>= 1
            if k:
                base = np.multiply(base, base)
        return np.reciprocal(acc, out=acc) if y < 0 else acc

    return Kernel(compute=compute)


@kernel_of("sign")
def _sign(eqn: Any) -> Kernel | None:
    return _ufunc(np.sign, eqn) if _native_all(eqn) else None


@kernel_of("rsqrt")
def _rsqrt(eqn: Any) -> Kernel | None:
    if not _native_all(eqn) or _dt(_in_avals(eqn)[0]).kind not in "fc":
        return None

    def into(out: Array, x: Array) -> None:
        np.sqrt(x, out=out)
        np.reciprocal(out, out=out)

    return Kernel(compute=lambda x: np.reciprocal(np.sqrt(x)), into=into, overlap_safe=True)


@kernel_of("round")
def _round(eqn: Any) -> Kernel | None:
    if not _native_all(eqn) or _dt(_in_avals(eqn)[0]).kind != "f":
        return None
    method = int(_params(eqn).get("rounding_method", 0))
    if method == 1:  # TO_NEAREST_EVEN
        return _ufunc(np.rint, eqn)

    def away(x: Array) -> Array:
        t = np.trunc(x)
        return t + np.where(np.abs(x - t) >= 0.5, np.sign(x), 0).astype(x.dtype)

    return Kernel(compute=away)


@kernel_of("clamp")
def _clamp(eqn: Any) -> Kernel | None:
    if not _native_all(eqn):
        return None
    # lax.clamp(lo, x, hi) = min(max(x, lo), hi)
    def into(out: Array, lo: Array, x: Array, hi: Array) -> None:
        if np.may_share_memory(out, lo) or np.may_share_memory(out, hi):
            np.copyto(out, np.minimum(np.maximum(x, lo), hi))
            return
        np.maximum(x, lo, out=out)
        np.minimum(out, hi, out=out)

    return Kernel(compute=lambda lo, x, hi: np.minimum(np.maximum(x, lo), hi), into=into, overlap_safe=True)


@kernel_of("shift_left", "shift_right_logical", "shift_right_arithmetic")
def _shift(eqn: Any) -> Kernel | None:
    dtype = _dt(_out_avals(eqn)[0])
    if dtype.kind not in "iu" or not _native_all(eqn):
        return None
    bits = dtype.itemsize * 8
    name = ja.eqn_name(eqn)
    unsigned = np.dtype(f"u{dtype.itemsize}")

    def compute(x: Array, s: Array) -> Array:
        x, s = np.broadcast_arrays(np.asarray(x, dtype), np.asarray(s, dtype))
        big = (s < 0) | (s >= bits) if dtype.kind == "i" else (s >= bits)
        safe = np.where(big, 0, s).astype(dtype)
        if name == "shift_left":
            return np.where(big, dtype.type(0), np.left_shift(x, safe)).astype(dtype)
        if name == "shift_right_logical":
            r = np.right_shift(x.view(unsigned), safe.astype(unsigned)).view(dtype)
            return np.where(big, dtype.type(0), r).astype(dtype)
        fill = np.where(x < 0, dtype.type(-1), dtype.type(0)) if dtype.kind == "i" else dtype.type(0)
        return np.where(big, fill, np.right_shift(x, safe)).astype(dtype)

    return Kernel(compute=compute)


@kernel_of("select_n")
def _select_n(eqn: Any) -> Kernel | None:
    avals = _in_avals(eqn)
    if not _native_all(eqn):
        return None
    if len(avals) == 3 and _dt(avals[0]) == np.bool_:
        dtype = _dt(_out_avals(eqn)[0])
        if dtype.itemsize not in (1, 2, 4, 8) or any(_dt(a) != dtype for a in avals[1:]):
            return Kernel(compute=lambda p, f, t: np.where(p, t, f))
        bits = np.dtype(f"u{dtype.itemsize}")
        shape = tuple(_out_avals(eqn)[0].shape)

        # A select on the bits, f ^ ((f ^ t) * p): exact for every value (NaN payloads, -0.0)
        # and branch-free, where np.where and masked copies crawl on an unpredictable mask.
        # Every step is a ufunc, and `out` is written only by the last, so overlap is safe.
        def into(out: Array, p: Array, f: Array, t: Array) -> None:
            fb, tb = np.asarray(f).view(bits), np.asarray(t).view(bits)
            diff = np.bitwise_xor(fb, tb, out=np.empty(shape, bits))
            np.multiply(diff, p, out=diff, casting="unsafe")
            np.bitwise_xor(fb, diff, out=out.view(bits))

        def compute(p: Array, f: Array, t: Array) -> Array:
            out = np.empty(shape, dtype)
            into(out, p, f, t)
            return out
        return Kernel(compute=compute, into=into, overlap_safe=True)
    if len(avals) == 2:
        return Kernel(compute=lambda p, c: np.array(c, copy=True), into=lambda out, p, c: np.copyto(out, c),
                      overlap_safe=True)
    return Kernel(compute=lambda p, *cases: np.choose(p, cases))


# ---- conversion ------------------------------------------------------------------------------

@kernel_of("convert_element_type")
def _convert(eqn: Any) -> Kernel | None:
    src, dst = _dt(_in_avals(eqn)[0]), _dt(_out_avals(eqn)[0])
    if src == dst:
        return _identity(eqn)
    if dst == np.bool_:
        return Kernel(compute=lambda x: x != 0, into=lambda out, x: np.not_equal(x, 0, out=out),
                      overlap_safe=True)
    if src.kind in "fV" and dst.kind in "iu":
        if not _numpy_native(src):
            return None
        info = np.iinfo(dst)

        def f2i(x: Array) -> Array:
            # XLA converts float to int saturating, NaN to 0, truncating toward zero
            with np.errstate(invalid="ignore"):
                y = np.trunc(x)
                y = np.where(np.isnan(y), 0, np.clip(y, info.min, info.max))
                # clip in float can round up past the max (2**31 - 1 is not a float32)
                hi = y >= float(info.max)
                out = y.astype(dst)
                out[hi] = info.max
            return out

        return Kernel(compute=f2i)
    if src.kind == "c" and dst.kind != "c":
        return None  # complex -> real takes the real part in XLA; numpy warns: let JAX do it

    def into(out: Array, x: Array) -> None:
        np.copyto(out, x, casting="unsafe")

    return Kernel(compute=lambda x: x.astype(dst), into=into, overlap_safe=True)


@kernel_of("bitcast_convert_type")
def _bitcast(eqn: Any) -> Kernel | None:
    src, dst = _dt(_in_avals(eqn)[0]), _dt(_out_avals(eqn)[0])
    if src.itemsize != dst.itemsize:
        return None
    return Kernel(compute=lambda x: np.ascontiguousarray(x).view(dst),
                  into=lambda out, x: np.copyto(out.view(src), x), overlap_safe=True, views=True, same_bytes=True)


@kernel_of("reduce_precision")
def _reduce_precision(eqn: Any) -> Kernel | None:
    dtype = _dt(_in_avals(eqn)[0])
    finfo = np.finfo(dtype) if dtype.kind == "f" else None
    if finfo is None:
        return None
    if int(_params(eqn)["exponent_bits"]) == finfo.nexp and int(_params(eqn)["mantissa_bits"]) == finfo.nmant:
        return _identity(eqn)
    return None


# ---- data movement ---------------------------------------------------------------------------

def _identity(eqn: Any) -> Kernel:
    return Kernel(compute=lambda x: x, into=lambda out, x: np.copyto(out, x), overlap_safe=True, views=True,
                  same_bytes=True)


for _name in IDENTITY_VIEWS:  # the table's "copy" and "annotation" views: the operand's value
    KERNELS[_name] = _identity


@kernel_of("device_put")
def _device_put(eqn: Any) -> Kernel | None:
    if len(_in_avals(eqn)) != 1 or len(_out_avals(eqn)) != 1:
        return Kernel(compute=lambda *xs: tuple(xs), views=True)
    return _identity(eqn)


@kernel_of("optimization_barrier")
def _barrier(eqn: Any) -> Kernel | None:
    return Kernel(compute=lambda *xs: tuple(xs), views=True)


@kernel_of("reshape")
def _reshape(eqn: Any) -> Kernel | None:
    if _params(eqn).get("dimensions") not in (None, ()):
        return None
    shape = tuple(_out_avals(eqn)[0].shape)

    def into(out: Array, x: Array, *dyn: Array) -> None:
        np.copyto(out, x.reshape(shape))

    return Kernel(compute=lambda x, *dyn: x.reshape(shape), into=into, overlap_safe=True, views=True,
                  same_bytes=True)


@kernel_of("squeeze")
def _squeeze(eqn: Any) -> Kernel | None:
    shape = tuple(_out_avals(eqn)[0].shape)
    return Kernel(compute=lambda x: x.reshape(shape), into=lambda out, x: np.copyto(out, x.reshape(shape)),
                  overlap_safe=True, views=True, same_bytes=True)


@kernel_of("expand_dims")
def _expand_dims(eqn: Any) -> Kernel | None:
    return _squeeze(eqn)


@kernel_of("broadcast_in_dim")
def _broadcast_in_dim(eqn: Any) -> Kernel | None:
    if len(_in_avals(eqn)) != 1:
        return None  # dynamic shapes
    shape = tuple(_params(eqn)["shape"])
    dims = tuple(_params(eqn)["broadcast_dimensions"])
    in_shape = tuple(_in_avals(eqn)[0].shape)
    expanded = [1] * len(shape)
    for i, d in enumerate(dims):
        expanded[d] = in_shape[i]
    expanded = tuple(expanded)

    def compute(x: Array) -> Array:
        return np.broadcast_to(np.reshape(x, expanded), shape)

    def into(out: Array, x: Array) -> None:
        np.copyto(out, np.reshape(x, expanded))

    return Kernel(compute=compute, into=into, overlap_safe=True, views=True)


@kernel_of("transpose")
def _transpose(eqn: Any) -> Kernel | None:
    perm = tuple(_params(eqn)["permutation"])
    return Kernel(compute=lambda x: x.transpose(perm), into=lambda out, x: np.copyto(out, x.transpose(perm)),
                  views=True)


@kernel_of("rev")
def _rev(eqn: Any) -> Kernel | None:
    dims = tuple(_params(eqn)["dimensions"])
    return Kernel(compute=lambda x: np.flip(x, dims), into=lambda out, x: np.copyto(out, np.flip(x, dims)),
                  views=True)


@kernel_of("slice")
def _slice(eqn: Any) -> Kernel | None:
    start, limit = _params(eqn)["start_indices"], _params(eqn)["limit_indices"]
    strides = _params(eqn).get("strides") or (1,) * len(start)
    index = tuple(slice(int(s), int(l), int(st)) for s, l, st in zip(start, limit, strides))
    return Kernel(compute=lambda x: x[index], into=lambda out, x: np.copyto(out, x[index]), views=True)


@kernel_of("concatenate")
def _concatenate(eqn: Any) -> Kernel | None:
    axis = int(_params(eqn)["dimension"])
    if not _native_all(eqn):
        dtype = _dt(_out_avals(eqn)[0])
        if any(_dt(a) != dtype for a in _in_avals(eqn)):
            return None
    return Kernel(compute=lambda *xs: np.concatenate(xs, axis=axis),
                  into=lambda out, *xs: np.concatenate(xs, axis=axis, out=out))


@kernel_of("split")
def _split(eqn: Any) -> Kernel | None:
    axis = int(_params(eqn)["axis"])
    sizes = [int(s) for s in _params(eqn)["sizes"]]
    bounds = list(np.cumsum(sizes)[:-1])
    return Kernel(compute=lambda x: tuple(np.split(x, bounds, axis=axis)), views=True)


@kernel_of("pad")
def _pad(eqn: Any) -> Kernel | None:
    config = [tuple(int(v) for v in c) for c in _params(eqn)["padding_config"]]
    in_shape = tuple(_in_avals(eqn)[0].shape)
    out_shape = tuple(_out_avals(eqn)[0].shape)
    # Pad with every low/high clipped at 0, then crop the negative ones.
    big_shape, place, crop = [], [], []
    for n, (lo, hi, interior) in zip(in_shape, config):
        span = (n - 1) * (interior + 1) + 1 if n else 0
        plo, phi = max(lo, 0), max(hi, 0)
        big_shape.append(plo + span + phi)
        place.append(slice(plo, plo + span, interior + 1))
        crop.append(slice(-min(lo, 0), plo + span + phi + min(hi, 0)))
    place, crop, big_shape = tuple(place), tuple(crop), tuple(big_shape)
    direct = big_shape == out_shape

    def into(out: Array, x: Array, value: Array) -> None:
        if direct:
            out[...] = value
            out[place] = x
        else:
            np.copyto(out, compute(x, value))

    def compute(x: Array, value: Array) -> Array:
        big = np.full(big_shape, value, dtype=x.dtype)
        big[place] = x
        return big[crop]

    return Kernel(compute=compute, into=into)


@kernel_of("iota")
def _iota(eqn: Any) -> Kernel | None:
    dtype = _dt(_out_avals(eqn)[0])
    if not _numpy_native(dtype):
        return None
    shape = tuple(_params(eqn)["shape"])
    dim = int(_params(eqn)["dimension"])
    expanded = [1] * len(shape)
    expanded[dim] = shape[dim]
    values = np.arange(shape[dim], dtype=dtype).reshape(expanded)

    def compute() -> Array:
        return np.broadcast_to(values, shape)

    return Kernel(compute=compute, into=lambda out: np.copyto(out, values), overlap_safe=True, views=True)


def _clamped_slices(starts: tuple[Array, ...], shape: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    """The slices of a dynamic slice or update of `sizes` at `starts`, each start clamped into
    [0, dim - size] as XLA clamps it."""
    out = []
    for s, n, k in zip(starts, shape, sizes):
        s = min(max(int(s), 0), n - k)
        out.append(slice(s, s + k))
    return tuple(out)


@kernel_of("dynamic_slice")
def _dynamic_slice(eqn: Any) -> Kernel | None:
    sizes = tuple(int(s) for s in _params(eqn)["slice_sizes"])
    shape = tuple(_in_avals(eqn)[0].shape)
    nidx = len(shape)
    if len(_in_avals(eqn)) != 1 + nidx:
        return None

    index = functools.partial(_clamped_slices, shape=shape, sizes=sizes)

    return Kernel(compute=lambda x, *st: x[index(st)], into=lambda out, x, *st: np.copyto(out, x[index(st)]),
                  views=True)


@kernel_of("dynamic_update_slice")
def _dynamic_update_slice(eqn: Any) -> Kernel | None:
    shape = tuple(_in_avals(eqn)[0].shape)
    usize = tuple(_in_avals(eqn)[1].shape)
    if len(_in_avals(eqn)) != 2 + len(shape):
        return None

    index = functools.partial(_clamped_slices, shape=shape, sizes=usize)

    def into(out: Array, x: Array, update: Array, *st: Array) -> None:
        # When the plan writes in place, `out` is `x`'s memory: copy only what differs.
        if not (out.__array_interface__["data"][0] == x.__array_interface__["data"][0]
                and out.strides == x.strides):
            np.copyto(out, x)
        out[index(st)] = update

    def compute(x: Array, update: Array, *st: Array) -> Array:
        y = np.array(x, copy=True)
        y[index(st)] = update
        return y

    return Kernel(compute=compute, into=into, alias_ok=frozenset({0}))


# ---- reductions ------------------------------------------------------------------------------

def _reduction(fn: Callable[..., Any], kinds: str, accumulate: bool = False) -> KernelMaker:
    def make(eqn: Any) -> Kernel | None:
        if not _native_all(eqn) or _dt(_in_avals(eqn)[0]).kind not in kinds:
            return None
        axes = tuple(int(a) for a in _params(eqn)["axes"])
        dtype = _dt(_out_avals(eqn)[0])
        shape = tuple(_in_avals(eqn)[0].shape)
        count = math.prod(shape[a] for a in axes)
        # numpy adds strided rows one after another (error growing with the count), where XLA
        # sums in a tree; a float64 accumulator keeps long float32 sums as accurate as XLA's.
        acc = np.float64 if accumulate and dtype.kind == "f" and dtype.itemsize < 8 and count > WIDE_SUM else dtype

        def compute(x: Array) -> Array:
            return np.asarray(fn(x, axis=axes, dtype=acc)).astype(dtype, copy=False)

        def into(out: Array, x: Array) -> None:
            if acc is dtype:
                fn(x, axis=axes, dtype=dtype, out=out)
            else:
                np.copyto(out, fn(x, axis=axes, dtype=acc), casting="unsafe")

        return Kernel(compute=compute, into=into)
    return make


# Summed elements per output beyond which float32 sums accumulate in float64.
WIDE_SUM = 256

KERNELS["reduce_sum"] = _reduction(np.add.reduce, "iufc", accumulate=True)
KERNELS["reduce_prod"] = _reduction(np.multiply.reduce, "iufc")
KERNELS["reduce_max"] = _reduction(np.maximum.reduce, "biuf")
KERNELS["reduce_min"] = _reduction(np.minimum.reduce, "biuf")
KERNELS["reduce_and"] = _reduction(np.logical_and.reduce, "b")
KERNELS["reduce_or"] = _reduction(np.logical_or.reduce, "b")
KERNELS["reduce_xor"] = _reduction(np.logical_xor.reduce, "b")


@kernel_of("argmax", "argmin")
def _argminmax(eqn: Any) -> Kernel | None:
    if not _native_all(eqn) or _dt(_in_avals(eqn)[0]).kind not in "iuf":
        return None
    (axis,) = _params(eqn)["axes"]
    axis = int(axis)
    dtype = np.dtype(_params(eqn)["index_dtype"])
    fn = np.argmax if ja.eqn_name(eqn) == "argmax" else np.argmin
    # numpy and XLA both return the first NaN, else the first extreme value
    return Kernel(compute=lambda x: fn(x, axis=axis).astype(dtype, copy=False))


def _cumulative(op: np.ufunc) -> KernelMaker:
    """The kernel of a cumulative primitive: `op` accumulated along `axis`."""
    def make(eqn: Any) -> Kernel | None:
        if not _native_all(eqn) or _dt(_in_avals(eqn)[0]).kind not in "iuf":
            return None
        axis = int(_params(eqn)["axis"])
        reverse = bool(_params(eqn).get("reverse", False))
        dtype = _dt(_out_avals(eqn)[0])

        def compute(x: Array) -> Array:
            if reverse:
                return np.flip(op.accumulate(np.flip(x, axis), axis=axis, dtype=dtype), axis)
            return op.accumulate(x, axis=axis, dtype=dtype)  # sequential, as XLA's cumulative ops

        return Kernel(compute=compute)
    return make


KERNELS["cumsum"] = _cumulative(np.add)
KERNELS["cumprod"] = _cumulative(np.multiply)
KERNELS["cummax"] = _cumulative(np.maximum)
KERNELS["cummin"] = _cumulative(np.minimum)


# ---- contractions ----------------------------------------------------------------------------

# Multiply-adds below which numpy's matmul (no dispatch cost) beats a call into XLA.
SMALL_DOT = 1 << 15


@kernel_of("dot_general")
def _dot_general(eqn: Any) -> Kernel | None:
    lhs, rhs = _in_avals(eqn)
    out_dtype = _dt(_out_avals(eqn)[0])
    if not _native_all(eqn) or _dt(lhs) != _dt(rhs) or _dt(lhs).kind not in "fc":
        return None  # integer and mixed dots: JAX (numpy int matmul does not overflow alike)
    (lc, rc), (lb, rb) = _params(eqn)["dimension_numbers"]
    lc, rc, lb, rb = map(lambda t: tuple(int(i) for i in t), (lc, rc, lb, rb))
    ls, rs = tuple(lhs.shape), tuple(rhs.shape)
    lf = tuple(i for i in range(len(ls)) if i not in lc and i not in lb)
    rf = tuple(i for i in range(len(rs)) if i not in rc and i not in rb)
    size = lambda shape, idx: math.prod(shape[i] for i in idx)
    B, M, K, N = size(ls, lb), size(ls, lf), size(ls, lc), size(rs, rf)
    if B * M * K * N > SMALL_DOT:
        # XLA's own dot: several times faster than numpy's matmul on batched or transposed
        # operands (which leave BLAS), and it rounds as jax.jit does.
        return jax_kernel(eqn)
    lperm, rperm = lb + lf + lc, rb + rc + rf
    lid = lperm == tuple(range(len(ls)))
    rid = rperm == tuple(range(len(rs)))
    compute_dtype = np.result_type(_dt(lhs), out_dtype)

    def operands(a: Array, b: Array) -> tuple[Array, Array]:
        a = (a if lid else a.transpose(lperm)).reshape(B, M, K)
        b = (b if rid else b.transpose(rperm)).reshape(B, K, N)
        if a.dtype != compute_dtype:
            a, b = a.astype(compute_dtype), b.astype(compute_dtype)
        return a, b

    out_shape3 = (B, M, N)

    def compute(a: Array, b: Array) -> Array:
        x, y = operands(a, b)
        r = np.matmul(x, y)
        return r.reshape(tuple(_out_avals(eqn)[0].shape)).astype(out_dtype, copy=False)

    if compute_dtype != out_dtype:
        return Kernel(compute=compute)

    def into(out: Array, a: Array, b: Array) -> None:
        x, y = operands(a, b)
        np.matmul(x, y, out=out.reshape(out_shape3))

    return Kernel(compute=compute, into=into)


# ---- sorting ---------------------------------------------------------------------------------

@kernel_of("sort")
def _sort(eqn: Any) -> Kernel | None:
    num_keys = int(_params(eqn)["num_keys"])
    dim = int(_params(eqn)["dimension"])
    avals = _in_avals(eqn)
    if num_keys != 1 or not _native_all(eqn) or _dt(avals[0]).kind not in "iub" + "f":
        return None
    key_float = _dt(avals[0]).kind == "f"

    def order(k: Array) -> Array:
        if key_float:
            # XLA/JAX order: -0.0 and 0.0 compare equal (stable), NaNs last
            k = np.where(k == 0, np.zeros((), k.dtype), k)
        return np.argsort(k, axis=dim, kind="stable")

    if len(avals) == 1:
        return Kernel(compute=lambda x: (np.take_along_axis(x, order(x), axis=dim),))

    def compute(*xs: Array) -> tuple[Array, ...]:
        idx = order(xs[0])
        return tuple(np.take_along_axis(x, idx, axis=dim) for x in xs)

    return Kernel(compute=compute)


# ---- windows ---------------------------------------------------------------------------------

def _window_params(eqn: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]] | None:
    p = _params(eqn)
    if any(int(d) != 1 for d in p.get("base_dilation", ())) or any(int(d) != 1 for d in p.get("window_dilation", ())):
        return None
    dims = tuple(int(d) for d in p["window_dimensions"])
    strides = tuple(int(s) for s in p["window_strides"])
    padding = tuple((int(lo), int(hi)) for lo, hi in p["padding"])
    if any(lo < 0 or hi < 0 for lo, hi in padding):
        return None
    return dims, strides, padding


def _windows(x: Array, dims: tuple[int, ...], strides: tuple[int, ...],
             padding: tuple[tuple[int, int], ...], fill: Any) -> Array:
    if any(lo or hi for lo, hi in padding):
        x = np.pad(x, padding, constant_values=fill)
    w = np.lib.stride_tricks.sliding_window_view(x, dims)
    return w[tuple(slice(None, None, s) for s in strides)]


@kernel_of("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def _reduce_window(eqn: Any) -> Kernel | None:
    parsed = _window_params(eqn)
    dtype = _dt(_in_avals(eqn)[0])
    if parsed is None or not _native_all(eqn) or dtype.kind not in "iuf":
        return None
    dims, strides, padding = parsed
    name = ja.eqn_name(eqn)
    if name == "reduce_window_sum":
        fn, fill = np.add.reduce, 0
    elif name == "reduce_window_max":
        fn, fill = np.maximum.reduce, (-np.inf if dtype.kind == "f" else np.iinfo(dtype).min)
    else:
        fn, fill = np.minimum.reduce, (np.inf if dtype.kind == "f" else np.iinfo(dtype).max)
    axes = tuple(range(len(dims), 2 * len(dims)))

    def compute(x: Array) -> Array:
        return fn(_windows(x, dims, strides, padding, fill), axis=axes).astype(dtype, copy=False)

    if math.prod(dims) > WINDOW_PASSES:
        return Kernel(compute=compute)
    # A small window (pooling): one ufunc pass per window position over a strided view of
    # the input, 2-4x faster than reducing the window axes of a sliding-window view.
    out_shape = tuple(int(n) for n in _out_avals(eqn)[0].shape)
    positions = [tuple(slice(o, o + s * (n - 1) + 1, s) for o, s, n in zip(offset, strides, out_shape))
                 for offset in np.ndindex(*dims)]
    combine = fn.__self__  # the ufunc whose reduce fn is
    padded = any(lo or hi for lo, hi in padding)

    def into(out: Array, x: Array) -> None:
        if padded:
            x = np.pad(x, padding, constant_values=fill)
        if len(positions) == 1:
            np.copyto(out, x[positions[0]])
            return
        combine(x[positions[0]], x[positions[1]], out=out)
        for pos in positions[2:]:
            combine(out, x[pos], out=out)

    def compute_passes(x: Array) -> Array:
        out = np.empty(out_shape, dtype)
        into(out, x)
        return out

    return Kernel(compute=compute_passes, into=into)


# Window positions up to which reduce_window runs as one pass per position.
WINDOW_PASSES = 64


@kernel_of("select_and_scatter_add")
def _select_and_scatter_add(eqn: Any) -> Kernel | None:
    # The gradient of max pooling: each source value goes to the first maximal element of its
    # window (select_prim ge: the earliest of equal values wins), summed where windows overlap.
    p = _params(eqn)
    select = getattr(p["select_prim"], "name", str(p["select_prim"]))
    source_aval, operand_aval = _in_avals(eqn)
    dtype = _dt(operand_aval)
    window = _window_params(eqn)   # no dilations in its parameters
    if select not in ("ge", "le") or not _native_all(eqn) or dtype.kind != "f" or window is None:
        return None
    dims, strides, padding = window
    shape = tuple(operand_aval.shape)
    out_shape = tuple(int(n) for n in source_aval.shape)
    padded_shape = tuple(n + lo + hi for n, (lo, hi) in zip(shape, padding))
    padded = any(lo or hi for lo, hi in padding)
    fill = dtype.type(-np.inf if select == "ge" else np.inf)
    keep = np.greater_equal if select == "ge" else np.less_equal
    extreme = np.maximum if select == "ge" else np.minimum
    # The elements at window position k of every window form one strided view: a handful of
    # vectorised passes (one per window position) instead of a pass per window.
    positions = [tuple(slice(o, o + s * (n - 1) + 1, s) for o, s, n in zip(offset, strides, out_shape))
                 for offset in np.ndindex(*dims)]
    index_dtype = np.uint8 if len(positions) < 256 else np.int32
    inner = tuple(slice(lo, lo + n) for n, (lo, _) in zip(shape, padding))
    zero = dtype.type(0)

    def scatter(acc: Array, source: Array, operand: Array) -> None:
        x = np.pad(operand, padding, constant_values=fill) if padded else operand
        # XLA's scan of a window: the selected element stays unless select(selected, next)
        # is false (so with ge the earliest of equal values wins, and a NaN is passed over).
        best = np.array(x[positions[0]], copy=True)
        choice = np.zeros(out_shape, index_dtype)
        take = np.empty(out_shape, np.bool_)
        step = np.empty(out_shape, index_dtype)
        # Without NaNs the selected value is a running max (min); masked copies are 10x slower.
        nan = bool(np.isnan(operand).any())
        for k in range(1, len(positions)):
            v = x[positions[k]]
            keep(best, v, out=take)
            np.logical_not(take, out=take)
            if nan:
                np.copyto(best, v, where=take)
            else:
                extreme(best, v, out=best)
            # k exceeds every earlier position, so a max records the latest switch
            np.multiply(take, index_dtype(k), out=step)
            np.maximum(choice, step, out=choice)
        acc[...] = 0
        hit = np.empty(out_shape, dtype)
        finite = bool(np.isfinite(source).all())  # else inf * 0 would leak NaN where not chosen
        for k, pos in enumerate(positions):
            np.equal(choice, k, out=take)
            if finite:
                np.multiply(source, take, out=hit)
            else:
                hit[...] = zero
                np.copyto(hit, source, where=take)
            acc[pos] += hit

    def compute(source: Array, operand: Array) -> Array:
        acc = np.empty(padded_shape, dtype)
        scatter(acc, source, operand)
        return acc[inner]

    if padded:
        return Kernel(compute=compute)
    return Kernel(compute=compute, into=scatter)


# ---- PRNG keys: data layout is identical, so wrap/unwrap is a copy ----------------------------

def _key_copy(eqn: Any) -> Kernel:
    return _identity(eqn)


KEY_COPY: dict[str, Callable[[Any], Kernel]] = {"random_wrap": _key_copy, "random_unwrap": _key_copy}


def clear_kernel_cache() -> None:
    """Forget the jitted JAX fallbacks (they hold compiled executables)."""
    _JAX_KERNELS.clear()
