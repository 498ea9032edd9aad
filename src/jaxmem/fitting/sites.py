"""Checkpoint sites: the places in a user's code where `jax.checkpoint` can go, found and
wrapped while the user's function is traced (a `lax.scan` body, the function handed to
`jax.grad`), and the standard policies fit names. Public JAX API only: the sites are met by
swapping `jax.lax.scan` and `jax.grad`-like attributes for the length of one trace.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import jax

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import SourceLine
from jaxmem.errors import PlanError


@dataclass(frozen=True)
class CheckpointSite:
    """A place in the user's code where `jax.checkpoint` can go: the body handed to `lax.scan`
    (`kind="scan"`) or the function differentiated by `jax.grad` / `jax.value_and_grad` /
    `jax.vjp` (`kind="grad"`). `call` is the user's line that makes the call; `function` names
    the wrapped function and where it is defined."""

    kind: str
    call: SourceLine
    function: str
    defined: str                   # "file:line" of the wrapped function's def (or lambda)

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.call.file}:{self.call.line}"

    def __str__(self) -> str:
        return f"{self.call.file}:{self.call.line} ({self.call.function})"


def _calling_site(kind: str, fun: Callable[..., Any]) -> CheckpointSite:
    frame = sys._getframe(2)
    while frame is not None and ja.is_internal_frame(frame.f_code.co_filename):
        frame = frame.f_back
    call = (SourceLine(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
            if frame is not None else SourceLine("<unknown>", 0, "<unknown>"))
    code = getattr(getattr(fun, "__wrapped__", fun), "__code__", None)
    name = getattr(fun, "__name__", type(fun).__name__)
    defined = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "?"
    return CheckpointSite(kind, call, name, defined)


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
    if name.startswith("save_only_these_names:"):
        return policies.save_only_these_names(*name.split(":", 1)[1].split(","))
    if name.startswith("offload_dot_with_no_batch_dims"):
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    if not hasattr(policies, name):
        raise PlanError(f"jax.checkpoint_policies has no policy {name!r}")
    return getattr(policies, name)


class checkpoint_sites:
    """A context in which `jax.lax.scan` bodies and the functions given to `jax.grad`,
    `jax.value_and_grad` and `jax.vjp` are passed through `wrap(site, fun) -> fun`, while a
    user's function is traced. `found` lists every site met, in order.

    >>> with checkpoint_sites(lambda site, f: f) as ctx:        # doctest: +SKIP
    ...     jax.make_jaxpr(step)(params, batch)
    >>> [str(s) for s in ctx.found]                                # doctest: +SKIP

    Only calls through the public attributes are seen (`jax.lax.scan(...)`, `lax.scan(...)`);
    a name imported before the context (`from jax.lax import scan`), `fori_loop` and
    `while_loop` (no reverse-mode derivative, so no checkpoint to place) are not.
    """

    _GRADS = ("grad", "value_and_grad", "vjp")

    def __init__(self, wrap: Callable[[CheckpointSite, Callable[..., Any]], Callable[..., Any]]):
        self.wrap = wrap
        self.found: list[CheckpointSite] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _note(self, site: CheckpointSite) -> None:
        if all(s.key != site.key for s in self.found):
            self.found.append(site)

    def __enter__(self) -> "checkpoint_sites":
        scan = jax.lax.scan

        def patched_scan(f: Callable[..., Any], *a: Any, **k: Any) -> Any:
            site = _calling_site("scan", f)
            self._note(site)
            return scan(self.wrap(site, f), *a, **k)

        self._saved.append((jax.lax, "scan", scan))
        jax.lax.scan = patched_scan
        for name in self._GRADS:
            original = getattr(jax, name)

            def patched(fun: Callable[..., Any], *a: Any, _original: Any = original, _name: str = name,
                        **k: Any) -> Any:
                site = _calling_site("grad", fun)
                self._note(site)
                return _original(self.wrap(site, fun), *a, **k)

            self._saved.append((jax, name, original))
            setattr(jax, name, patched)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
