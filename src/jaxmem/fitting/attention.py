"""Attention in query blocks: `jax.nn.dot_product_attention` (XLA's implementation) over blocks
of queries, each block under `jax.checkpoint`.

XLA's implementation writes the whole [batch, heads, queries, keys] score matrix, and its
backward pass holds three of them at once (the scores recomputed or saved, the probabilities'
gradient, the scores' gradient): on long_seq_train (2 layers, 2048 tokens, 4 heads) 64 MiB
each, 395.9 MiB in all on an H100, against 203.2 for half its temporaries. Over blocks of
queries, each under a checkpoint, only one block's matrices are live, forward or backward; a
causal block reads only the keys up to its last query, so the masked triangle is not computed
at all, which pays for the recompute (long_seq_train: 116.3 MiB at -14% FLOPs). Each row's
softmax is the one XLA computes, over the same keys (the keys cut are masked to exact zeros),
so the values are the same up to the order of a sum.

`attention_sites` finds the calls by the user's line (by hooking the XLA implementation that
`jax.nn.dot_product_attention` calls, whatever name the user imported it under);
`attention_chunked` returns the step with those calls in blocks of `chunk` queries;
`chunked_dot_product_attention` is the function to paste.
"""

from __future__ import annotations

import contextvars
import inspect
import linecache
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import SourceLine
from jaxmem.fitting import jax_hooks

MIN_QUERIES = 512   # shorter sequences: a block of a quarter would be under 128 queries


def chunked_dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                                  is_causal: bool = False, chunk: int = 512, **kwargs) -> jax.Array:
    """jax.nn.dot_product_attention over blocks of `chunk` queries, each under jax.checkpoint:
    one block's scores are live at a time, forward and backward; a causal block reads only the
    keys up to its last query. `query`, `key`, `value`: [batch, length, heads, head_dim]."""
    T, S = query.shape[1], key.shape[1]
    outs = []
    for start in range(0, T, chunk):
        stop = min(start + chunk, T)
        keys = min(stop, S) if is_causal else S
        mask = (jnp.arange(keys)[None, :] <= jnp.arange(start, stop)[:, None])[None, None] if is_causal else None

        def attention_block(q, k, v, mask=mask):
            return jax.nn.dot_product_attention(q, k, v, mask=mask, **kwargs)

        outs.append(jax.checkpoint(attention_block)(query[:, start:stop], key[:, :keys], value[:, :keys]))
    return jnp.concatenate(outs, axis=1)


@dataclass(frozen=True)
class AttentionSite:
    """One user line that calls dot_product_attention (XLA's implementation) on long sequences."""

    call: SourceLine
    queries: int            # the query length
    keys: int
    heads: int
    causal: bool
    calls: int              # how many calls the line made in one step (layers)

    @property
    def key(self) -> tuple[str, int]:
        return (self.call.file, self.call.line)

    def code(self, chunk: int) -> str:
        written = f"  (as written: {self.call.text})" if self.call.text else ""
        return (f"{self.call}: write chunked_dot_product_attention(..., chunk={chunk}) in place of "
                f"jax.nn.dot_product_attention(...), with the same arguments ({self.calls} call"
                f"{'s' if self.calls != 1 else ''}, {self.queries} queries{', causal' if self.causal else ''})"
                f"{written}")


_MODE: contextvars.ContextVar["tuple[str, Any] | None"] = contextvars.ContextVar("jaxmem_attention", default=None)


def _plain(bias: Any, mask: Any, q_seqlen: Any, kv_seqlen: Any, window: Any, residual: bool) -> bool:
    """A call the block form computes exactly: no bias, mask, lengths or window of its own."""
    return bias is None and mask is None and q_seqlen is None and kv_seqlen is None and window is None and not residual


def _hooked_xla(original: Callable[..., Any]) -> Callable[..., Any]:
    def hooked(query: Any, key: Any, value: Any, bias: Any, mask: Any, is_causal: bool, scale: float,
               q_seqlen: Any, kv_seqlen: Any, local_window_size: Any, return_residual: bool = False) -> Any:
        mode = _MODE.get()
        plain = _plain(bias, mask, q_seqlen, kv_seqlen, local_window_size, return_residual)
        if mode is not None and plain and query.shape[1] >= MIN_QUERIES:
            kind, state = mode
            if kind == "record":
                state.append((jax_hooks.innermost_line(), query.shape, key.shape, bool(is_causal)))
            elif jax_hooks.innermost_line() in state[0]:
                token = _MODE.set(None)   # the blocks call dot_product_attention: JAX's own
                try:
                    return chunked_dot_product_attention(query, key, value, is_causal=is_causal,
                                                         chunk=state[1], scale=scale, implementation="xla")
                finally:
                    _MODE.reset(token)
        return original(query, key, value, bias, mask, is_causal, scale, q_seqlen, kv_seqlen,
                        local_window_size, return_residual)

    hooked.__jaxmem_original__ = original  # type: ignore[attr-defined]
    return hooked


def _install() -> bool:
    """Hook, once per process, the XLA implementation `jax.nn.dot_product_attention` calls (a
    module global it looks up at each call): inside `attention_sites` a call is recorded, inside
    `attention_chunked` a call from one of its lines runs in blocks. Outside, JAX's own. False
    where this JAX has no such function (nothing is then rewritten)."""
    return jax_hooks.hook(jax_hooks.nn_functions(), "_dot_product_attention_xla", _hooked_xla)


def attention_sites(fn: Callable[..., Any], args: Sequence[Any]) -> list[AttentionSite]:
    """The user's lines whose `dot_product_attention` calls (XLA's implementation, no bias,
    mask, lengths or window of their own, at least MIN_QUERIES queries) `fn` makes."""
    if not _install():
        return []
    calls: list[tuple[Any, tuple[int, ...], tuple[int, ...], bool]] = []

    def traced(*a: Any) -> Any:   # a new function: JAX runs the Python again, not its cached trace
        return fn(*a)

    with jax_hooks.active(_MODE, ("record", calls)):
        ja.make_closed_jaxpr(traced, *args)
    sites: dict[tuple[str, int], AttentionSite] = {}
    for line, q, k, causal in calls:
        if line is None:
            continue
        known = sites.get(line)
        if known is None:
            sites[line] = AttentionSite(SourceLine(line[0], line[1], _function_at(line)), q[1], k[1], q[2],
                                        causal, 1)
        else:
            sites[line] = AttentionSite(known.call, known.queries, known.keys, known.heads, known.causal,
                                        known.calls + 1)
    return list(sites.values())


def _function_at(line: tuple[str, int]) -> str:
    """The name of the function whose code holds `line` (for the printed site), or "?"."""
    import ast

    try:
        tree = ast.parse("".join(linecache.getlines(line[0])))
    except (SyntaxError, ValueError):
        return "?"
    best = "?"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.lineno <= line[1] <= (node.end_lineno or node.lineno):
            best = node.name   # ast.walk is breadth-first: the innermost comes last
    return best


def attention_chunked(fn: Callable[..., Any], sites: Sequence[AttentionSite], chunk: int) -> Callable[..., Any]:
    """`fn` with the attention calls made on `sites`' lines in blocks of `chunk` queries (as if
    the user had written `chunked_dot_product_attention` there)."""
    _install()
    lines = frozenset(s.key for s in sites)
    return jax_hooks.while_set(fn, _MODE, lambda: ("chunk", (lines, chunk)))


def chunk_sizes(sites: Sequence[AttentionSite]) -> list[int]:
    """The block sizes to judge: a quarter and an eighth of the shortest query length, in powers
    of two, at least 128 (on long_seq_train a quarter, 512, gives 116.3 MiB, an eighth 122.7)."""
    shortest = min(s.queries for s in sites)
    sizes = []
    for parts in (4, 8):
        size = 1 << max(7, (shortest // parts).bit_length() - 1)
        if size < shortest and size not in sizes:
            sizes.append(size)
    return sizes


def attention_lines(sites: Sequence[AttentionSite], chunk: int) -> list[str]:
    """What to write in the user's code: one line per site, then the function once."""
    helper = inspect.getsource(chunked_dot_product_attention).rstrip().splitlines()
    return [s.code(chunk) for s in sites] + ["with chunked_dot_product_attention defined as (plain JAX, no jaxmem):",
                                             *helper]
