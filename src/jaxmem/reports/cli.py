"""Report flags shared by `jaxmem analyze` and `jaxmem replay` (--html, --pprof, --png, --chrome-trace).

The subcommands call `add_arguments(parser)` when they build their parser, and after their own
output `write_plan_reports(args, plan)` or `write_replay_reports(args, replay_result)`.
"""

from __future__ import annotations

import argparse
from typing import Any

from jaxmem.errors import PlanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reports")
    group.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    group.add_argument("--pprof", metavar="PATH", help="write a gzipped pprof profile of the buffers live at the peak")
    group.add_argument("--png", metavar="PATH", help="write the memory timeline as a PNG")
    group.add_argument("--chrome-trace", metavar="PATH", help="write memory counters in the Chrome trace event format")
    group.add_argument("--step", type=int, default=None, help="with --pprof: the step to profile (default: the peak)")


def _requested(args: argparse.Namespace) -> list[str]:
    return [flag for flag in ("html", "pprof", "png", "chrome_trace") if getattr(args, flag, None)]


def write_plan_reports(args: argparse.Namespace, plan: Any) -> None:
    if _requested(args):
        raise PlanError("report writers are not available in this build")


def write_replay_reports(args: argparse.Namespace, replay_result: Any) -> None:
    if _requested(args):
        raise PlanError("report writers are not available in this build")
