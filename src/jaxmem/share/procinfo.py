"""Is a process still the one that made a reservation? pid plus start time, read from /proc.

A pid alone is not an identity: the kernel reuses pids. The start time (field 22 of
/proc/<pid>/stat, in clock ticks since boot) does not change across `exec` and differs for a
new process that got the same pid, so (pid, start) names one process for the life of the boot.

    >>> me = identity(os.getpid())
    >>> is_alive(*me)
    True
"""

from __future__ import annotations

import errno
import os

# Index of `starttime` among the fields after the ")" that closes `comm`: /proc/<pid>/stat field
# 22 is the 20th field counted from field 3 (`state`). `comm` may hold spaces and ")" itself,
# so we split after the LAST ")".
_STARTTIME_AFTER_COMM = 22 - 3


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ESRCH):
            return None
        raise
    close = raw.rfind(b")")
    if close < 0:
        return None
    return raw[close + 1:].decode("ascii", "replace").split()


def start_time(pid: int) -> int | None:
    """The start time of a running process (clock ticks since boot), or None when it is gone.

    A zombie (exited, not yet reaped by its parent) counts as gone: its memory is freed.

    Args:
        pid: the process id.

    Returns:
        the start time, 0 where /proc is missing (other systems: only the pid is checked), or
        None when no live process has that pid.
    """
    if pid <= 0:
        return None
    if not os.path.isdir("/proc/self"):
        return 0 if _pid_exists(pid) else None
    fields = _stat_fields(pid)
    if fields is None or len(fields) <= _STARTTIME_AFTER_COMM:
        return None
    if fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[_STARTTIME_AFTER_COMM])


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, just not ours to signal
    return True


def identity(pid: int) -> tuple[int, int]:
    """(pid, start time) of a live process, for recording in the ledger.

    Raises ProcessLookupError when the process is gone.
    """
    start = start_time(pid)
    if start is None:
        raise ProcessLookupError(f"no live process with pid {pid}")
    return pid, start


def is_alive(pid: int, start: int) -> bool:
    """True when `pid` is alive and is the process that started at `start` (not a reused pid)."""
    now = start_time(pid)
    if now is None:
        return False
    return start == 0 or now == 0 or now == start
