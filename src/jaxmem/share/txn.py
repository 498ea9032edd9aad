"""One read-modify-write of a device's ledger, and rebuilding a state from its journal.

    with transaction(0, None, capacity=16 * GiB) as txn:
        txn.state["reservations"].append(record)
        txn.log(op="grant", **record)          # journalled and written back on a clean exit

`ledger` (reserve, release, status) and `repair` both build on this module; neither imports
the other. A transaction takes the device's lock, loads the state (rebuilding it from the
journal when the file was deleted), reclaims what dead processes held, and commits the events
it logged when the body leaves without an exception.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

from jaxmem.errors import ConfigError, JournalUnusable, LedgerError
from jaxmem.share import procinfo, store
from jaxmem.units import format_size


class Txn:
    """The state under the lock, and the events that describe what the body changed."""

    def __init__(self, paths: store.LedgerPaths, state: dict[str, Any] | None) -> None:
        self.paths = paths
        self.state = state
        self.events: list[dict[str, Any]] = []
        self.dirty = False
        self.created = False

    def log(self, **event: Any) -> None:
        event["reserved"] = reserved_bytes(self.state)
        self.events.append(event)
        self.dirty = True


def reserved_bytes(state: dict[str, Any] | None) -> int:
    """Bytes held by the reservations of a state."""
    return sum(r["bytes"] for r in state["reservations"]) if state else 0


def holders_alive(record: dict[str, Any]) -> bool:
    """Whether any process of a reservation still runs (pid plus start time)."""
    return any(procinfo.is_alive(pid, start) for pid, start in record["pids"])


def _dead_reason(pid: int, start: int) -> str:
    return "dead" if procinfo.start_time(pid) is None else "pid reused"


def reclaim(txn: Txn) -> None:
    """Drop reservations none of whose processes is alive, and waiters whose process is gone."""
    state = txn.state
    for r in list(state["reservations"]):
        if holders_alive(r):
            continue
        state["reservations"].remove(r)  # before logging: the event records the total after it
        txn.log(op="reclaim", id=r["id"], ticket=r["ticket"], bytes=r["bytes"], pids=r["pids"],
                label=r["label"], reason=_dead_reason(*r["pids"][0]))
    for w in list(state["waiters"]):
        if not procinfo.is_alive(w["pid"], w["start"]):
            state["waiters"].remove(w)
            store.close_bell(txn.paths, w["ticket"], None)
            txn.log(op="abandon", ticket=w["ticket"], bytes=w["bytes"], pid=w["pid"],
                    reason=_dead_reason(w["pid"], w["start"]))


@contextlib.contextmanager
def transaction(device: int, root: Path | None, capacity: int | None = None, *,
                create: bool = True) -> Iterator[Txn]:
    """Lock device `device`'s ledger, load it (creating or rebuilding it if missing), reclaim
    what dead processes held, and write back on a clean exit if anything changed."""
    paths = store.paths_for(device, root)
    with store.locked(paths):
        state = store.load(paths)
        txn = Txn(paths, state)
        if state is None and store.exists(paths.history):
            # The file was deleted but its journal is here: rebuild rather than forget.
            txn.state, dropped, _ = rebuild_from_journal(paths)
            for ticket in dropped:
                txn.log(op="abandon", ticket=ticket, reason="dropped at rebuild")
            txn.log(op="repair", action="rebuilt", damaged="ledger file missing",
                    kept=[r["id"] for r in txn.state["reservations"]], dropped=[])
        if txn.state is None:
            if not create:
                yield txn
                return
            if capacity is None:
                raise ConfigError(f"device {device} has no ledger yet and its capacity is unknown "
                                  "(no nvidia-smi on PATH): pass a capacity such as '16GiB' or 'h100-80gb'")
            txn.state = store.new_state(device, capacity)
            txn.created = True
        elif capacity is not None and capacity != txn.state["capacity"]:
            if txn.state["reservations"] or txn.state["waiters"]:
                reclaim(txn)
            if txn.state["reservations"] or txn.state["waiters"]:
                raise LedgerError(f"device {device}'s ledger records capacity {format_size(txn.state['capacity'])}, "
                                  f"not {format_size(capacity)}, and has live reservations")
            txn.log(op="capacity", capacity=capacity, was=txn.state["capacity"])
            txn.state["capacity"] = capacity
        reclaim(txn)
        yield txn
        if txn.dirty:
            if txn.created:
                # The journal of a new ledger starts with its empty state: a rebuild replays from it.
                fresh = store.new_state(device, txn.state["capacity"])
                store.write_snapshot(paths, fresh, reason="created")
                txn.state["next_seq"] = fresh["next_seq"]
            store.commit(paths, txn.state, txn.events)
            if txn.state["waiters"]:
                store.ring(paths, min(w["ticket"] for w in txn.state["waiters"]))


_RECORD_KEYS = ("id", "ticket", "bytes", "label", "since", "pids")


def _record(event: dict[str, Any]) -> dict[str, Any] | None:
    """The reservation a grant event describes, or None when the event is malformed."""
    record = {k: event.get(k) for k in _RECORD_KEYS}
    probe = {"format": store.FORMAT, "device": 0, "capacity": max(1, _int(record["bytes"])),
             "next_id": _int(record["id"]) + 1, "next_ticket": _int(record["ticket"]) + 1, "next_seq": 1,
             "reservations": [record], "waiters": []}
    return record if store.validate(probe, 0) is None else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def rebuild_from_journal(paths: store.LedgerPaths) -> tuple[dict[str, Any], list[int], list[str]]:
    """The state the journal describes: its latest intact snapshot with every later change.

    Call with the lock held. Damaged lines before that snapshot do not matter (it holds the
    whole state); damaged lines after it are skipped and returned, so the caller can say so.

    Returns:
        (state, tickets of the requests that were waiting, damaged "file:line" after the
        snapshot). Waiters are not restored: processes still waiting notice and queue again.
        Raises JournalUnusable when the journal has no intact snapshot to start from.
    """
    events, damaged = store.read_journal(paths, include_rotated=True)
    starts = [i for i, e in enumerate(events)
              if e.get("op") == "snapshot" and isinstance(e.get("state"), dict)
              and store.validate(e["state"], paths.device) is None]
    if not starts:
        why = f"damaged at {damaged[0]}" if damaged else "it has no snapshot to start from"
        raise JournalUnusable(f"cannot rebuild {paths.state}: journal {paths.history} is unusable ({why}); "
                              f"`jaxmem share repair --device {paths.device} --reset --capacity SIZE` starts an "
                              "empty ledger that keeps every reservation of a live process it can find")
    state = events[starts[-1]]["state"]
    by_id = {r["id"]: r for r in state["reservations"]}
    waiting = {w["ticket"] for w in state["waiters"]}
    later = events[starts[-1] + 1:]
    for event in later:
        op = event.get("op")
        ticket, rid = event.get("ticket"), event.get("id")
        if op == "enqueue":
            waiting.add(ticket)
        elif op == "abandon":
            waiting.discard(ticket)
        elif op == "grant":
            waiting.discard(ticket)
            record = _record(event)
            if record is not None:
                by_id[record["id"]] = record
        elif op in ("release", "reclaim"):
            by_id.pop(rid, None) if isinstance(rid, int) else None
        elif op == "attach" and isinstance(rid, int) and rid in by_id:
            pid, start = event.get("pid"), event.get("start")
            if _int(pid) > 0 and isinstance(start, int):
                by_id[rid]["pids"].append([pid, start])
        elif op == "capacity" and _int(event.get("capacity")) > 0:
            state["capacity"] = event["capacity"]
    state["reservations"] = sorted(by_id.values(), key=lambda r: r["id"])
    state["waiters"] = []
    state["next_seq"] = max([state["next_seq"]] + [e["seq"] + 1 for e in events])
    state["next_id"] = max([state["next_id"]] + [r["id"] + 1 for r in state["reservations"]]
                           + [_int(e.get("id")) + 1 for e in events if e.get("op") == "grant"])
    state["next_ticket"] = max([state["next_ticket"]] + [_int(e.get("ticket")) + 1 for e in events])
    after = [where for where, index in damaged if index > starts[-1]]
    problem = store.validate(state, paths.device)
    if problem:
        raise JournalUnusable(f"cannot rebuild {paths.state} from {paths.history}: {problem}")
    return state, sorted(t for t in waiting if isinstance(t, int)), after


def live_reservations_anywhere(paths: store.LedgerPaths) -> list[dict[str, Any]]:
    """Every reservation of a live process that any readable record mentions: each journal
    grant not released since, and the reservations in the (damaged) state file if they parse.

    For a reset, so that starting over never drops a process that still holds memory.
    """
    found: dict[int, dict[str, Any]] = {}
    try:
        events, _ = store.read_journal(paths, include_rotated=True)
    except LedgerError:
        events = []
    for event in events:
        op, rid = event.get("op"), event.get("id")
        if op == "snapshot" and isinstance(event.get("state"), dict):
            for raw in event["state"].get("reservations") or []:
                record = _record(raw) if isinstance(raw, dict) else None
                if record is not None:
                    found[record["id"]] = record
        elif op == "grant":
            record = _record(event)
            if record is not None:
                found[record["id"]] = record
        elif op in ("release", "reclaim") and isinstance(rid, int):
            found.pop(rid, None)
        elif op == "attach" and isinstance(rid, int) and rid in found and _int(event.get("pid")) > 0:
            found[rid]["pids"].append([event["pid"], _int(event.get("start"))])
    try:
        raw_state = store.read_raw_state(paths)
    except LedgerError:
        raw_state = None
    if isinstance(raw_state, dict) and isinstance(raw_state.get("reservations"), list):
        for raw in raw_state["reservations"]:
            record = _record(raw) if isinstance(raw, dict) else None
            if record is not None:
                found.setdefault(record["id"], record)
    return sorted((r for r in found.values() if holders_alive(r)), key=lambda r: r["id"])


# What `jaxmem run` gives each command it starts (see cli/run.py): the reservation and its share.
_RESERVATION_VAR = b"JAXMEM_RESERVATION="
_LEDGER_VAR = b"JAXMEM_LEDGER="
_FRACTION_VARS = (b"XLA_CLIENT_MEM_FRACTION=", b"XLA_PYTHON_CLIENT_MEM_FRACTION=")


def holders_from_environment(paths: store.LedgerPaths, capacity: int) -> list[dict[str, Any]]:
    """Reservations of live `jaxmem run` commands in this ledger (its directory and device),
    read from their environments: the last trace of a holder when no ledger record is left.

    Only environments this user may read are seen (root: all). The bytes are taken from the
    fraction the command was given, rounded up by the 6th decimal it was rounded down by, so
    a recovered reservation is never smaller than the real one.
    """
    found: dict[int, dict[str, Any]] = {}
    ledger = _LEDGER_VAR + os.fsencode(paths.state.parent)
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []
    for name in names:
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read(1 << 20).split(b"\0")
        except OSError:
            continue
        marker = next((v[len(_RESERVATION_VAR):] for v in environ if v.startswith(_RESERVATION_VAR)), None)
        fraction = next((v.split(b"=", 1)[1] for v in environ if v.startswith(_FRACTION_VARS)), None)
        if marker is None or fraction is None or ledger not in environ:
            continue
        where, _, rid = marker.partition(b":")
        try:
            if int(where) != paths.device:
                continue
            rid_number, share = int(rid), float(fraction)
        except ValueError:
            continue
        start = procinfo.start_time(int(name))
        if start is None or rid_number < 1 or not 0 < share <= 1:
            continue
        nbytes = min(capacity, math.ceil((share + 1e-6) * capacity))
        record = found.setdefault(rid_number, {"id": rid_number, "ticket": rid_number, "bytes": nbytes,
                                               "label": f"recovered from pid {name}", "since": time.time(),
                                               "pids": []})
        record["pids"].append([int(name), start])
    return sorted(found.values(), key=lambda r: r["id"])
