"""`jaxmem` command line: a thin dispatcher over one module per subcommand.

Each subcommand module under `jaxmem.cli` defines `main(argv: list[str]) -> int`; its module
docstring is its help. Errors a user can cause (`JaxmemError`) end in one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib
import sys

from jaxmem.errors import JaxmemError

# subcommand -> module under jaxmem.cli. Imported lazily so `jaxmem share status` does not
# pay for importing JAX.
SUBCOMMANDS: dict[str, str] = {
    "demo": "demo",
    "analyze": "analyze",
    "fit": "fit",
    "replay": "replay",
    "run": "run",
    "share": "share",
    "maxbatch": "maxbatch",
}
# Commands that start JAX: it is started first with the CUDA plugin's start-up lines filtered
# (see jaxmem.compiler.jax_start), so that errors stay one line on stderr.
JAX_COMMANDS = {"analyze", "fit", "maxbatch"}


def _usage() -> str:
    lines = ["usage: jaxmem <command> [options]", "", "commands:"]
    for name, module in SUBCOMMANDS.items():
        try:
            doc = (importlib.import_module(f"jaxmem.cli.{module}").__doc__ or "").strip().splitlines()
        except ImportError:
            continue
        lines.append(f"  {name:<9} {doc[0] if doc else ''}")
    lines.append("")
    lines.append("`jaxmem <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"jaxmem: unknown command {name!r}; one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    if name in JAX_COMMANDS and not any(a in ("-h", "--help") for a in rest):
        from jaxmem.compiler.jax_start import quiet_jax_start

        quiet_jax_start()
    try:
        module = importlib.import_module(f"jaxmem.cli.{SUBCOMMANDS[name]}")
    except ImportError as err:
        print(f"jaxmem {name}: not available ({err})", file=sys.stderr)
        return 2
    try:
        return int(module.main(rest) or 0)
    except JaxmemError as err:
        print(f"jaxmem {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxmem {name}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    sys.exit(main())
