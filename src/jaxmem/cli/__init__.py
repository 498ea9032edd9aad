"""One module per subcommand; this package holds only what they all share."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

# Piped output (`jaxmem analyze T > report.txt`, CI logs) has no terminal width: rich's 80
# columns cut table cells to "bfc-g…" and wrap figures; this width keeps every table whole.
PIPED_WIDTH = 160


def report_console(**kwargs: Any) -> Any:
    """The rich Console a subcommand prints its report on: the terminal's width, or
    `PIPED_WIDTH` columns when stdout is not a terminal."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH, **kwargs)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit code 2), like every
    other error a user can cause; the full usage stays behind `--help`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")
