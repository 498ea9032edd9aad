"""Checkpoint sites: the places in a user's code where `jax.checkpoint` can go, and the
standard policies fit names.

A site is the function handed to `jax.grad` / `jax.value_and_grad` / `jax.vjp` (`kind="grad"`),
a `lax.scan` (or static `fori_loop`) body inside it (`"scan"`), a user function called
repeatedly from one line inside it, a layer called from a Python loop (`"layer"`), or each
iteration of a `for` loop at the top of a user function, a layer written inline (`"loop"`), or
a `jax.checkpoint` the user already wrote, whose policy fit may replace (`"own"`). The
differentiated function is met through hooks installed once on the JAX internals every
reverse-mode entry runs through (so `from jax import grad` done earlier is seen too), which
dispatch through a context variable (`fitting.jax_hooks`' one mechanism): a thread (or task)
outside `checkpoint_sites` runs JAX's own.
Scan, layer and loop sites are read from the differentiated function's own trace, so they do
not depend on how the user imported `scan`: its Python calls and loop iterations are traced
under name scopes (`sys.settrace`, this thread only, chained with any trace function already
installed) and each one's equations are a run that `jax.checkpoint` can wrap
(`compiler.jaxpr_adapter.run_checkpointed`).
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import functools
import linecache
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import SourceLine
from jaxmem.errors import PlanError
from jaxmem.fitting import jax_hooks


@dataclass(frozen=True)
class CheckpointSite:
    """A place in the user's code where `jax.checkpoint` can go: the function differentiated by
    `jax.grad` / `jax.value_and_grad` / `jax.vjp` (`kind="grad"`), a `lax.scan` body
    (`"scan"`), a function called once per layer from one line (`"layer"`), or the iterations
    of a `for` loop (`"loop"`: `callee` is the loop variable, `args` the names the body
    updates), or the user's own `jax.checkpoint` of `function` (`"own"`: `written` is its
    policy). `call` is the user's line that makes the call; `function` names the wrapped function and `defined` where
    it is defined. For a layer, `text` is the line as written and `span` the call's columns in
    it; `static` / `static_names` the non-array arguments; `calls` how many calls it makes."""

    kind: str
    call: SourceLine
    function: str
    defined: str                   # "file:line" of the wrapped function's def (or lambda)
    text: str = ""
    span: tuple[int, int] | None = None
    callee: str = ""               # the called expression as written (`self.block`)
    args: str = ""                 # the arguments as written
    static: tuple[int, ...] = ()
    static_names: tuple[str, ...] = ()
    calls: int = 1
    traced_for: str = "scan"
    written: Any = field(default=None, compare=False)   # kind "own": the policy the user wrote (None: default)
    split: tuple[int | str, ...] = field(default=(), compare=False)  # kind "grad": the arguments of the
                                   # gradient call that carry the batch (`fitting.accumulate.batch_split`)
    closed: tuple[str, ...] = field(default=(), compare=False)  # ... and the names of the batch values
                                   # the differentiated function closes over
    batch: int = 0                 # ... and the batch size, their leading dimension (0: no batch seen)

    @property
    def key(self) -> str:
        tail = f":{self.function}" if self.kind == "layer" else ""  # two functions called on one line
        return f"{self.kind}@{self.call.file}:{self.call.line}{tail}"

    def __str__(self) -> str:
        return f"{self.call.file}:{self.call.line} ({self.call.function})"


def _user_frame(depth: int) -> Any:
    """The first frame up from `depth` (counted from the caller) that is neither JAX's nor
    jaxmem's: the user's line that called into JAX; None if there is none."""
    frame = sys._getframe(depth + 1)
    while frame is not None and ja.is_internal_frame(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _calling_site(kind: str, fun: Callable[..., Any], depth: int = 2, frame: Any = None) -> CheckpointSite:
    """The user's line that called into JAX (the first frame up from `depth` that is neither
    JAX's nor jaxmem's, or `frame` where the caller found it)."""
    frame = frame if frame is not None else _user_frame(depth)
    call = (SourceLine(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
            if frame is not None else SourceLine("<unknown>", 0, "<unknown>"))
    code = getattr(getattr(fun, "__wrapped__", fun), "__code__", None)
    name = getattr(fun, "__name__", type(fun).__name__)
    defined = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "?"
    return CheckpointSite(kind, call, name, defined)


# A policy over dot outputs fit names for the user by source line ("rnn.py:38"): the dots are
# tagged with jax.ad_checkpoint.checkpoint_name while the scan body is traced (`tag_dots`), and
# the policy is save_only_these_names over the tags kept.
NAMED_DOTS = "save_only_these_dots:"
# A scan body's residuals fit names (its carry on entry, CARRY_TAG, and the dots by line) and
# offloads to pinned host memory, saving nothing on the device:
# save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=...).
OFFLOAD_NAMES = "offload_these_names:"
CARRY_TAG = "scan_carry"


def dot_tag(line: SourceLine) -> str:
    """The name fit gives a dot made on `line`: the file's name and the line ("rnn.py:38")."""
    return f"{line.file.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line.line}"


def tag_carry(step: Callable[..., Any]) -> Callable[..., Any]:
    """A scan body `step(carry, x)` with every leaf of its carry passed through
    `checkpoint_name(leaf, CARRY_TAG)` on entry: what a user writes as the body's first line, so a
    names policy can offload the carry each iteration stacks for the backward pass."""
    from jax.ad_checkpoint import checkpoint_name

    @functools.wraps(step)
    def tagged(carry: Any, x: Any) -> Any:
        return step(jax.tree.map(lambda v: checkpoint_name(v, CARRY_TAG), carry), x)

    return tagged


def tag_dots(f: Callable[..., Any], tags: Sequence[str]) -> Callable[..., Any]:
    """`f` with each dot_general it binds on a user line whose `dot_tag` is in `tags` passed
    through `checkpoint_name(out, tag)`: what a user writes around that line's product, so
    `save_only_these_names(*tags)` can keep exactly those dots."""
    from jax.ad_checkpoint import checkpoint_name

    wanted = set(tags)

    def tag(eqn: Any, outs: list[Any]) -> list[Any]:
        if ja.eqn_name(eqn) == "dot_general":
            line = ja.source_line(eqn)
            if line is not None and dot_tag(line) in wanted:
                return [checkpoint_name(o, dot_tag(line)) for o in outs]
        return outs

    def tagged(*args: Any) -> Any:
        closed, shape = ja.make_closed_jaxpr(f, *args, return_shape=True)
        flat = ja.eval_closed_jaxpr(closed, jax.tree.leaves(args), tag)
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return tagged


@functools.lru_cache(maxsize=None)
def checkpoint_policy(name: str) -> Any:
    """A `jax.checkpoint_policies` policy by the name jaxmem prints for it ("default": None, the
    policy of a plain `jax.checkpoint(f)`).

    >>> checkpoint_policy("dots_saveable") is jax.checkpoint_policies.dots_saveable
    True
    """
    policies = jax.checkpoint_policies
    if name == "default":
        return None  # jax.checkpoint(f): saves only the inputs
    if name.startswith(("save_only_these_names:", NAMED_DOTS)):
        return policies.save_only_these_names(*name.split(":", 1)[1].split(","))
    if name.startswith(OFFLOAD_NAMES):
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=name.split(":", 1)[1].split(","),
            offload_src="device", offload_dst="pinned_host")
    if name.startswith("offload_dot_with_no_batch_dims"):
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    if not hasattr(policies, name):
        raise PlanError(f"jax.checkpoint_policies has no policy {name!r}")
    return getattr(policies, name)


# -- the user's own jax.checkpoint calls (kind "own") -------------------------------------------

def own_checkpoints(closed_jaxpr: Any) -> list[CheckpointSite]:
    """The user's own `jax.checkpoint` calls in a traced step: one site per line that calls a
    checkpointed function (the line JAX records on its checkpoint equation), named by the
    function and where it is defined (a MaxText-style `jax.checkpoint(layer)` on a scan body:
    its policy is the user's, which fit's other sites cannot change)."""
    found: dict[str, CheckpointSite] = {}
    for eqn in ja.walk_eqns(closed_jaxpr):
        if ja.eqn_is(eqn, jax_hooks.remat_primitive()):
            call = ja.source_line(eqn)
            if call is not None:
                params = ja.eqn_params(eqn)
                info = ja.jaxpr_debug_info(params["jaxpr"])
                function, _, defined = (getattr(info, "func_src_info", "") or "").partition(" at ")
                site = CheckpointSite("own", SourceLine(call.file, call.line, call.function),
                                      function or "?", defined or "?", written=params.get("policy"))
                found.setdefault(site.key, site)
    return list(found.values())


_OWN: contextvars.ContextVar["tuple[frozenset[tuple[str, int]] | None, Any] | None"] = contextvars.ContextVar(
    "jaxmem_own_policy", default=None)


def _hooked_remat_bind(original: Callable[..., Any]) -> Callable[..., Any]:
    """The checkpoint primitive's `bind` (what `jax.checkpoint`'s wrapper calls, with the
    user's policy as a parameter): inside `own_policy`, a bind from one of its lines gets that
    policy instead. Outside, JAX's own runs at once."""

    def bind(*args: Any, **params: Any) -> Any:
        active = _OWN.get()
        if active is not None and "policy" in params:
            lines, policy = active
            if lines is None or jax_hooks.innermost_line() in lines:
                params["policy"] = policy
        return original(*args, **params)

    bind.__jaxmem_original__ = original  # type: ignore[attr-defined]
    return bind


def _install_own() -> None:
    """Hook, once per process, the checkpoint primitive's `bind` (an instance attribute:
    `remat_p.bind(...)` finds it first)."""
    jax_hooks.hook(jax_hooks.remat_primitive(), "bind", _hooked_remat_bind)


class own_policy:
    """A context in which the user's own `jax.checkpoint` calls made from `sites` (all of
    them for None) use `policy` (a `jax.checkpoint_policies` policy, None for the default)
    in place of the one they were written with, as if the user had written it there.

    >>> with own_policy(None, jax.checkpoint_policies.dots_saveable):   # doctest: +SKIP
    ...     jax.make_jaxpr(step)(params, batch)
    """

    def __init__(self, sites: Sequence[CheckpointSite] | None, policy: Any):
        self.lines = None if sites is None else frozenset((s.call.file, s.call.line) for s in sites)
        self.policy = policy
        self._tokens: list[contextvars.Token[Any]] = []

    def __enter__(self) -> "own_policy":
        _install_own()
        self._tokens.append(_OWN.set((self.lines, self.policy)))
        return self

    def __exit__(self, *exc: Any) -> None:
        _OWN.reset(self._tokens.pop())


# -- the grad sites: hooks on JAX's internals, installed once, dispatching per context -------

_ACTIVE: contextvars.ContextVar["checkpoint_sites | None"] = contextvars.ContextVar(
    "jaxmem_checkpoint_sites", default=None)
_INSTALLED: list[str] = []
_PARTIAL = "__jaxmem_grad_of__"   # marks the closure `argnums_partial2` builds around a user function


def _note_and_wrap(ctx: "checkpoint_sites", fun: Callable[..., Any]) -> Callable[..., Any]:
    site = _calling_site("grad", fun, depth=3)
    ctx._note(site)
    return ctx.wrap(site, fun)


def _grad_site(fun: Callable[..., Any], dyn_argnums: tuple[int, ...], args: Any, kwargs: Any) -> CheckpointSite:
    """The site of a gradient call `grad_fn(*args, **kwargs)` (met through `argnums_partial2`):
    its line, the call's columns on it, and which of its arguments carry the batch."""
    from jaxmem.fitting.accumulate import batch_split, closed_over

    frame = _user_frame(2)
    site = _calling_site("grad", fun, frame=frame) if frame is not None else _calling_site("grad", fun, depth=3)
    split, closed, batch = batch_split(args, kwargs, dyn_argnums, closed_over(fun))
    if frame is None:
        return dataclasses.replace(site, split=split, closed=closed, batch=batch)
    text, span, callee, call_args, _, _ = _call_expression(frame)
    return dataclasses.replace(site, text=text, span=span, callee=callee, args=call_args, split=split, closed=closed,
                               batch=batch)


def _accumulating(ctx: "checkpoint_sites", site: CheckpointSite, fun: Callable[..., Any],
                  dyn_argnums: tuple[int, ...], has_aux: bool) -> Callable[..., Any]:
    """`fun` as the context runs it at `site`: accumulated over micro-batches where it asks."""
    steps = ctx.accumulate(site) if ctx.accumulate is not None and site.batch else 0
    if not steps:
        return fun
    from jaxmem.fitting.accumulate import accumulated

    return accumulated(fun, dyn_argnums, has_aux, steps, site.split, site.closed, outside=_outside)


@contextlib.contextmanager
def _outside() -> Any:
    """JAX's own gradient functions in this thread for a while (the micro-batches' gradients)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _hooked_partial(original: Callable[..., Any]) -> Callable[..., Any]:
    """`jax._src.api.argnums_partial2(f, argnums, args, kwargs)`: where `grad` and
    `value_and_grad` bind the user's function to the call's arguments. The returned closure is
    marked with the user's function and arguments; the reverse-mode hook below wraps them."""

    @functools.wraps(original)
    def argnums_partial2(f: Callable[..., Any], dyn_argnums: Any, args: Any, kwargs: Any) -> Any:
        bound, dyn = original(f, dyn_argnums, args, kwargs)
        if _ACTIVE.get() is not None:
            setattr(bound, _PARTIAL, (original, f, dyn_argnums, args, kwargs))
        return bound, dyn

    argnums_partial2.__jaxmem_original__ = original  # type: ignore[attr-defined]
    return argnums_partial2


def _hooked_linearize(original: Callable[..., Any]) -> Callable[..., Any]:
    """`jax._src.interpreters.ad.linearize(..., is_vjp=True)`: what every reverse-mode entry
    (`grad`, `value_and_grad`, `vjp`, `jacrev`) calls at call time, however the user imported
    it. Its function is either the user's (`vjp(f, x)`) or the closure `argnums_partial2` made
    (`grad(f)(x)`): then the user's function is wrapped and bound again."""

    @functools.wraps(original)
    def linearize(traceable: Any, primals_ft: Any, has_aux: bool = False, is_vjp: bool = False) -> Any:
        ctx = _ACTIVE.get()
        if ctx is None or not is_vjp:  # another thread, no fit running, or forward mode: JAX's own
            return original(traceable, primals_ft, has_aux=has_aux, is_vjp=is_vjp)
        bound = getattr(traceable, _PARTIAL, None)
        if bound is None:
            traceable = _note_and_wrap(ctx, traceable)
        else:
            partial2, f, dyn_argnums, args, kwargs = bound
            dyn = tuple(i % max(len(args), 1) for i in (dyn_argnums if isinstance(dyn_argnums, (tuple, list))
                                                         else (dyn_argnums,)))
            site = _grad_site(f, dyn, args, kwargs)
            ctx._note(site)
            wrapped = _accumulating(ctx, site, ctx.wrap(site, f), dyn, has_aux)
            traceable, _ = partial2(wrapped, dyn_argnums, args, kwargs)
        return original(traceable, primals_ft, has_aux=has_aux, is_vjp=is_vjp)

    linearize.__jaxmem_original__ = original  # type: ignore[attr-defined]
    return linearize


def _install() -> None:
    """Hook, once per process, the two module globals of JAX that `grad`, `value_and_grad` and
    `vjp` look up when they run (JAX 0.10: `api.argnums_partial2`, `ad.linearize`), so a
    function the user imported by name before fit started (`from jax import grad`) is seen.
    Outside any context the hooks call JAX's own at once."""
    if _INSTALLED:
        return
    api, ad = jax_hooks.reverse_mode_modules()
    if not (jax_hooks.hook(api, "argnums_partial2", _hooked_partial)
            and jax_hooks.hook(ad, "linearize", _hooked_linearize)):
        raise PlanError("this JAX has no jax._src.api.argnums_partial2 / jax._src.interpreters.ad.linearize "
                        "for fit to find the differentiated function")
    _INSTALLED.append(jax.__version__)


class checkpoint_sites:
    """A context in which the functions this thread differentiates in reverse mode
    (`jax.grad`, `jax.value_and_grad`, `jax.vjp`, however imported) are passed through
    `wrap(site, fun) -> fun` while a user's function is traced. `found` lists every site met,
    in order (scan and layer sites are added by whoever traces the differentiated function:
    `trace_body`).

    >>> with checkpoint_sites(lambda site, f: f) as ctx:        # doctest: +SKIP
    ...     jax.make_jaxpr(step)(params, batch)
    >>> [str(s) for s in ctx.found]                                # doctest: +SKIP

    The site's `call` is the user's line that calls the gradient function (for
    `g = jax.grad(f)` written apart, where `g(x)` runs, not where `g` was made). Other threads,
    and code run outside the context, see JAX's own functions.
    """

    def __init__(self, wrap: Callable[[CheckpointSite, Callable[..., Any]], Callable[..., Any]],
                 accumulate: Callable[[CheckpointSite], int] | None = None):
        self.wrap = wrap
        self.accumulate = accumulate   # micro-batches to run a grad site's loss over (0: as written)
        self.found: list[CheckpointSite] = []
        self._tokens: list[contextvars.Token[Any]] = []

    def _note(self, site: CheckpointSite) -> None:
        if all(s.key != site.key for s in self.found):
            self.found.append(site)

    def __enter__(self) -> "checkpoint_sites":
        _install()
        self._tokens.append(_ACTIVE.set(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._tokens.pop())


# -- scan and layer sites, from the differentiated function's own trace -----------------------

SCOPE = "jaxmem_call"


@dataclass
class _Call:
    caller: SourceLine
    function: str
    defined: str
    text: str
    span: tuple[int, int] | None
    callee: str
    args: str
    static: tuple[int, ...]
    static_names: tuple[str, ...]
    parent: int | None


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def is_array_tree(value: Any) -> bool:
    """Whether `value` is a pytree of arrays. A local seen mid-construction (a pytree whose
    `__init__` has not yet set what its flatten reads, as Flax's `FrozenDict` in its own
    `__init__`) is not: looking must never raise in the user's frames."""
    try:
        leaves = jax.tree.leaves(value)
    except Exception:
        return False
    return bool(leaves) and all(_is_array(x) for x in leaves)


def _call_expression(frame: Any) -> tuple[str, tuple[int, int] | None, str, str, int, tuple[str, ...]]:
    """The line of a call, the call's columns in it, the called expression and the arguments as
    written (from the caller's current instruction), how many positional argument expressions it
    has and its keyword names."""
    code, line = frame.f_code, frame.f_lineno
    text = linecache.getline(code.co_filename, line).rstrip("\n")
    try:
        positions = list(code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError):
        return text, None, "", "", 0, ()
    start_line, end_line, col, end_col = positions
    if start_line != line or end_line != line or col is None or end_col is None:
        return text, None, "", "", 0, ()
    raw = text.encode()[col:end_col].decode(errors="replace")
    try:
        node = ast.parse(raw, mode="eval").body
    except SyntaxError:
        return text, None, "", "", 0, ()
    if not isinstance(node, ast.Call):
        return text, None, "", "", 0, ()
    args = ", ".join(ast.get_source_segment(raw, a) or ast.unparse(a) for a in [*node.args, *node.keywords])
    keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
    return (text, (col, end_col), ast.get_source_segment(raw, node.func) or ast.unparse(node.func), args,
            len(node.args), keywords)


@dataclass(frozen=True)
class _Loop:
    """A `for` statement at the top of a user function's body (not inside another loop)."""

    head: int                      # the `for` line
    last: int                      # the body's last line
    target: str                    # the loop variable(s) as written
    carried: tuple[str, ...]       # names the body reads before it assigns them (`x = f(x)`)


def _names(node: ast.AST, ctx: type) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)]


@functools.lru_cache(maxsize=1024)
def _loops(filename: str, firstlineno: int) -> dict[int, _Loop]:
    """The outermost `for` loops of the function defined at `firstlineno`, by their `for` line."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return {}
    func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and min([n.lineno, *(d.lineno for d in n.decorator_list)]) == firstlineno), None)
    if func is None:
        return {}
    found: dict[int, _Loop] = {}

    def visit(stmts: list[ast.stmt]) -> None:
        for st in stmts:
            if isinstance(st, ast.For):
                stored: set[str] = set()
                carried: list[str] = []
                assigned = {n for b in st.body for n in _names(b, ast.Store)}
                for b in st.body:  # a statement reads its operands before it stores its targets
                    carried += [n for n in _names(b, ast.Load) if n in assigned and n not in stored and n not in carried]
                    stored |= set(_names(b, ast.Store))
                found[st.lineno] = _Loop(st.lineno, st.body[-1].end_lineno or st.lineno, ast.unparse(st.target),
                                         tuple(carried))
            elif isinstance(st, (ast.If, ast.With, ast.Try)):
                for field_ in ("body", "orelse", "finalbody", "handlers"):
                    visit([x for x in getattr(st, field_, []) if isinstance(x, ast.stmt)])

    visit(func.body)
    return found


class _CallScopes:
    """A trace hook (`sys.settrace`, this thread only) that traces each call of a user function
    made from the user's code, and each iteration of a `for` loop at the top of a user function,
    under its own `jax.named_scope(f"{SCOPE}{n}")`, and remembers where it was made."""

    def __init__(self, previous: Any = None) -> None:
        self.calls: dict[int, _Call] = {}
        self.stack: list[tuple[int, Any]] = []   # (number, scope) of every scope open, innermost last
        self.root: Any = None
        self.previous = previous                 # the trace function installed before (a debugger's, coverage's)

    def _open(self, info: _Call) -> int:
        n = len(self.calls)
        self.calls[n] = info
        scope = jax.named_scope(f"{SCOPE}{n}")
        scope.__enter__()
        self.stack.append((n, scope))
        return n

    def _close(self, n: int) -> None:
        while self.stack:  # scopes close innermost first
            m, scope = self.stack.pop()
            scope.__exit__(None, None, None)
            if m == n:
                return

    def _parent(self) -> int | None:
        return self.stack[-1][0] if self.stack else None

    def _call(self, frame: Any) -> int | None:
        code = frame.f_code
        caller = frame.f_back
        while caller is not None and caller is not self.root and ja.is_internal_frame(caller.f_code.co_filename):
            caller = caller.f_back
        if caller is None or caller is self.root or not ja.is_user_file(caller.f_code.co_filename):
            return None
        text, span, callee, args, n_args, keywords = _call_expression(caller)
        names = code.co_varnames[:code.co_argcount]
        shift = 1 if names[:1] == ("self",) and "." in callee else 0
        static = tuple(i - shift for i, v in enumerate(names[:shift + n_args])
                       if i >= shift and v in frame.f_locals and not is_array_tree(frame.f_locals[v]))
        static_names = tuple(k for k in keywords if k in frame.f_locals and not is_array_tree(frame.f_locals[k]))
        return self._open(_Call(SourceLine(caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name),
                                code.co_name, f"{code.co_filename}:{code.co_firstlineno}", text, span,
                                callee, args, static, static_names, self._parent()))

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        """The global trace function: ours, chained with the one installed before, so a debugger
        or coverage keeps its events while fit traces (the frames already running keep their
        own local trace functions: the interpreter calls those directly)."""
        theirs = self.previous(frame, event, arg) if self.previous is not None else None
        ours = self._trace(frame, event, arg)
        if theirs is None or ours is None:
            return ours if theirs is None else theirs
        return _chain(ours, theirs)

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        code = frame.f_code
        if not ja.is_user_file(code.co_filename) or (code.co_name.startswith("<") and code.co_name != "<lambda>"):
            return None
        call = self._call(frame)
        loops = _loops(code.co_filename, code.co_firstlineno) if frame is not self.root else {}
        if call is None and not loops:
            return None
        iteration: list[Any] = [None, None]   # (scope number or None, loop) of the iteration running

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and loops:
                line = frame.f_lineno
                n, loop = iteration
                if line in loops:  # the `for` line: an iteration ends; the next item is taken outside any
                    if n is not None:
                        self._close(n)
                    iteration[:] = [None, loops[line]]
                elif loop is not None and loop.head < line <= loop.last:
                    if n is None:  # the body's first line: the iteration begins
                        text = linecache.getline(code.co_filename, loop.head).strip()
                        iteration[0] = self._open(_Call(SourceLine(code.co_filename, loop.head, code.co_name), "<loop>",
                                                        f"{code.co_filename}:{loop.head}", text, None, loop.target,
                                                        ", ".join(loop.carried), (), (), self._parent()))
                elif loop is not None:  # past the loop
                    if n is not None:
                        self._close(n)
                    iteration[:] = [None, None]
            elif event == "return":
                if iteration[0] is not None:
                    self._close(iteration[0])
                if call is not None:
                    self._close(call)
            return local

        return local


def _chain(ours: Any, theirs: Any) -> Any:
    """A frame's local trace function that calls both, each keeping the local function it
    returns (None from a local function keeps the current one, as CPython does)."""
    local = [ours, theirs]

    def both(frame: Any, event: str, arg: Any) -> Any:
        for k, fn in enumerate(local):
            if fn is not None:
                got = fn(frame, event, arg)
                if got is not None:
                    local[k] = got
        return both

    return both


@dataclass
class TracedBody:
    """The differentiated function traced once: its jaxpr, and its scan and layer sites with
    the equations each covers. `run(kinds, keys, checkpoint)` evaluates it with the chosen sites
    under `checkpoint`; everything else is bound as traced."""

    closed: Any
    out_tree: Any
    dynamic: list[Any]
    scans: list[tuple[CheckpointSite, int]] = field(default_factory=list)
    layers: list[tuple[CheckpointSite, list[tuple[int, int]]]] = field(default_factory=list)

    @property
    def sites(self) -> list[CheckpointSite]:
        return [s for s, _ in self.scans] + [s for s, _ in self.layers]

    def run(self, kinds: Sequence[str], keys: Sequence[str] | None,
            checkpoint: Callable[[Callable[..., Any]], Callable[..., Any]], but_last: bool = False,
            group: int = 0, rest: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None) -> Any:
        """`but_last`: leave each site's last call (iteration) as it is: the backward pass uses
        its values at once, so a checkpoint there recomputes them for no memory. `group` > 0:
        on each chosen layer or loop site, the first `group` calls run as one function under
        `checkpoint` and the calls after them as one function under `rest` (as traced where
        None): one checkpoint keeps only the group's inputs, where a checkpoint per call keeps
        every call's."""
        chosen = lambda s: s.kind in kinds and (keys is None or s.key in keys)  # noqa: E731
        per_run: dict[int, Callable[[Callable[..., Any]], Callable[..., Any]]] = {}
        if group:
            runs = []
            for s, rs in self.layers:
                if chosen(s):
                    rs = sorted(rs)
                    runs.append((rs[0][0], rs[min(group, len(rs)) - 1][1]))
                    if group < len(rs) and rest is not None:
                        runs.append((rs[group][0], rs[-1][1]))
                        per_run[rs[group][0]] = rest
            runs.sort()
        else:
            runs = sorted(r for s, rs in self.layers if chosen(s) for r in (sorted(rs)[:-1] if but_last else rs))
        outer: list[tuple[int, int]] = []
        for start, end in runs:  # a call inside a chosen call is already under its checkpoint
            if not outer or start >= outer[-1][1]:
                outer.append((start, end))
        scans = [i for s, i in self.scans if chosen(s) and not any(a <= i < b for a, b in outer)]
        flat = ja.run_checkpointed(self.closed, outer, scans, checkpoint, per_run)(*self.dynamic)
        return jax.tree.unflatten(self.out_tree, flat)


def trace_body(body: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> TracedBody:
    """Trace `body(*args, **kwargs)` (non-array leaves stay constants) with its user calls and
    loop iterations under name scopes; a layer site is a (line, function) pair called at least
    twice, not inside another such call; a loop site a loop run at least twice per trace."""
    leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs)))
    dyn = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    previous = sys.gettrace()
    scopes = _CallScopes(previous)

    def flat_body(*values: Any) -> Any:
        scopes.root = sys._getframe()
        full = list(leaves)
        for i, v in zip(dyn, values):
            full[i] = v
        a, k = jax.tree.unflatten(tree, full)
        return body(*a, **k)

    dynamic = [leaves[i] for i in dyn]
    sys.settrace(scopes)
    try:
        closed, shape = ja.make_closed_jaxpr(flat_body, *dynamic, return_shape=True)
    finally:
        sys.settrace(previous)
        while scopes.stack:  # an exception left scopes open
            scopes.stack.pop()[1].__exit__(None, None, None)
    traced = TracedBody(closed, jax.tree.structure(shape), dynamic)
    for scan in ja.scan_eqns(closed):
        call = scan.source or SourceLine("<unknown>", 0, "<unknown>")
        traced.scans.append((CheckpointSite("scan", call, scan.body, scan.defined, traced_for=scan.traced_for),
                             scan.index))
    runs = ja.scope_runs(closed, SCOPE)
    groups: dict[tuple[str, int, str, str], list[int]] = {}
    for n, c in scopes.calls.items():
        if n in runs:
            groups.setdefault((c.caller.file, c.caller.line, c.function, c.defined), []).append(n)
    repeated = {g: ns for g, ns in groups.items() if len(ns) >= 2}
    in_calls = {n for g, ns in repeated.items() if g[2] != "<loop>" for n in ns}
    in_loops = {n for g, ns in repeated.items() if g[2] == "<loop>" for n in ns}

    def nested(n: int, outer: set[int]) -> bool:
        parent = scopes.calls[n].parent
        while parent is not None:
            if parent in outer:
                return True
            parent = scopes.calls[parent].parent
        return False

    for g, ns in repeated.items():
        loop = g[2] == "<loop>"
        # A call inside a repeated call is part of that layer; a loop inside a repeated call or
        # loop is part of it too. A call inside a loop's iteration is a site of its own.
        if any(nested(n, in_calls | in_loops if loop else in_calls) for n in ns):
            continue
        c = scopes.calls[ns[0]]
        if loop:
            site = CheckpointSite("loop", c.caller, c.caller.function, c.defined, c.text, None, c.callee,
                                  c.args, calls=len(ns))
        else:
            site = CheckpointSite("layer", c.caller, c.function, c.defined, c.text, c.span, c.callee, c.args,
                                  c.static, c.static_names, len(ns))
        traced.layers.append((site, [runs[n] for n in ns]))
    return traced


def body_sites(body: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list[CheckpointSite]:
    """The scan, layer and loop sites of a differentiated function, traced abstractly."""
    return trace_body(body, args, kwargs).sites
