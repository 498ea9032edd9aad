"""Rebuild a damaged ledger from its journal, keeping the reservations whose processes live.

    report = repair(0)     # after "ledger .../device-0.json is corrupt"
    report["kept"]         # reservation ids still held by live processes

The journal (`device-N.history`) holds snapshots of the whole state and every grant, attach,
release and reclaim between them, so replaying it from its latest intact snapshot gives the
reservations as of the last completed change; damaged lines before that snapshot do not
matter. The damaged file is kept beside it as `device-N.json.corrupt-<time>`. Waiters are
dropped (a waiting process notices and queues again).

Nothing is forgotten silently, and no live holder is dropped that can be found: without a
usable journal only an explicit `reset=True` starts a new ledger, and even that keeps every
reservation of a live process that any readable record (journal line or damaged state file)
mentions, and every live `jaxmem run` command whose environment names one.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from jaxmem.errors import ConfigError, JournalUnusable, LedgerError
from jaxmem.share import store
from jaxmem.share.txn import (Txn, holders_alive, holders_from_environment, live_reservations_anywhere,
                              rebuild_from_journal, reclaim)


def repair(device: int, *, root: Path | None = None, reset: bool = False,
           capacity: int | None = None) -> dict[str, Any]:
    """Check device `device`'s ledger; rebuild it from the journal when it is damaged.

    Args:
        device: the GPU index.
        root: the state directory (default: `store.state_dir()`).
        reset: with no usable journal, start a new ledger of `capacity` bytes (live holders kept).
        capacity: the capacity for `reset`.

    Returns:
        {"device", "action": "ok" | "rebuilt" | "reset", "kept": [ids], "dropped": [ids],
         "moved_to": path of the damaged file or None, "skipped": damaged journal lines}.
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
            txn = Txn(paths, state)
            reclaim(txn)
            if txn.dirty:
                store.commit(paths, state, txn.events)
            return {"device": device, "action": "ok", "kept": [r["id"] for r in state["reservations"]],
                    "dropped": [e["id"] for e in txn.events if e["op"] == "reclaim"], "moved_to": None,
                    "skipped": []}
        if state is None and damage is None and not store.exists(paths.history) and not reset:
            raise LedgerError(f"device {device} has no ledger in {paths.state.parent}: nothing to repair")
        tickets: list[int] = []
        skipped: list[str] = []
        try:
            state, tickets, skipped = rebuild_from_journal(paths)
            action = "rebuilt"
        except JournalUnusable:
            if not reset:
                raise
            if capacity is None:
                raise ConfigError("--reset needs --capacity (the device's memory total)") from None
            state, action = _reset_state(paths, capacity), "reset"
        if skipped:
            # Lines after the snapshot were unreadable: a grant among them would be lost, so
            # also keep every live reservation any other record mentions.
            _merge(state, live_reservations_anywhere(paths))
            _merge(state, holders_from_environment(paths, state["capacity"]))
        _set_aside(paths, action)
        kept = [r for r in state["reservations"] if holders_alive(r)]
        dropped = [r for r in state["reservations"] if not holders_alive(r)]
        state["reservations"] = kept
        reserved = sum(r["bytes"] for r in kept)
        if reserved > state["capacity"]:
            raise LedgerError(f"device {device}: the live reservations found hold {reserved} bytes, more than "
                              f"the capacity {state['capacity']}; pass the device's real capacity")
        events = [{"op": "repair", "action": action, "kept": [r["id"] for r in kept],
                   "dropped": [r["id"] for r in dropped], "damaged": damage or "ledger file missing",
                   "skipped_lines": skipped[:20], "reserved": reserved}]
        events += [{"op": "abandon", "ticket": t, "reason": "dropped at repair", "reserved": reserved}
                   for t in tickets]
        events += [{"op": "reclaim", "id": r["id"], "ticket": r["ticket"], "bytes": r["bytes"], "pids": r["pids"],
                    "label": r["label"], "reason": "dead at repair", "reserved": reserved} for r in dropped]
        moved = _move_damaged(paths)
        store.commit(paths, state, events)
        store.write_snapshot(paths, state, reason=f"repair ({action})")
        store.commit(paths, state, [])
        return {"device": device, "action": action, "kept": [r["id"] for r in kept],
                "dropped": [r["id"] for r in dropped], "moved_to": str(moved) if moved else None,
                "skipped": skipped}


def _reset_state(paths: store.LedgerPaths, capacity: int) -> dict[str, Any]:
    """A new ledger holding every live reservation found anywhere (ids and tickets continue
    above every one seen, so nothing is handed out twice)."""
    state = store.new_state(paths.device, capacity)
    _merge(state, live_reservations_anywhere(paths))
    _merge(state, holders_from_environment(paths, capacity))
    return state


def _merge(state: dict[str, Any], found: list[dict[str, Any]]) -> None:
    have = {r["id"] for r in state["reservations"]}
    for record in found:
        if record["id"] not in have:
            state["reservations"].append(record)
            have.add(record["id"])
        state["next_id"] = max(state["next_id"], record["id"] + 1)
        state["next_ticket"] = max(state["next_ticket"], record["ticket"] + 1)
    state["reservations"].sort(key=lambda r: r["id"])


def _set_aside(paths: store.LedgerPaths, action: str) -> None:
    """After a reset, keep the unusable journal for a look; remove writers' leftovers."""
    stamp = time.strftime('%Y%m%dT%H%M%S')
    if action == "reset":
        for path in (paths.history, paths.history_old):
            if store.exists(path):
                os.replace(path, path.with_name(f"{path.name}.corrupt-{stamp}-{os.getpid()}"))
    for stale in paths.state.parent.glob(f"{paths.state.name}.tmp.*"):
        with contextlib.suppress(OSError):
            stale.unlink()  # left by writers killed mid-write (we hold the lock)


def _move_damaged(paths: store.LedgerPaths) -> Path | None:
    if not store.exists(paths.state):
        return None
    moved = paths.state.with_name(f"{paths.state.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(paths.state, moved)
    return moved
