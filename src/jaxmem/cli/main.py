"""`jaxmem` command line: a thin dispatcher over one module per subcommand.

Each subcommand module under `jaxmem.cli` defines `main(argv: list[str]) -> int`; its module
docstring is its help. Errors a user can cause (`JaxmemError`) end in one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys

from jaxmem.errors import JaxmemError
from jaxmem.reports.escape import plain

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
    "optimize": "optimize",
    "record": "record",
    "explain": "explain",
    "compilers": "compilers",
}
# Commands that start JAX: it is started first with the CUDA plugin's start-up lines filtered
# (see jaxmem.xla.start), so that errors stay one line on stderr.
JAX_COMMANDS = {"analyze", "fit", "maxbatch", "optimize"}
# Commands whose --device judges candidates by XLA:GPU or XLA:TPU in this process (JAX_PLATFORMS=cpu).
DEVICELESS_COMMANDS = {"fit", "optimize"}


# Errors of writing our output (a closed pipe, a full disk): one line, not a traceback.
_OUTPUT_ERRORS = (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


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
        from jaxmem.xla.start import quiet_jax_start

        if name in DEVICELESS_COMMANDS and any(a == "--device" or a.startswith("--device=") for a in rest) \
                and "jax" not in sys.modules:
            # XLA:GPU and XLA:TPU judge deviceless: the CUDA plugin and libtpu give compile-only
            # devices when CPU is JAX's only platform, which must be set before JAX starts, as
            # must libtpu's settings for a machine without a TPU.
            # They compile in this process, so it reads jaxmem's folder of compilers.
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            from jaxmem.xla import compilers
            from jaxmem.xla.tpu.compile import DEVICELESS_ENV

            compilers.activate()

            for key, value in DEVICELESS_ENV.items():
                os.environ.setdefault(key, value)
        # analyze: a factory may lay out its arguments on a mesh of this host's devices (one
        # 8-GPU node's worth), so the CPU backend starts with 8 unless the user chose a number.
        quiet_jax_start(host_devices=8 if name == "analyze" else None)
    try:
        module = importlib.import_module(f"jaxmem.cli.{SUBCOMMANDS[name]}")
    except ImportError as err:
        print(f"jaxmem {name}: not available ({err})", file=sys.stderr)
        return 2
    try:
        code = int(module.main(rest) or 0)
        sys.stdout.flush()  # here, so a full disk or closed pipe is reported, not lost at exit
        return code
    except JaxmemError as err:
        # One line whatever the message quotes: a path or label with a newline or an escape
        # sequence in it is shown, not obeyed.
        print(f"jaxmem {name}: error: {plain(err)}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in _OUTPUT_ERRORS:
            raise
        _drop_stdout()
        print(f"jaxmem {name}: error: cannot write the output: {plain(err.strerror)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxmem {name}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    sys.exit(main())
