"""Rebuild a damaged ledger from its journal, keeping the reservations whose processes live.

    report = repair(0)     # after "ledger .../device-0.json is corrupt"
    report["kept"]         # reservation ids still held by live processes

The journal (`device-N.history`) begins with a snapshot of the whole state and records every
grant, attach, release and reclaim after it, so replaying it gives the reservations as of the
last completed change. The damaged file is kept beside it as `device-N.json.corrupt-<time>`.
Waiters are dropped (a waiting process notices and queues again). Nothing is forgotten
silently: without a usable journal, only an explicit `reset=True` starts an empty ledger.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from jaxmem.errors import ConfigError, LedgerError
from jaxmem.share import procinfo, store


def rebuild_from_journal(paths: store.LedgerPaths) -> tuple[dict[str, Any], list[int]]:
    """The state the journal describes: its last snapshot with every later change applied.

    Call with the lock held. Returns (state, tickets of the requests that were waiting): waiters
    are not restored, since the processes still waiting notice and queue again; the caller
    journals their old tickets as given up. Raises LedgerError when the journal has no
    snapshot to start from.
    """
    events = store.read_history(paths, include_rotated=False)
    starts = [i for i, e in enumerate(events) if e.get("op") == "snapshot" and isinstance(e.get("state"), dict)]
    if not starts:
        raise LedgerError(f"cannot rebuild {paths.state}: journal {paths.history} has no snapshot to start from; "
                          f"`jaxmem share repair --device {paths.device} --reset --capacity SIZE` starts an empty "
                          "ledger (any reservations in it are forgotten)")
    state = events[starts[-1]]["state"]
    by_id = {r["id"]: r for r in state.get("reservations", [])}
    waiting = {w["ticket"] for w in state.get("waiters", [])}
    for event in events[starts[-1] + 1:]:
        op = event.get("op")
        if op == "enqueue":
            waiting.add(event["ticket"])
        elif op == "abandon":
            waiting.discard(event["ticket"])
        if op == "grant":
            waiting.discard(event["ticket"])
            by_id[event["id"]] = {k: event[k] for k in ("id", "ticket", "bytes", "label", "since", "pids")}
        elif op in ("release", "reclaim"):
            by_id.pop(event.get("id"), None)
        elif op == "attach" and event.get("id") in by_id:
            by_id[event["id"]]["pids"].append([event["pid"], event["start"]])
        elif op == "capacity":
            state["capacity"] = event["capacity"]
    state["reservations"] = sorted(by_id.values(), key=lambda r: r["id"])
    state["waiters"] = []
    last_seq = max(e["seq"] for e in events)
    state["next_seq"] = max(state.get("next_seq", 1), last_seq + 1)
    state["next_id"] = max([state.get("next_id", 1)] + [r["id"] + 1 for r in state["reservations"]]
                           + [e["id"] + 1 for e in events if e.get("op") == "grant"])
    state["next_ticket"] = max([state.get("next_ticket", 1)]
                               + [e["ticket"] + 1 for e in events if isinstance(e.get("ticket"), int)])
    problem = store.validate(state, paths.device)
    if problem:
        raise LedgerError(f"cannot rebuild {paths.state} from {paths.history}: {problem}")
    return state, sorted(waiting)


def repair(device: int, *, root: Path | None = None, reset: bool = False,
           capacity: int | None = None) -> dict[str, Any]:
    """Check device `device`'s ledger; rebuild it from the journal when it is damaged.

    Args:
        device: the GPU index.
        root: the state directory (default: `store.state_dir()`).
        reset: with no usable journal, start an empty ledger of `capacity` bytes.
        capacity: the capacity for `reset`.

    Returns:
        {"device", "action": "ok" | "rebuilt" | "reset", "kept": [ids], "dropped": [ids],
         "moved_to": path of the damaged file or None}.
    """
    paths = store.paths_for(device, root)
    with store.locked(paths):
        try:
            state = store.load(paths)
            damage = None
        except LedgerError as err:
            state, damage = None, str(err)
        if damage is None and state is not None:
            # Healthy: repairing it is just an access (reclaim the dead).
            from jaxmem.share.ledger import _reclaim, _Txn
            txn = _Txn(paths, state)
            _reclaim(txn)
            if txn.dirty:
                store.commit(paths, state, txn.events)
            return {"device": device, "action": "ok", "kept": [r["id"] for r in state["reservations"]],
                    "dropped": [e["id"] for e in txn.events if e["op"] == "reclaim"], "moved_to": None}
        if state is None and damage is None and not paths.history.exists() and not reset:
            raise LedgerError(f"device {device} has no ledger in {paths.state.parent}: nothing to repair")
        tickets: list[int] = []
        try:
            state, tickets = rebuild_from_journal(paths)
            action = "rebuilt"
        except LedgerError as err:
            if not reset:
                if "--reset" in str(err):
                    raise
                raise LedgerError(f"{err}; `jaxmem share repair --device {device} --reset --capacity SIZE` "
                                  "starts an empty ledger (its reservations are forgotten)") from None
            if capacity is None:
                raise ConfigError("--reset needs --capacity (the device's memory total)") from None
            state, action = store.new_state(device, capacity), "reset"
            if paths.history.exists():
                os.replace(paths.history, paths.history.with_name(paths.history.name + f".corrupt-{int(time.time())}"))
        for stale in paths.state.parent.glob(f"{paths.state.name}.tmp.*"):
            stale.unlink(missing_ok=True)  # left by writers killed mid-write (we hold the lock)
        moved = None
        if paths.state.exists():
            moved = paths.state.with_name(f"{paths.state.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            os.replace(paths.state, moved)
        kept, dropped = [], []
        for record in state["reservations"]:
            alive = any(procinfo.is_alive(pid, start) for pid, start in record["pids"])
            (kept if alive else dropped).append(record)
        state["reservations"] = kept
        events = [{"op": "repair", "action": action, "kept": [r["id"] for r in kept],
                   "dropped": [r["id"] for r in dropped], "damaged": damage or "ledger file missing",
                   "reserved": sum(r["bytes"] for r in kept)}]
        events += [{"op": "abandon", "ticket": t, "reason": "dropped at repair", "reserved": events[0]["reserved"]}
                   for t in tickets]
        events += [{"op": "reclaim", "id": r["id"], "ticket": r["ticket"], "bytes": r["bytes"], "pids": r["pids"],
                    "label": r["label"], "reason": "dead at repair", "reserved": events[0]["reserved"]} for r in dropped]
        store.commit(paths, state, events)
        store.write_snapshot(paths, state, reason=f"repair ({action})")
        store.commit(paths, state, [])
        return {"device": device, "action": action, "kept": [r["id"] for r in kept],
                "dropped": [r["id"] for r in dropped], "moved_to": str(moved) if moved else None}
