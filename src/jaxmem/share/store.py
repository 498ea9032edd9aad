"""The ledger's files: where they live, the lock, atomic replacement, validation, the history.

For device N the state directory holds:

    device-N.json       the current state; replaced whole (temp file + fsync + rename), so a
                        process killed mid-write leaves the previous version, never half a file
    device-N.lock       every read-modify-write holds `fcntl.flock(LOCK_EX)` on it (a separate
                        file, because the state file itself is replaced on each write)
    device-N.history    append-only journal, one JSON line per change, numbered by `seq`;
                        past HISTORY_MAX_BYTES it moves to device-N.history.1 (one generation
                        kept) and the new file starts with a `snapshot` of the state, so the
                        current file alone is enough to rebuild the ledger

    with locked(paths_for(0)) as p:
        state = load(p) or new_state(0, 16 * GiB)
        commit(p, state, [{"op": "note", "text": "hello"}])

The directory is shared by every user of the node's GPUs (see `state_dir`), so nothing in it is
trusted to be what its name says: each file is opened relative to the directory, without
following a symbolic link (O_NOFOLLOW), without blocking on a planted FIFO (O_NONBLOCK), and
used only when it is a regular file with one link (a hard link could be someone's own file).
New files are made with O_EXCL (temporary files get an unguessable name) and given the
directory's sharing (rw for the group or everyone when the directory is writable by them).

The state (format "jaxmem-ledger/1") is plain JSON:
    {"format", "device", "capacity", "next_id", "next_ticket", "next_seq",
     "reservations": [{"id", "ticket", "bytes", "label", "since", "pids": [[pid, start], ...]}],
     "waiters": [{"ticket", "bytes", "label", "since", "pid", "start"}]}
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from jaxmem.errors import ConfigError, LedgerCorrupt, LedgerError, quote

FORMAT = "jaxmem-ledger/1"
LABEL_MAX = 200            # characters of a label: it is printed in other users' status lines
HISTORY_MAX_BYTES = 8 << 20  # module-level so a test can shrink it to exercise rotation
STATE_MAX_BYTES = 64 << 20   # a planted giant file is refused, not read into memory
NODE_DIR = "jaxmem"          # the node-wide directory's name under /dev/shm (or the temp dir)
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LedgerPaths(NamedTuple):
    device: int
    state: Path
    lock: Path
    history: Path
    history_old: Path


def node_dir() -> Path:
    """The default, node-wide state directory: `/dev/shm/jaxmem` (else `<tmp>/jaxmem`).

    One directory for every user of the node, so that two users of one GPU see each other's
    reservations. Whoever comes first creates it with mode 0777 (no sticky bit: users must be
    able to replace each other's ledger files by rename); an administrator may create it
    beforehand with a group instead (mode 2770).
    """
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    return base / NODE_DIR


def state_dir() -> Path:
    """The directory holding the ledgers: `JAXMEM_STATE_DIR` when set, else `node_dir()`.

    The defaults are memory file systems where the system has them: a ledger lives no longer
    than the boot its processes ran in, and its fsyncs cost nothing. The directory must be a
    real directory (not a symbolic link) that we can write, and not sticky when others can
    write it (in a sticky directory users cannot replace each other's files).
    """
    env = os.environ.get("JAXMEM_STATE_DIR")
    # A directory the user names may be reached through links of theirs; the node's default
    # is checked as it is (a link planted there is refused).
    path = Path(os.path.realpath(env)) if env else node_dir()
    try:
        if env:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        else:
            _make_node_dir(path)
        info = path.lstat()
    except OSError as err:
        raise ConfigError(f"cannot use state directory {path}: {err.strerror}") from None
    return check_state_dir(path, info)


def _make_node_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o777)
    except FileExistsError:
        return
    os.chmod(path, 0o777)  # the umask must not make it private to its first user


def check_state_dir(path: Path, info: os.stat_result) -> Path:
    """`path` when it is fit to hold ledgers (see `state_dir`); ConfigError saying why not."""
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"state directory {path} is a symbolic link; not following it "
                          "(remove it, or set JAXMEM_STATE_DIR to a real directory)")
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"cannot use state directory {path}: it is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot use state directory {path}: not writable by uid {os.geteuid()} "
                          f"(owner uid {info.st_uid}, group {info.st_gid}, mode {mode:04o}); "
                          "ask its owner or set JAXMEM_STATE_DIR")
    if mode & stat.S_ISVTX and mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"state directory {path} is sticky (mode {mode:04o}): its users could not "
                          "replace each other's ledger files; use mode 0777, or 2770 with a group")
    return path


def paths_for(device: int, root: Path | None = None) -> LedgerPaths:
    """The files of device `device`'s ledger under `root` (default: `state_dir()`)."""
    base = Path(root) if root is not None else state_dir()
    stem = base / f"device-{device}"
    return LedgerPaths(device, stem.with_suffix(".json"), stem.with_suffix(".lock"),
                       stem.with_suffix(".history"), stem.with_suffix(".history.1"))


def devices_in(root: Path | None = None) -> list[int]:
    """Device numbers that have a ledger (or its journal) under `root`, sorted."""
    base = Path(root) if root is not None else state_dir()
    found = set()
    for entry in base.glob("device-*"):
        number = entry.name.removeprefix("device-").split(".", 1)[0]
        if number.isdigit() and len(number) < 6:
            found.add(int(number))
    return sorted(found)


# ---- opening files in a directory other users can write ---------------------------------------

@contextlib.contextmanager
def _directory(base: Path) -> Iterator[int]:
    """The state directory as a descriptor; every file below is opened relative to it, so a
    directory swapped for a link between two calls cannot redirect a write."""
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise LedgerError(f"cannot open state directory {base}: {_why(err, base)}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _share_mode(dir_fd: int, bits: int = 0o666) -> int:
    """Permissions for a new file: rw for whoever may write the directory (owner always)."""
    mode = os.fstat(dir_fd).st_mode
    shared = 0o600 | (0o060 if mode & stat.S_IWGRP else 0) | (0o006 if mode & stat.S_IWOTH else 0)
    return shared & bits | 0o600


def _why(err: OSError, path: Path) -> str:
    if err.errno == errno.ELOOP:
        return "it is a symbolic link (not followed; remove it)"
    if err.errno in (errno.EACCES, errno.EPERM):
        try:
            info = os.lstat(path)
            return (f"permission denied (owner uid {info.st_uid}, group {info.st_gid}, "
                    f"mode {stat.S_IMODE(info.st_mode):04o}; we are uid {os.geteuid()})")
        except OSError:
            return "permission denied"
    return err.strerror or str(err)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _open(dir_fd: int, path: Path, flags: int, create_mode: int | None = None) -> int:
    """Open `path` (a name in `dir_fd`) as a trusted regular file; create it with O_EXCL and
    `create_mode` when missing and `create_mode` is given. FileNotFoundError when missing."""
    while True:
        try:
            fd = os.open(path.name, flags | _SAFE, dir_fd=dir_fd)
        except FileNotFoundError:
            if create_mode is None:
                raise
            try:
                fd = os.open(path.name, flags | _SAFE | os.O_CREAT | os.O_EXCL, create_mode, dir_fd=dir_fd)
            except FileExistsError:
                continue  # made by someone else meanwhile: open theirs
            except OSError as err:
                raise LedgerError(f"cannot create {path}: {_why(err, path)}") from None
            os.fchmod(fd, create_mode)  # the umask must not narrow a shared directory's file
        except OSError as err:
            if err.errno == errno.EISDIR:
                raise LedgerError(f"cannot use {path}: it is a directory, not a ledger file (remove it)") from None
            raise LedgerError(f"cannot open {path}: {_why(err, path)}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            what = _kind(info.st_mode) if not stat.S_ISREG(info.st_mode) else f"a file with {info.st_nlink} hard links"
            raise LedgerError(f"cannot use {path}: it is {what}, not a ledger file (remove it)")
        return fd


def _read_capped(fd: int, path: Path, limit: int) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise LedgerCorrupt(f"ledger file {path} is {size} bytes, more than a ledger ever holds ({limit}); "
                            "it is not ours: remove it or run `jaxmem share repair`")
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _read_file(path: Path, limit: int) -> bytes | None:
    """The bytes of a ledger file, or None when it does not exist."""
    with _directory(path.parent) as dir_fd:
        try:
            fd = _open(dir_fd, path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return _read_capped(fd, path, limit)
        except OSError as err:
            raise LedgerError(f"cannot read {path}: {_why(err, path)}") from None
        finally:
            os.close(fd)


def exists(path: Path) -> bool:
    """Whether a name exists in the directory at all (a link or directory counts: it is in the way)."""
    return os.path.lexists(path)


@contextlib.contextmanager
def locked(paths: LedgerPaths) -> Iterator[LedgerPaths]:
    """Hold the device's exclusive lock for the body. Released on any exit, and by the kernel
    if the process dies, so a crashed holder never wedges the ledger."""
    # Read-only is enough for flock, and lets users sharing a state directory lock each
    # other's lock file.
    with _directory(paths.lock.parent) as dir_fd:
        fd = _open(dir_fd, paths.lock, os.O_RDONLY, _share_mode(dir_fd))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield paths
    finally:
        os.close(fd)  # closing the last descriptor drops the flock


def new_state(device: int, capacity: int) -> dict[str, Any]:
    """An empty ledger for `device` with `capacity` bytes."""
    return {"format": FORMAT, "device": device, "capacity": capacity, "next_id": 1,
            "next_ticket": 1, "next_seq": 1, "reservations": [], "waiters": []}


def repair_hint(paths: LedgerPaths) -> str:
    return f"run `jaxmem share repair --device {paths.device}` to rebuild it from {paths.history.name} (live reservations are kept)"


def read_raw_state(paths: LedgerPaths) -> Any:
    """The state file decoded as JSON but not validated; None when missing or not JSON."""
    raw = _read_file(paths.state, STATE_MAX_BYTES)
    try:
        return json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None


def load(paths: LedgerPaths) -> dict[str, Any] | None:
    """The device's state, or None when it has no ledger file yet.

    Safe without the lock too (for a waiter's peek): the file is only ever replaced by rename,
    so a reader sees one whole version. A damaged file raises LedgerError naming the file and
    the repair command.
    """
    raw = _read_file(paths.state, STATE_MAX_BYTES)
    if raw is None:
        return None
    try:
        state = json.loads(raw)
        problem = validate(state, paths.device)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        problem = f"not JSON ({str(err)[:100]})"
    if problem:
        raise LedgerCorrupt(f"ledger {paths.state} is corrupt: {problem}; {repair_hint(paths)}")
    return state


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_label(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= LABEL_MAX


def validate(state: Any, device: int) -> str | None:
    """What is wrong with a decoded state, or None when it is well formed and consistent."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return f"not a {FORMAT} document"
    if state.get("device") != device:
        return f"it describes device {quote(state.get('device'))}, not {device}"
    for key, low in (("capacity", 1), ("next_id", 1), ("next_ticket", 1), ("next_seq", 1)):
        if not _is_int(state.get(key), low):
            return f"field {key!r} is {quote(state.get(key))}"
    reservations, waiters = state.get("reservations"), state.get("waiters")
    if not isinstance(reservations, list) or not isinstance(waiters, list):
        return "reservations/waiters are not lists"
    ids, tickets = set(), set()
    for r in reservations:
        if not isinstance(r, dict) or not all(_is_int(r.get(k), 1) for k in ("id", "ticket", "bytes")):
            return f"bad reservation {quote(r)}"
        if not _is_label(r.get("label")) or not isinstance(r.get("since"), (int, float)):
            return f"bad reservation {quote(r)}"
        pids = r.get("pids")
        if not isinstance(pids, list) or not pids or not all(
                isinstance(p, list) and len(p) == 2 and _is_int(p[0], 1) and _is_int(p[1]) for p in pids):
            return f"bad pids in reservation {r['id']}"
        if r["id"] in ids or r["id"] >= state["next_id"] or r["ticket"] >= state["next_ticket"]:
            return f"reservation id {r['id']} is duplicated or beyond the counters"
        ids.add(r["id"])
        tickets.add(r["ticket"])
    for w in waiters:
        if not isinstance(w, dict) or not all(_is_int(w.get(k), 1) for k in ("ticket", "bytes", "pid")):
            return f"bad waiter {quote(w)}"
        if not _is_int(w.get("start")) or not _is_label(w.get("label")):
            return f"bad waiter {quote(w)}"
        if w["ticket"] in tickets or w["ticket"] >= state["next_ticket"]:
            return f"waiter ticket {w['ticket']} is duplicated or beyond the counters"
        tickets.add(w["ticket"])
    reserved = sum(r["bytes"] for r in reservations)
    if reserved > state["capacity"]:
        return f"{reserved} bytes reserved exceed the capacity {state['capacity']}"
    return None


def _write_atomic(dir_fd: int, path: Path, data: bytes) -> None:
    # Only lock holders write. The temporary name is unguessable and made with O_EXCL, so
    # nothing planted under it is followed or truncated; rename replaces whatever has the
    # final name (a planted link included) without following it.
    tmp = f"{path.name}.tmp.{os.getpid()}.{secrets.token_hex(6)}"
    mode = _share_mode(dir_fd)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE, mode, dir_fd=dir_fd)
    except OSError as err:
        raise LedgerError(f"cannot write ledger {path}: cannot create a file beside it ({_why(err, path.parent)})") from None
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise LedgerError(f"cannot write ledger {path}: {_why(err, path)}") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _append(dir_fd: int, path: Path, data: bytes) -> int:
    fd = _open(dir_fd, path, os.O_WRONLY | os.O_APPEND, _share_mode(dir_fd))
    try:
        _write_all(fd, data)
        return os.fstat(fd).st_size
    except OSError as err:
        raise LedgerError(f"cannot write ledger journal {path}: {_why(err, path)}") from None
    finally:
        os.close(fd)


def _line(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


def commit(paths: LedgerPaths, state: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Journal `events`, then replace the state file. Call with the lock held.

    Each event gets the next `seq` and a wall-clock `t`. The journal is written first (write-
    ahead): a writer killed between the two steps leaves a journal entry for a change whose
    owner is dead, which liveness checks discard anyway. Failures raise LedgerError naming
    the file that could not be written.
    """
    now = time.time()
    for event in events:
        event["seq"] = state["next_seq"]
        event.setdefault("t", now)
        state["next_seq"] += 1
    with _directory(paths.state.parent) as dir_fd:
        if events:
            size = _append(dir_fd, paths.history, b"".join(_line(e) for e in events))
            if size > HISTORY_MAX_BYTES:
                try:
                    os.rename(paths.history.name, paths.history_old.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except OSError as err:
                    raise LedgerError(f"cannot rotate ledger journal {paths.history}: {_why(err, paths.history_old)}") from None
                _snapshot(dir_fd, paths, state, reason="rotated")
        _write_atomic(dir_fd, paths.state, json.dumps(state, separators=(",", ":")).encode())


def write_snapshot(paths: LedgerPaths, state: dict[str, Any], reason: str) -> None:
    """Append a `snapshot` event holding the whole state (a starting point for a rebuild)."""
    with _directory(paths.history.parent) as dir_fd:
        _snapshot(dir_fd, paths, state, reason)


def _snapshot(dir_fd: int, paths: LedgerPaths, state: dict[str, Any], reason: str) -> None:
    event = {"op": "snapshot", "reason": reason, "seq": state["next_seq"], "t": time.time(),
             "state": json.loads(json.dumps(state))}
    state["next_seq"] += 1
    event["state"]["next_seq"] = state["next_seq"]
    _append(dir_fd, paths.history, _line(event))


def read_journal(paths: LedgerPaths, *, include_rotated: bool = True) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """The journal's readable events, oldest first, and where it is damaged: ("file:line",
    number of readable events before it).

    A final line cut short (its writer killed mid-append) is skipped and not counted as damage.
    """
    events: list[dict[str, Any]] = []
    damaged: list[tuple[str, int]] = []
    limit = max(STATE_MAX_BYTES, 4 * HISTORY_MAX_BYTES)
    files = [paths.history_old, paths.history] if include_rotated else [paths.history]
    for path in files:
        raw = _read_file(path, limit)
        if raw is None:
            continue
        lines = raw.split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                if not isinstance(event, dict) or not _is_int(event.get("seq"), 1):
                    raise ValueError("not an event")
            except (ValueError, RecursionError):
                if number < len(lines):  # with a newline after it: not a torn last append
                    damaged.append((f"{path}:{number}", len(events)))
                continue
            events.append(event)
    return events, damaged


def read_history(paths: LedgerPaths, *, include_rotated: bool = True) -> list[dict[str, Any]]:
    """The journal's events, oldest first (the rotated generation first when kept).

    A final line cut short (its writer killed mid-append) is skipped; any other damage raises
    LedgerError naming the file.
    """
    events, damaged = read_journal(paths, include_rotated=include_rotated)
    if damaged:
        where, _, number = damaged[0][0].rpartition(":")
        raise LedgerError(f"ledger journal {where} is damaged at line {number}")
    return events


# Doorbells: a waiter blocks on a FIFO of its own instead of polling; whoever changes the ledger
# rings the first waiter's bell (the only one that could now be granted). A bell whose waiter
# died has no reader, so ringing it fails at once and harmlessly.

def bell_path(paths: LedgerPaths, ticket: int) -> Path:
    return paths.state.with_name(f"device-{paths.device}.bell-{ticket}")


def open_bell(paths: LedgerPaths, ticket: int) -> int:
    """Create the waiter's FIFO and open it read-write (so it never reads end-of-file)."""
    path = bell_path(paths, ticket)
    with _directory(path.parent) as dir_fd:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.name, dir_fd=dir_fd)  # a stale one from a previous ledger generation
            mode = _share_mode(dir_fd, 0o622)  # others ring it; only we read it
            os.mkfifo(path.name, mode, dir_fd=dir_fd)
            fd = os.open(path.name, os.O_RDWR | _SAFE, dir_fd=dir_fd)
        except OSError as err:
            raise LedgerError(f"cannot make the waiting doorbell {path}: {_why(err, path)}") from None
        info = os.fstat(fd)
        if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)  # swapped between mkfifo and open
            raise LedgerError(f"cannot use the waiting doorbell {path}: it was replaced by {_kind(info.st_mode)}")
        os.fchmod(fd, mode)
        return fd


def ring(paths: LedgerPaths, ticket: int) -> None:
    path = bell_path(paths, ticket)
    try:
        with _directory(path.parent) as dir_fd:
            fd = os.open(path.name, os.O_WRONLY | _SAFE, dir_fd=dir_fd)
    except (OSError, LedgerError):  # no such bell, nobody listening (ENXIO), or a link
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):  # never write into a planted regular file
            os.write(fd, b"!")
    except OSError:  # full: the waiter has rings pending already
        pass
    finally:
        os.close(fd)


def drain_bell(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        while os.read(fd, 4096):
            pass


def close_bell(paths: LedgerPaths, ticket: int, fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(OSError):
        bell_path(paths, ticket).unlink()
