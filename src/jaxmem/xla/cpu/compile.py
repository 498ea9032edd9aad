"""XLA's own memory figures for a function: `compiled.memory_analysis()`, in this process or in a
fresh one with a chosen XLA:CPU scheduler.

XLA reads `XLA_FLAGS` once per process, so comparing its schedulers means one subprocess each:
`--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED` ("dfs", a memory-minimizing
depth-first order) and `CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED` ("bfs"). On jax/jaxlib 0.10.2
the flag exists with these values; `CPU_SCHEDULER_TYPE_DEFAULT` gives the same figures as "bfs"
on the suite, and an unknown value aborts XLA, so the values are checked here first. `YNN_OFF`
are the extra flags that make XLA count what its YNNPACK fusions hide (see there).

Run as a module, it prints one JSON object (the subprocess side):

    python -m jaxmem.xla.cpu jaxmem.examples.suite:mlp_train --donate 0,1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any, Callable, Sequence

from jaxmem.compiler.plan_types import XlaReference
from jaxmem.errors import PlanError

SCHEDULER_FLAGS: dict[str, str] = {
    "dfs": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    "bfs": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED",
}
_FLAG = "--xla_cpu_scheduler_type"

# XLA:CPU (jaxlib 0.10.2) hands some dot/convolution subgraphs to YNNPACK as one custom fusion
# ("__ynn_fusion"); the intermediates inside it are YNNPACK's own allocations and are missing
# from memory_analysis()'s temp bytes (a whole CNN forward reports 8 KiB of temp). These flags
# turn those fusions off, so that every intermediate goes through XLA's buffer assignment.
YNN_OFF: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=-dot,-eltwise,-reduce",)


def _scheduler_in_env() -> str:
    """"dfs"/"bfs" when this process's XLA_FLAGS choose one, else "default"."""
    for token in os.environ.get("XLA_FLAGS", "").split():
        if token.startswith(_FLAG + "="):
            value = token.split("=", 1)[1]
            for name, flag in SCHEDULER_FLAGS.items():
                if value == flag:
                    return name
            return value
    return "default"


def xla_reference(fn: Callable[..., Any], args: Sequence[Any], *, donate_argnums: Sequence[int] = (),
                  kwargs: dict[str, Any] | None = None) -> XlaReference:
    """Compile `fn` with `jax.jit` for `args` and read XLA's memory analysis.

    >>> import jax.numpy as jnp
    >>> ref = xla_reference(lambda x: x * 2, (jnp.ones(256),))
    >>> ref.argument_bytes, ref.output_bytes
    (1024, 1024)

    Args:
        fn: the function, as given to `jax.jit`.
        args: its positional arguments (arrays or pytrees of arrays).
        donate_argnums: positional arguments to donate, as `jax.jit`'s.
        kwargs: keyword arguments, traced like positional ones.

    Returns:
        An `XlaReference` (argument, output, temp, alias and generated-code bytes; `total_bytes`
        is argument + output + temp - alias), `scheduler` naming this process's XLA:CPU scheduler.

    Raises:
        PlanError: JAX cannot trace or compile `fn`, or the backend gives no memory analysis.
    """
    import jax

    try:
        lowered = jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*args, **(kwargs or {}))
    except Exception as err:  # JAX's own errors are many types; the user needs one line
        raise PlanError(f"XLA could not compile the function: {type(err).__name__}: {' '.join(str(err).split())[:300]}") from None
    return reference_from_lowered(lowered)


def reference_from_lowered(lowered: Any) -> XlaReference:
    """XLA:CPU's memory analysis of a program JAX lowered for this process's CPU (`xla_reference`
    of a `jax.stages.Lowered`)."""
    import jax

    try:
        compiled = lowered.compile()
        stats = compiled.memory_analysis()
    except Exception as err:  # JAX's own errors are many types; the user needs one line
        raise PlanError(f"XLA could not compile the function: {type(err).__name__}: {' '.join(str(err).split())[:300]}") from None
    if stats is None:
        raise PlanError(f"the {jax.default_backend()} backend gives no memory analysis")
    fusions, hidden = _library_fusions(compiled)
    return XlaReference(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        scheduler=_scheduler_in_env(),
        library_fusions=fusions,
        library_hidden_bytes=hidden,
    )


_COMPUTATION_RE = re.compile(r"^%(\S+) \(.*\) -> .* \{$")
_LIBRARY_CALL_RE = re.compile(r"kind=kCustom, calls=%(\S+?),.*\"__ynn_fusion\"")
_HEAVY_RE = re.compile(r"^\s*%\S+ = (\w+)\[([0-9,]*)\]\S* (?:dot|convolution)\(")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def library_fusions(hlo_text: str) -> tuple[int, int]:
    r"""(fusions handed to YNNPACK, bytes of the dot/convolution results inside them that are not
    the fusion's root) from compiled HLO text.

    >>> text = "%f (p: f32[2,2]) -> f32[] {\n  %d = f32[2,2]{1,0} dot(%p, %p)\n  ROOT %r = f32[] reduce(%d)\n}\n" \
    ...        "ENTRY %m () -> f32[] {\n  ROOT %y = f32[] fusion(%a), kind=kCustom, calls=%f, backend_config=" \
    ...        "{\"fusion_config\":{\"kind\":\"__ynn_fusion\"}}\n}"
    >>> library_fusions(text)
    (1, 16)
    """
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION_RE.match(line) or (re.match(r"^ENTRY %(\S+) ", line) if line.startswith("ENTRY") else None)
        if head:
            current = bodies.setdefault(head.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    called = [m.group(1) for lines in bodies.values() for line in lines if (m := _LIBRARY_CALL_RE.search(line))]
    hidden = 0
    for name in called:
        for line in bodies.get(name, []):
            m = _HEAVY_RE.match(line)
            if m and m.group(1) in _DTYPE_BYTES:
                count = 1
                for dim in filter(None, m.group(2).split(",")):
                    count *= int(dim)
                hidden += count * _DTYPE_BYTES[m.group(1)]
    return len(called), hidden


def _library_fusions(compiled: Any) -> tuple[int, int]:
    try:
        text = compiled.as_text()
    except Exception:  # as_text is best effort across backends; no text means none seen
        return 0, 0
    return library_fusions(text)


def scheduler_env(scheduler: str | None, base: dict[str, str] | None = None,
                  extra_flags: Sequence[str] = ()) -> dict[str, str]:
    """The environment for a child process that compiles on CPU with `scheduler` ("dfs", "bfs" or
    None for XLA's default): any scheduler flag already in XLA_FLAGS is replaced, and
    `extra_flags` (such as `YNN_OFF`) are appended.

    >>> scheduler_env("dfs", {"XLA_FLAGS": "--xla_cpu_scheduler_type=X --xla_foo=1"})["XLA_FLAGS"]
    '--xla_foo=1 --xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED'
    """
    if scheduler is not None and scheduler not in SCHEDULER_FLAGS:
        raise PlanError(f"scheduler must be one of {', '.join(SCHEDULER_FLAGS)} or None, got {scheduler!r}")
    env = dict(os.environ if base is None else base)
    flags = [t for t in env.get("XLA_FLAGS", "").split() if not t.startswith(_FLAG + "=")]
    if scheduler is not None:
        flags.append(f"{_FLAG}={SCHEDULER_FLAGS[scheduler]}")
        env["JAX_PLATFORMS"] = "cpu"   # the flag is XLA:CPU's
    flags += list(extra_flags)
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def xla_reference_in_subprocess(target: str, *, donate_argnums: Sequence[int] = (), scheduler: str | None = None,
                                extra_flags: Sequence[str] = (), timeout: float = 900.0) -> XlaReference:
    """XLA's memory analysis of a TARGET, compiled in a fresh Python with the chosen XLA:CPU scheduler.

    >>> ref = xla_reference_in_subprocess("jaxmem.examples.suite:while_cond", scheduler="dfs")
    >>> ref.scheduler
    'dfs'

    Args:
        target: `"package.module:factory"` or `"path/to/file.py:factory"` (see `load_target`).
        donate_argnums: positional arguments to donate.
        scheduler: "dfs" (CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED), "bfs"
            (CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED) or None (XLA's default).
        extra_flags: more XLA flags for the child, e.g. `YNN_OFF`.
        timeout: seconds before the child is killed.

    Returns:
        The child's `XlaReference`.

    Raises:
        PlanError: the child failed (its last line of stderr is the message) or timed out.
    """
    env = scheduler_env(scheduler, extra_flags=extra_flags)
    cmd = [sys.executable, "-m", "jaxmem.xla.cpu", target]
    if donate_argnums:
        cmd += ["--donate", ",".join(str(int(i)) for i in donate_argnums)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PlanError(f"XLA reference for {target!r} took more than {timeout:.0f} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [line for line in proc.stderr.splitlines() if line.strip()]
        raise PlanError(f"XLA reference for {target!r} failed: {tail[-1].strip() if tail else f'exit {proc.returncode}'}")
    data = json.loads(lines[-1])
    return XlaReference(**data)


def _parse_donate(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise PlanError(f"--donate takes argument positions like 0,1, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    """The subprocess side: print TARGET's `XlaReference` as one JSON object."""
    from jaxmem.compiler.target import _one_line, load_target
    from jaxmem.errors import JaxmemError

    parser = argparse.ArgumentParser(prog="python -m jaxmem.xla.cpu")
    parser.add_argument("target")
    parser.add_argument("--donate", default="")
    args = parser.parse_args(argv)
    try:
        fn, fn_args = load_target(args.target)
        ref = xla_reference(fn, fn_args, donate_argnums=_parse_donate(args.donate))
    except JaxmemError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # the TARGET's code (SystemExit too: its code is not ours), one line
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    print(json.dumps({
        "argument_bytes": ref.argument_bytes, "output_bytes": ref.output_bytes, "temp_bytes": ref.temp_bytes,
        "alias_bytes": ref.alias_bytes, "generated_code_bytes": ref.generated_code_bytes,
        "scheduler": ref.scheduler, "library_fusions": ref.library_fusions,
        "library_hidden_bytes": ref.library_hidden_bytes,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
