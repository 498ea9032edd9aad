"""Find the largest batch (or any integer argument) that fits a GPU or TPU: `jaxmem maxbatch TARGET --arg NAME`.

TARGET's factory takes the keyword argument NAME (`batch_size`, a sequence length, ...) and
returns `(fn, args)`. The answer is judged by XLA, compiled deviceless for the device (XLA:GPU
for a GPU preset, XLA:TPU for a TPU preset), and the runtime over N training steps as `jaxmem
analyze` runs it (the GPU client's pool; the TPU runtime's rules): `value` fits and `value + 1`
does not. On a GPU, jaxmem's model of XLA:GPU (`xla.gpu.model.predict.predict`: no compile) finds the
largest value whose predicted total fits, the first guess; XLA's compiles confirm it (and its
neighbour). Elsewhere jaxmem's planner at two small values makes the guess.

    jaxmem maxbatch jaxmem.examples.gpt:batch_example --arg batch_size --device h100-80gb
    jaxmem maxbatch jaxmem.examples.gpt:batch_example --arg batch_size --device tpu-v5e-16gb
    jaxmem maxbatch my_model.py:make_step --arg seq_len --device a100-40gb --donate 0,1 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxmem.cli import OneLineParser, report_console
from jaxmem.cli.analyze import add_pool_arguments, parse_donate
from jaxmem.errors import PlanError
from jaxmem.reports.escape import markup


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="jaxmem maxbatch", description=(__doc__ or "").strip().splitlines()[0],
                           epilog="TARGET: 'path/to/file.py:factory' or 'package.module:factory'; "
                                  "factory(NAME=value) returns (fn, args).")
    parser.add_argument("target", metavar="TARGET")
    parser.add_argument("--arg", required=True, metavar="NAME", help="the factory's integer keyword argument to maximize")
    parser.add_argument("--device", default="h100-80gb", metavar="PRESET",
                        help="a GPU or TPU preset (default h100-80gb; tpu-v5e-16gb: judged by XLA:TPU)")
    parser.add_argument("--donate", default="", metavar="0,1",
                        help="positional arguments of fn to donate (default: those its own jax.jit donates)")
    parser.add_argument("--min", type=int, default=1, dest="minimum", help="the smallest value searched (default 1)")
    parser.add_argument("--max", type=int, default=1 << 24, dest="maximum", help="the largest value searched (default 2^24)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_pool_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    """`jaxmem maxbatch`: see the module docstring. Returns the exit code."""
    from jaxmem.api.maxbatch import search_largest
    from jaxmem.compiler.target import resolve_factory
    from jaxmem.reports.terminal import busy

    args = build_parser().parse_args(argv)
    if not args.arg.isidentifier():
        raise PlanError(f"--arg takes a keyword argument name, got {args.arg!r}")
    if args.steps < 1:
        raise PlanError(f"--steps must be 1 or more, got {args.steps}")
    factory = resolve_factory(args.target)   # a bad TARGET fails here, in one line
    donate = parse_donate(args.donate, 1 << 16) or None
    result = search_largest(factory, args.arg, args, args.minimum, args.maximum, donate, busy)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    console = report_console()
    head, how, *_ = result.lines()
    console.print(f"[bold{'' if result.at_maximum else ' green'}]{markup(head)}[/]")
    console.print(markup(how), style="dim")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
