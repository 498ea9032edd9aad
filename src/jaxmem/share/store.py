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

The state (format "jaxmem-ledger/1") is plain JSON:
    {"format", "device", "capacity", "next_id", "next_ticket", "next_seq",
     "reservations": [{"id", "ticket", "bytes", "label", "since", "pids": [[pid, start], ...]}],
     "waiters": [{"ticket", "bytes", "label", "since", "pid", "start"}]}
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from jaxmem.errors import ConfigError, LedgerError

FORMAT = "jaxmem-ledger/1"
HISTORY_MAX_BYTES = 8 << 20  # module-level so a test can shrink it to exercise rotation


class LedgerCorrupt(LedgerError):
    """The ledger file cannot be trusted; the message names it and the repair command."""


class LedgerPaths(NamedTuple):
    device: int
    state: Path
    lock: Path
    history: Path
    history_old: Path


def state_dir() -> Path:
    """The directory holding the ledgers, created on first use.

    `JAXMEM_STATE_DIR` when set (point several users at one shared directory to make them see
    each other); else `$XDG_RUNTIME_DIR/jaxmem`; else `/dev/shm/jaxmem-<uid>`; else
    `<tmp>/jaxmem-<uid>`. The last two must belong to us. The defaults are memory file systems
    where the system has them: a ledger lives no longer than the boot its processes ran in, and
    its fsyncs cost nothing (on a busy disk each one costs milliseconds).
    """
    env = os.environ.get("JAXMEM_STATE_DIR")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if env:
        path = Path(env)
    elif runtime and os.path.isdir(runtime):
        path = Path(runtime) / "jaxmem"
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = Path("/dev/shm") / f"jaxmem-{os.getuid()}"
    else:
        path = Path(tempfile.gettempdir()) / f"jaxmem-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as err:
        raise ConfigError(f"cannot use state directory {path}: {err.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"state directory {path} is not a directory")
    if not env and not runtime and info.st_uid != os.getuid():
        # A shared /tmp or /dev/shm: someone else made this name first; never write into it.
        raise ConfigError(f"state directory {path} belongs to uid {info.st_uid}; set JAXMEM_STATE_DIR")
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
        if number.isdigit():
            found.add(int(number))
    return sorted(found)


@contextlib.contextmanager
def locked(paths: LedgerPaths) -> Iterator[LedgerPaths]:
    """Hold the device's exclusive lock for the body. Released on any exit, and by the kernel
    if the process dies, so a crashed holder never wedges the ledger."""
    # Read-only is enough for flock, and lets users sharing a state directory lock each
    # other's lock file.
    try:
        fd = os.open(paths.lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise LedgerError(f"cannot open ledger lock {paths.lock}: {err.strerror}") from None
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


def load(paths: LedgerPaths) -> dict[str, Any] | None:
    """The device's state, or None when it has no ledger file yet.

    Safe without the lock too (for a waiter's peek): the file is only ever replaced by rename,
    so a reader sees one whole version. A damaged file raises LedgerError naming the file and
    the repair command.
    """
    try:
        raw = paths.state.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise LedgerError(f"cannot read ledger {paths.state}: {err.strerror}") from None
    try:
        state = json.loads(raw)
        problem = validate(state, paths.device)
    except (ValueError, UnicodeDecodeError) as err:
        problem = f"not JSON ({err})"
    if problem:
        raise LedgerCorrupt(f"ledger {paths.state} is corrupt: {problem}; {repair_hint(paths)}")
    return state


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def validate(state: Any, device: int) -> str | None:
    """What is wrong with a decoded state, or None when it is well formed and consistent."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return f"not a {FORMAT} document"
    if state.get("device") != device:
        return f"it describes device {state.get('device')!r}, not {device}"
    for key, low in (("capacity", 1), ("next_id", 1), ("next_ticket", 1), ("next_seq", 1)):
        if not _is_int(state.get(key), low):
            return f"field {key!r} is {state.get(key)!r}"
    reservations, waiters = state.get("reservations"), state.get("waiters")
    if not isinstance(reservations, list) or not isinstance(waiters, list):
        return "reservations/waiters are not lists"
    ids, tickets = set(), set()
    for r in reservations:
        if not isinstance(r, dict) or not all(_is_int(r.get(k), 1) for k in ("id", "ticket", "bytes")):
            return f"bad reservation {r!r:.120}"
        if not isinstance(r.get("label"), str) or not isinstance(r.get("since"), (int, float)):
            return f"bad reservation {r!r:.120}"
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
            return f"bad waiter {w!r:.120}"
        if not _is_int(w.get("start")) or not isinstance(w.get("label"), str):
            return f"bad waiter {w!r:.120}"
        if w["ticket"] in tickets or w["ticket"] >= state["next_ticket"]:
            return f"waiter ticket {w['ticket']} is duplicated or beyond the counters"
        tickets.add(w["ticket"])
    reserved = sum(r["bytes"] for r in reservations)
    if reserved > state["capacity"]:
        return f"{reserved} bytes reserved exceed the capacity {state['capacity']}"
    return None


def _write_atomic(path: Path, data: bytes) -> None:
    # Only lock holders write; the pid in the name keeps users who share a directory from
    # tripping over each other's leftovers (a writer killed mid-write leaves one behind).
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _append(path: Path, data: bytes) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _line(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


def commit(paths: LedgerPaths, state: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Journal `events`, then replace the state file. Call with the lock held.

    Each event gets the next `seq` and a wall-clock `t`. The journal is written first (write-
    ahead): a writer killed between the two steps leaves a journal entry for a change whose
    owner is dead, which liveness checks discard anyway.
    """
    try:
        _commit(paths, state, events)
    except OSError as err:
        raise LedgerError(f"cannot write ledger {paths.state}: {err.strerror or err}") from None


def _commit(paths: LedgerPaths, state: dict[str, Any], events: list[dict[str, Any]]) -> None:
    now = time.time()
    for event in events:
        event["seq"] = state["next_seq"]
        event.setdefault("t", now)
        state["next_seq"] += 1
    if events:
        size = _append(paths.history, b"".join(_line(e) for e in events))
        if size > HISTORY_MAX_BYTES:
            os.replace(paths.history, paths.history_old)
            write_snapshot(paths, state, reason="rotated")
    _write_atomic(paths.state, json.dumps(state, separators=(",", ":")).encode())


def write_snapshot(paths: LedgerPaths, state: dict[str, Any], reason: str) -> None:
    """Append a `snapshot` event holding the whole state (a starting point for a rebuild)."""
    event = {"op": "snapshot", "reason": reason, "seq": state["next_seq"], "t": time.time(),
             "state": json.loads(json.dumps(state))}
    state["next_seq"] += 1
    event["state"]["next_seq"] = state["next_seq"]
    _append(paths.history, _line(event))


def read_history(paths: LedgerPaths, *, include_rotated: bool = True) -> list[dict[str, Any]]:
    """The journal's events, oldest first (the rotated generation first when kept).

    A final line cut short (its writer killed mid-append) is skipped; any other damage raises
    LedgerError naming the file.
    """
    events: list[dict[str, Any]] = []
    files = [paths.history_old, paths.history] if include_rotated else [paths.history]
    for path in files:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            continue
        lines = raw.split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                if not isinstance(event, dict) or not _is_int(event.get("seq"), 1):
                    raise ValueError("not an event")
            except ValueError:
                if number == len(lines):  # no newline after it: a torn last append
                    continue
                raise LedgerError(f"ledger journal {path} is damaged at line {number}") from None
            events.append(event)
    return events


# Doorbells: a waiter blocks on a FIFO of its own instead of polling; whoever changes the ledger
# rings the first waiter's bell (the only one that could now be granted). A bell whose waiter
# died has no reader, so ringing it fails at once and harmlessly.

def bell_path(paths: LedgerPaths, ticket: int) -> Path:
    return paths.state.with_name(f"device-{paths.device}.bell-{ticket}")


def open_bell(paths: LedgerPaths, ticket: int) -> int:
    """Create the waiter's FIFO and open it read-write (so it never reads end-of-file)."""
    path = bell_path(paths, ticket)
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale one from a previous ledger generation
        os.mkfifo(path, 0o622)
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise LedgerError(f"cannot make the waiting doorbell {path}: {err.strerror}") from None


def ring(paths: LedgerPaths, ticket: int) -> None:
    try:
        fd = os.open(bell_path(paths, ticket), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # no such bell, or nobody listening (ENXIO)
        return
    try:
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
