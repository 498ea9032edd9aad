"""Explain a pasted out-of-memory error or a whole log: what ran out, why, and what to change.

    jaxmem explain train.log
    python train.py 2>&1 | jaxmem explain -
    jaxmem explain error.txt --json
    jaxmem explain error.txt --html oom.html

Reads the TPU runtime's E0100 (a buffer) and E0101 (a program's reservation), XLA:TPU's compile
report ("Ran out of memory in memory space hbm", "HLO temporaries ... exceeds available HBM"),
XLA:GPU's "Out of memory while trying to allocate" with its peak buffers, and the BFC allocator's
log (bins, `Stats:`). It says which it is: exhaustion (arrays held fill the device), fragmentation
(enough free, not in one piece), a reservation that cannot be placed at the bottom of memory, or
a program too large to compile; the largest allocations the text names, with their source lines;
and the commands to run next. A log of any size is read a chunk at a time; of several errors in
it the most specific is explained. Does not start JAX.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxmem.cli import OneLineParser
from jaxmem.errors import OomTextError, ReportError


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").strip()
    p = OneLineParser(prog="jaxmem explain", description=doc.splitlines()[0],
                      epilog="\n".join(doc.splitlines()[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", nargs="?", default="-",
                   help="the error text or log; '-' (the default) reads stdin")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.add_argument("--html", metavar="OUT.html", default=None, help="also write a self-contained HTML page")
    return p


def read_errors(name: str) -> list:
    """Every out-of-memory error in FILE (or stdin for '-'), read a chunk at a time."""
    from jaxmem.recording.oom_text import parse_stream

    if name == "-":
        return parse_stream(sys.stdin.buffer)
    path = Path(name)
    try:
        with path.open("rb") as stream:
            return parse_stream(stream)
    except FileNotFoundError:
        raise OomTextError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise OomTextError(f"{name}: is a directory, not a text file") from None
    except OSError as err:
        raise OomTextError(f"{name}: cannot read it: {err.strerror}") from None


def write_html(out: str, page: str) -> None:
    """Write the HTML page; an unwritable path is one line, not a traceback."""
    try:
        Path(out).write_text(page, encoding="utf-8")
    except OSError as err:
        raise ReportError(f"--html {out}: cannot write it: {err.strerror}") from None


def main(argv: list[str]) -> int:
    from jaxmem.recording.explain import explain_found

    args = _parser().parse_args(argv)
    if args.html is not None and not args.html.endswith((".html", ".htm")):
        raise ReportError(f"--html {args.html}: name an .html file")
    explanation = explain_found(read_errors(args.file))
    if args.json:
        print(json.dumps(explanation.to_dict(), indent=1))
    else:
        print(explanation)
    if args.html is not None:
        write_html(args.html, explanation.html())
    return 0
