"""Reserve a share of a GPU, then run a command that JAX keeps within it.

    jaxmem run --memory 30% --device 0 --wait 60 --label train -- python train.py --steps 1000

Takes a reservation in the node's ledger (waiting up to --wait seconds, first come first served;
without --wait it fails at once and says who holds what), then runs CMD with:

  XLA_CLIENT_MEM_FRACTION   = reserved bytes / device memory total, rounded down to 6 decimals.
                              JAX multiplies this fraction by the total CUDA reports for the GPU
                              (not by the free memory), and that total is at most nvidia-smi's
                              memory.total (our denominator), so JAX's pool never exceeds the
                              reservation. Where the jaxlib beside jaxmem predates that name,
                              XLA_PYTHON_CLIENT_MEM_FRACTION is set instead. Never both: JAX
                              rejects the pair (and then falls back to the CPU). Any spelling
                              already in the environment is replaced.
  CUDA_VISIBLE_DEVICES      = the device, with CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers
                              GPUs as nvidia-smi does.
  XLA_PYTHON_CLIENT_PREALLOCATE is left as it is: preallocation stays on (JAX takes its whole
                              share at start, so no fragmentation cost) unless you set it false.
  JAXMEM_RESERVATION        = "<device>:<id>" of the reservation, and JAXMEM_LEDGER its state
                              directory (with the fraction, what lets `jaxmem share repair
                              --reset` find a live command when no ledger record is left).

The command is a holder of the reservation as much as this wrapper: if the wrapper is killed
(even with SIGKILL) while the command runs, the memory stays reserved until the command exits.
Processes the command started are holders too: when the command exits and leaves some running
(`server &`, a daemon that detached with setsid), each becomes a holder and the reservation
lasts until the last of them exits, while the wrapper returns the command's exit code. On Linux
the wrapper is a child subreaper (prctl), so it finds them however they detached; a process
one of them starts later is covered while its parent lives.
SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to the wrapper are passed to the
command (a Ctrl-C typed at the terminal already reaches both, and is not sent twice). The
reservation is released when the command ends, however it ends, and its exit code is returned
(128 + N when signal N killed it).

The reservation covers JAX's memory pool only: each CUDA process also uses some memory for its
context and libraries (typically a few hundred MiB) outside the pool.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import importlib.util
import os
import signal
import sys
from pathlib import Path

from jaxmem.cli import OneLineParser
from jaxmem.errors import ConfigError, JaxmemError
from jaxmem.share import procinfo
from jaxmem.share.ledger import Reservation, fraction_text, reserve
from jaxmem.units import format_size

NEW_VAR, OLD_VAR = "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_CHILD_SUBREAPER = 36
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent (a terminal's Ctrl-C), as opposed to kill()
_GO = b"g"


class _Signalled(BaseException):
    """A termination signal arrived while the reservation was being taken."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="jaxmem run", description=__doc__.strip().splitlines()[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="\n".join(__doc__.strip().splitlines()[2:]))
    parser.add_argument("--memory", required=True, help="how much: bytes, '12GiB' or a share of the device, '30%%'")
    parser.add_argument("--device", type=int, default=0, help="GPU index as nvidia-smi numbers them (default 0)")
    parser.add_argument("--capacity", help="device memory total where nvidia-smi is missing: '80GiB' or a preset like h100-80gb")
    parser.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                        help="wait up to this long for the memory (default: fail at once)")
    parser.add_argument("--label", help="name shown to others in `jaxmem share status` (default: the command)")
    parser.add_argument("--fraction-var", choices=("auto", NEW_VAR, OLD_VAR), default="auto",
                        help="which variable carries the fraction (default: the one the installed jaxlib reads)")
    parser.add_argument("-q", "--quiet", action="store_true", help="do not print what was reserved")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    return parser


def fraction_variable(choice: str = "auto") -> str:
    """The environment variable JAX reads its memory fraction from.

    "auto" looks at the jaxlib installed beside jaxmem without importing it: one that knows
    XLA_CLIENT_MEM_FRACTION (jaxlib from late 2024 on) gets that name; an older one gets
    XLA_PYTHON_CLIENT_MEM_FRACTION; with no jaxlib here, the current name.
    """
    if choice != "auto":
        return choice
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return NEW_VAR
    for location in spec.submodule_search_locations:
        source = Path(location) / "xla_client.py"
        try:
            if NEW_VAR in source.read_text(errors="replace"):
                return NEW_VAR
        except OSError:
            continue
    return OLD_VAR


def child_environment(base: dict[str, str], reservation: Reservation, variable: str) -> tuple[dict[str, str], list[str]]:
    """The command's environment, and notes for the user about settings we replaced or saw.

    Args:
        base: the environment to start from (normally os.environ).
        reservation: what was reserved.
        variable: the fraction variable to set (the other spelling is removed).

    Returns:
        (environment, notes).
    """
    env = dict(base)
    notes = []
    for name in (NEW_VAR, OLD_VAR):
        if name in env:
            notes.append(f"replacing {name}={env.pop(name)} from the environment")
    env[variable] = fraction_text(reservation.bytes, reservation.capacity)
    if env.get("CUDA_VISIBLE_DEVICES", str(reservation.device)) != str(reservation.device):
        notes.append(f"replacing CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} with {reservation.device}")
    env["CUDA_VISIBLE_DEVICES"] = str(reservation.device)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["JAXMEM_RESERVATION"] = f"{reservation.device}:{reservation.id}"
    env["JAXMEM_LEDGER"] = str(reservation.ledger_dir)
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip() in ("false", "False", "0"):
        notes.append("XLA_PYTHON_CLIENT_PREALLOCATE is false: JAX grows on demand up to the fraction "
                     "(the whole share stays reserved; expect fragmentation)")
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform":
        notes.append("XLA_PYTHON_CLIENT_ALLOCATOR=platform ignores the memory fraction: JAX is not held to the reservation")
    return env, notes


def _raise_signalled(signum: int, frame: object) -> None:
    raise _Signalled(signum)


def _spawn_gated(cmd: list[str], env: dict[str, str], old_mask: set[int],
                 dispositions: dict[int, object]) -> tuple[int, int, int]:
    """Fork a child that execs `cmd` only after the parent opens its gate.

    The gate lets the parent record the child in the ledger before the command runs; if the
    parent dies first, the child reads end-of-file and exits (125) without running anything.
    Returns (pid, gate write end, exec-error read end).
    """
    gate_r, gate_w = os.pipe()
    err_r, err_w = os.pipe()  # close-on-exec: end-of-file means exec succeeded
    pid = os.fork()
    if pid == 0:  # child: only async-signal-safe-ish work, then exec or _exit
        code = 125
        try:
            os.close(gate_w)
            os.close(err_r)
            if os.read(gate_r, 1) == _GO:
                os.close(gate_r)
                for signum, handler in dispositions.items():
                    signal.signal(signum, handler)
                for signum in (signal.SIGPIPE, signal.SIGXFSZ):
                    signal.signal(signum, signal.SIG_DFL)  # Python ignores these; the command should not
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                code = 127
                os.execvpe(cmd[0], cmd, env)
        except OSError as err:
            try:
                os.write(err_w, f"{err.errno}:{err.strerror}".encode())
            except OSError:
                pass
        except BaseException:
            pass
        os._exit(code)
    os.close(gate_r)
    os.close(err_w)
    return pid, gate_w, err_r


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _set_subreaper(on: bool) -> bool:
    """Make orphaned descendants our children (Linux), so none escapes the reservation."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state letter)} of every process, from /proc ({} without it)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2:].split()
        if len(fields) > 1:
            table[int(name)] = (int(fields[1]), fields[0].decode("ascii", "replace"))
    return table


def left_running(own: set[int]) -> list[int]:
    """Live processes below this one, other than the children in `own` (those that were ours
    before the command started) and what runs below them."""
    table = _process_table()
    below: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        below.setdefault(parent, []).append(pid)
    found, todo = [], [p for p in below.get(os.getpid(), []) if p not in own]
    while todo:
        pid = todo.pop()
        if table.get(pid, (0, "Z"))[1] not in ("Z", "X", "x"):
            found.append(pid)
        todo.extend(below.get(pid, []))
    return sorted(found)


def _reap_orphans(own: set[int], child: int) -> None:
    """Collect orphans of the command that were handed to us and have exited (we are their
    subreaper); never another child of this process's, nor the command itself."""
    for pid, (parent, state) in _process_table().items():
        if parent == os.getpid() and state == "Z" and pid not in own and pid != child:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _supervise(child: int, own: set[int] = frozenset()) -> int:
    """Forward signals to the child until it exits; return its exit code. Signals are blocked."""
    waited = set(FORWARDED) | {signal.SIGCHLD}
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid == child:
            return _exit_code(status)
        info = signal.sigwaitinfo(waited)
        if info.si_signo == signal.SIGCHLD:
            _reap_orphans(own, child)
            continue
        if not should_forward(info.si_code, _group_of(child), os.getpgrp()):
            continue
        try:
            os.kill(child, info.si_signo)
        except ProcessLookupError:
            pass


def should_forward(si_code: int, child_group: int | None, own_group: int) -> bool:
    """Whether a signal the wrapper received should be sent on to the command.

    A signal the kernel sent (si_code SI_KERNEL: Ctrl-C or a hang-up from our terminal) went to
    the whole foreground process group, so a command in our group has it already; sending it
    again would interrupt the command's own clean-up. Anything sent with kill() is passed on.
    """
    return not (si_code == _SI_KERNEL and child_group == own_group)


def _hand_over(reservation: Reservation, own: set[int], child: int, quiet: bool) -> bool:
    """Make the processes the command left running holders; True when any still runs (the
    reservation is then theirs, not released here).

    A daemon detaches by forking and exiting, and a process forked just before its parent
    exited can take tens of milliseconds to show in /proc; so look again until three looks
    30 ms apart find nobody new (at most a second), even when the first finds nobody. Orphans
    are handed to us meanwhile (we are their subreaper), so none slips out while we look.
    """
    import time

    held: list[int] = []
    quiet_looks, deadline = 0, time.monotonic() + 1.0
    while quiet_looks < 3 and time.monotonic() < deadline:
        new = [pid for pid in left_running(own) if pid not in held]
        for pid in new:
            try:
                reservation.attach(pid)
                held.append(pid)
            except ProcessLookupError:
                continue  # exited meanwhile
        quiet_looks = 0 if new else quiet_looks + 1
        time.sleep(0.03)
        _reap_orphans(own, child)
    held = [pid for pid in held if procinfo.start_time(pid) is not None]
    if held and not quiet:
        print(f"jaxmem run: the command left {len(held)} process(es) running ({', '.join(map(str, held[:10]))}); "
              "the reservation stays until they exit", file=sys.stderr)
    return bool(held)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def main(argv: list[str]) -> int:
    options, cmd = _split(argv)
    args = _parser().parse_args(options)
    cmd = cmd or [a for a in args.cmd if a != "--"]
    if not cmd:
        raise ConfigError("no command to run: jaxmem run --memory 30% -- CMD [ARGS...]")
    variable = fraction_variable(args.fraction_var)
    label = args.label or " ".join(cmd)[:80]

    # Until the child runs, a termination signal must still undo our place in the ledger.
    dispositions = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for signum in dispositions:
        if dispositions[signum] != signal.SIG_IGN:
            signal.signal(signum, _raise_signalled)
    reservation = None
    old_mask: set[int] | None = None
    subreaper = kept = False
    try:
        reservation = reserve(args.memory, device=args.device, capacity=args.capacity,
                              wait=args.wait, label=label)
        env, notes = child_environment(dict(os.environ), reservation, variable)
        if not args.quiet:
            print(f"jaxmem run: reserved {format_size(reservation.bytes)} of device {reservation.device} "
                  f"({format_size(reservation.capacity)}); {variable}={env[variable]}", file=sys.stderr)
        for note in notes:
            print(f"jaxmem run: {note}", file=sys.stderr)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(FORWARDED) | {signal.SIGCHLD})
        own = set(left_running(set()))  # our children before the command: not the command's
        subreaper = _set_subreaper(True)
        child, gate, errors = _spawn_gated(cmd, env, old_mask, dispositions)
        try:
            reservation.attach(child)
        except BaseException:
            os.close(gate)  # the child reads end-of-file and exits without running the command
            os.waitpid(child, 0)
            raise
        os.write(gate, _GO)  # from here on the command runs, recorded as a holder
        os.close(gate)
        failure = os.read(errors, 256)
        os.close(errors)
        if failure:
            os.waitpid(child, 0)
            number, _, message = failure.decode(errors="replace").partition(":")
            print(f"jaxmem run: cannot run {cmd[0]!r}: {message}", file=sys.stderr)
            return 127 if number == str(errno.ENOENT) else 126  # the shell's convention
        code = _supervise(child, own)
        kept = _hand_over(reservation, own, child, args.quiet)
        return code
    except _Signalled as stop:
        return 128 + stop.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        if subreaper:
            _set_subreaper(False)
        if reservation is not None and not kept:
            try:
                reservation.release()
            except JaxmemError as err:  # keep the command's exit code; liveness reclaims it later
                print(f"jaxmem run: could not release the reservation ({err}); it is reclaimed "
                      "at the next access after this wrapper exits", file=sys.stderr)
        # Restore what we changed (matters when main() is called in-process, as tests do).
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for signum, handler in dispositions.items():
            signal.signal(signum, handler)
