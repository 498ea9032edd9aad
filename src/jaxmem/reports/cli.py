"""Report flags shared by `jaxmem analyze` and `jaxmem replay` (--html, --pprof, --png, --chrome-trace).

The subcommands call `add_arguments(parser)` when they build their parser, `check_paths(args)`
once the flags are parsed (a path whose extension is not its report's is refused before any
work), and after their own output `write_plan_reports(args, plan)` or
`write_replay_reports(args, replay_result, trace=trace)`.
Each writer reads one `ReportData` (jaxmem.reports.data); a line per file written goes to
stderr, so `--json` output on stdout stays one object.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from jaxmem.errors import ReportError
from jaxmem.reports.data import ReportData, from_plan, from_replay
from jaxmem.reports.terminal import busy
from jaxmem.units import format_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reports")
    group.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    group.add_argument("--pprof", metavar="PATH", help="write a gzipped pprof profile of the buffers live at the peak")
    group.add_argument("--png", metavar="PATH", help="write the memory timeline as a PNG")
    group.add_argument("--chrome-trace", metavar="PATH", help="write memory counters in the Chrome trace event format")
    group.add_argument("--step", type=int, default=None, help="with --pprof: the step (analyze) or event index (replay) to profile (default: the peak)")


def _requested(args: argparse.Namespace) -> list[str]:
    return [flag for flag in ("html", "pprof", "png", "chrome_trace") if getattr(args, flag, None)]


# Each report flag's format and the file name endings it is written under. A name with no
# extension at all (/dev/stdout, a pipe) is written as given; any other ending is refused, so
# that `--png t.xyz` or `--html r.png` is a one-line error, not a file of the wrong kind. The
# pprof profile is gzipped, as pprof keeps it on disk; a Chrome trace named .json.gz is gzipped.
FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "html": ("an HTML report", (".html", ".htm")),
    "pprof": ("a gzipped pprof profile", (".pb.gz", ".pprof")),
    "png": ("a PNG timeline", (".png",)),
    "chrome_trace": ("a Chrome trace", (".json", ".json.gz")),
}


def check_paths(args: argparse.Namespace) -> None:
    """Refuse a report path whose extension is not its format's, before any work is done.

    >>> check_paths(argparse.Namespace(png="t.xyz", html="r.HTML", pprof=None, chrome_trace=None))
    Traceback (most recent call last):
    jaxmem.errors.ReportError: --png 't.xyz' would write a PNG timeline to a .xyz file; name it .png

    Raises:
        ReportError: (one line) a path ends in an extension that is not one of its flag's.
    """
    for flag in _requested(args):
        path = str(getattr(args, flag))
        name = os.path.basename(path).lower()
        if "." not in name.lstrip("."):
            continue
        what, endings = FORMATS[flag]
        if not name.endswith(endings):
            given = os.path.splitext(name)[1]
            raise ReportError(f"--{flag.replace('_', '-')} {path!r} would write {what} to a {given} file; "
                              f"name it {' or '.join(endings)}")


def _write(what: str, path: str, writer: Callable[[], Any]) -> None:
    try:
        writer()
    except OSError as err:
        raise ReportError(f"cannot write {what} to {path}: {err.strerror or err}") from None
    try:
        size = format_size(os.path.getsize(path))
    except OSError:
        size = "?"
    print(f"wrote {what}: {path} ({size})", file=sys.stderr)


def write_reports(args: argparse.Namespace, data: ReportData) -> None:
    """Write every report the flags ask for from one `ReportData`.

    >>> import tempfile, jax.numpy as jnp, jaxmem
    >>> data = from_plan(jaxmem.plan(lambda x: jnp.sin(x) * 2, jnp.ones(4)))
    >>> path = os.path.join(tempfile.mkdtemp(), "r.html")
    >>> write_reports(argparse.Namespace(html=path, pprof=None, png=None, chrome_trace=None, step=None), data)
    >>> os.path.getsize(path) > 0   # "wrote HTML report: ..." went to stderr
    True
    """
    check_paths(args)
    step = getattr(args, "step", None)
    if step is not None and not data.x_min <= step <= data.x_max:
        raise ReportError(f"--step {step} is outside the {data.x_label}s {data.x_min}..{data.x_max}")
    if getattr(args, "html", None):
        from jaxmem.reports.html import write_html

        _write("HTML report", args.html, lambda: write_html(args.html, data))
    if getattr(args, "pprof", None):
        from jaxmem.reports.pprof import write_pprof

        x = data.peak_x if step is None else step
        if not data.blocks:
            raise ReportError("--pprof needs the blocks of the program or trace; none are known here")
        _write(f"pprof profile at {data.x_label} {x}", args.pprof, lambda: write_pprof(args.pprof, data.live_at(x)))
    if getattr(args, "png", None):
        from jaxmem.reports.png import write_png

        _write("PNG timeline", args.png, lambda: write_png(args.png, data))
    if getattr(args, "chrome_trace", None):
        from jaxmem.reports.chrome_trace import write_chrome_trace

        _write("Chrome trace", args.chrome_trace, lambda: write_chrome_trace(args.chrome_trace, data))


def write_plan_reports(args: argparse.Namespace, plan: Any, gpu: dict[str, Any] | None = None) -> None:
    """The reports of a memory plan (from `jaxmem analyze`); `gpu`, analyze's JSON data, adds
    XLA:GPU's figures, the pool verdict and the buffers XLA:GPU holds at its peak."""
    if not _requested(args):
        return
    title = getattr(args, "target", None) or "built-in example"
    with busy("writing reports"):  # a spinner on stderr if this takes over a second
        data = from_plan(plan, title=str(title))
        if gpu is not None:
            add_gpu(data, gpu)
        write_reports(args, data)


def add_gpu(data: ReportData, analysis: dict[str, Any]) -> None:
    """Add XLA:GPU's (or XLA:TPU's) totals and the pool verdict to the summary, and the buffers
    XLA holds at its peak as a table, from `jaxmem analyze`'s JSON data."""
    platform = "tpu" if analysis.get("xla_tpu") else "gpu"
    name = f"XLA:{platform.upper()}"
    ref, pool = analysis.get(f"xla_{platform}"), analysis.get("pool")
    if ref:
        data.summary.append((f"{name} total ({ref['target']})", f"{format_size(ref['total_bytes'])}: arguments "
                             f"{format_size(ref['argument_bytes'])}, outputs {format_size(ref['output_bytes'])}, temp "
                             f"{format_size(ref['temp_bytes'])}, aliased {format_size(ref['alias_bytes'])}"))
    withheld = analysis.get("plan_withheld")
    if withheld:   # the files draw jaxmem's plan, which the tables leave out: say how far it is
        data.summary.append(("jaxmem's plan against XLA's", f"{withheld['ratio_to_xla']:.2f}x {name}'s total: this "
                             f"timeline is jaxmem's unfused plan, not what the device holds"))
    if pool:
        verdict = "fits" if pool["fits"] else f"does not fit (step {pool['failed_step']})"
        data.summary.append((f"{'chip' if pool.get('rules') == 'tpu_runtime' else 'pool'} over {pool['steps']} steps",
                             f"{verdict}: peak {format_size(pool['peak_bytes'])} of limit "
                             f"{format_size(pool['limit_bytes'])}"))
    rows = analysis.get(f"xla_{platform}_peak_buffers") or []
    if rows:
        cells = [[str(i), format_size(r["size_bytes"]), f"{r['dtype']}[{','.join(map(str, r['shape']))}]", r["kind"],
                  r["jaxpr_array"] or "—", r["op_name"] or r["hlo"], r["source"] or "—"] for i, r in enumerate(rows, 1)]
        data.tables.append((f"What {name} holds at its peak ({ref['target'] if ref else ''})",
                            ["#", "size", "array", "kind", "jaxpr array", "XLA op", "source"], cells))


def write_replay_reports(args: argparse.Namespace, replay_result: Any, trace: Any = None) -> None:
    """The reports of a replay (from `jaxmem replay`); pass the trace for the placement map,
    the recorded live blocks and --pprof."""
    if not _requested(args):
        return
    trace = trace if trace is not None else getattr(replay_result, "trace", None)
    with busy("writing reports"):
        write_reports(args, from_replay(replay_result, trace))
