"""Reserve a share of a GPU's memory in a node-local ledger, so processes sharing it do not race.

    with jaxmem.reserve("30%", capacity="16GiB", wait=60, label="train") as r:
        print(r.bytes, r.fraction_text)   # 5153960756 0.3 -- give JAX this fraction

Every process that means to use part of device N first reserves its share here. The ledger is a
file per device (see `jaxmem.share.store`) changed only under an exclusive lock; no daemon runs.

Policy:
- A reservation is granted when it fits (reserved + amount <= capacity) AND no earlier request is
  still waiting: strictly first come, first served. Each request that waits takes a ticket; only
  the lowest live ticket may be granted, so a small later request never overtakes an earlier big
  one (it waits behind it; that is the price of no starvation).
- `wait=None` fails at once when the request cannot be granted now; `wait=S` waits up to S
  seconds (`math.inf`: for ever). On failure the error lists who holds what.
- A reservation belongs to a set of processes (pid plus start time, so a reused pid is not
  mistaken for its predecessor) and lives while any of them does. A reservation or waiter
  whose processes are all gone is reclaimed at the next access by anyone. `attach(pid)` adds a
  process (`jaxmem run` adds the command it starts).
- The amount is bytes, a size string ("12GiB") or a percentage of the capacity ("30%").
- The capacity is the GPU's memory total from nvidia-smi where nvidia-smi exists; else the
  `capacity` argument (bytes, "80GiB" or a preset such as "h100-80gb"), else the capacity the
  ledger already records.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from jaxmem.errors import ConfigError, LedgerCorrupt, LedgerError, quote
from jaxmem.share import gpu, procinfo, store
from jaxmem.share.txn import Txn, reserved_bytes, transaction
from jaxmem.units import format_size, parse_size

# A waiter wakes when its doorbell rings, and at least every LIVENESS_S to check that holders
# and earlier waiters are alive (a process that died changes no file and rings no bell).
LIVENESS_S = 0.25


def parse_amount(amount: int | str, capacity: int) -> int:
    """Bytes from an amount: bytes, "12GiB", a preset, or a percentage of `capacity` ("30%").

    >>> parse_amount("25%", 16 * 2**30) == 4 * 2**30
    True

    Args:
        amount: what the user asked for.
        capacity: the device's memory total in bytes.

    Returns:
        the bytes to reserve (a percentage rounds up to a whole byte).
    """
    if isinstance(amount, str) and amount.strip().endswith("%"):
        text = amount.strip()[:-1].strip()
        try:
            percent = float(text)
        except ValueError:
            raise ConfigError(f"cannot read amount {amount!r}: use bytes, '12GiB' or a percentage like '30%'") from None
        if not 0 < percent <= 100 or not math.isfinite(percent):
            raise ConfigError(f"percentage must be in (0, 100], got {amount!r}")
        # Rounded up to a whole byte, so the fraction handed to JAX reads back as the percentage.
        nbytes = min(capacity, math.ceil(capacity * percent / 100))
        if nbytes < 1:
            raise ConfigError(f"{amount!r} of {capacity} bytes is less than one byte")
        return nbytes
    return parse_size(amount)


def resolve_capacity(device: int, capacity: int | str | None) -> int | None:
    """The capacity to use: nvidia-smi's memory total where it exists, else `capacity`.

    An explicit capacity that disagrees with nvidia-smi is an error rather than a silent choice.
    None means "unknown": the ledger's own record is used, if there is one.
    """
    given = parse_size(capacity) if capacity is not None else None
    measured = gpu.query_capacity(device)
    if measured is None:
        return given
    if given is not None and given != measured:
        raise ConfigError(f"nvidia-smi reports {format_size(measured)} for device {device} but capacity "
                          f"{capacity!r} is {format_size(given)}; drop the capacity argument")
    return measured


def fraction_text(nbytes: int, capacity: int) -> str:
    """nbytes/capacity as a decimal string for JAX's memory fraction, rounded DOWN to 6 places
    so that JAX's pool never exceeds the reservation.

    >>> fraction_text(3, 10), fraction_text(10, 10)
    ('0.3', '1')
    """
    micro = nbytes * 1_000_000 // capacity  # exact integer arithmetic: never rounds up
    if micro == 0:
        raise ConfigError(f"{nbytes} bytes is under a millionth of the device; reserve more")
    return f"{micro // 1_000_000}.{micro % 1_000_000:06d}".rstrip("0").rstrip(".")


class Reservation:
    """A granted share of one device. A context manager: leaving the block releases it.

    Attributes: `device`, `id`, `bytes`, `capacity`, `label`, `ticket`; `fraction` is
    bytes / capacity, the number to give JAX as its memory fraction.
    """

    def __init__(self, paths: store.LedgerPaths, record: dict[str, Any], capacity: int) -> None:
        self._paths = paths
        self.device = paths.device
        self.id: int = record["id"]
        self.ticket: int = record["ticket"]
        self.bytes: int = record["bytes"]
        self.label: str = record["label"]
        self.capacity = capacity
        self.released = False

    @property
    def ledger_dir(self) -> Path:
        """The state directory this reservation's ledger lives in."""
        return self._paths.state.parent

    @property
    def fraction(self) -> float:
        return self.bytes / self.capacity

    @property
    def fraction_text(self) -> str:
        """The fraction to give JAX (XLA_CLIENT_MEM_FRACTION), rounded down: "0.3" for 30%."""
        return fraction_text(self.bytes, self.capacity)

    def attach(self, pid: int) -> None:
        """Make process `pid` a holder too: the reservation lives while any holder lives."""
        ident = procinfo.identity(pid)
        with transaction(self.device, self._paths.state.parent) as txn:
            record = _find(txn.state, self.id)
            if record is None:
                raise LedgerError(f"reservation {self.id} on device {self.device} is no longer in the ledger")
            if list(ident) not in record["pids"]:
                record["pids"].append(list(ident))
                txn.log(op="attach", id=self.id, pid=ident[0], start=ident[1])

    def release(self) -> bool:
        """Give the memory back. Returns False when it was already gone (released or repaired away)."""
        if self.released:
            return False
        self.released = True
        with transaction(self.device, self._paths.state.parent) as txn:
            record = _find(txn.state, self.id)
            if record is None:
                return False
            txn.state["reservations"].remove(record)
            txn.log(op="release", id=self.id, ticket=self.ticket, bytes=self.bytes)
        return True

    def __enter__(self) -> "Reservation":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"Reservation(device={self.device}, id={self.id}, bytes={self.bytes}, "
                f"fraction={self.fraction:.4f}, label={self.label!r})")


def _find(state: dict[str, Any] | None, rid: int) -> dict[str, Any] | None:
    for record in (state or {}).get("reservations", []):
        if record["id"] == rid:
            return record
    return None


def _default_label() -> str:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    return os.path.basename(argv0) if argv0 not in ("", "-c", "-m") else f"python{' ' + argv0 if argv0 else ''}"


def _check_device(device: Any) -> int:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ConfigError(f"device must be a GPU index (0, 1, ...), got {device!r}")
    return device


def _check_wait(wait: Any) -> float | None:
    if wait is None:
        return None
    try:
        seconds = float(wait)
    except (TypeError, ValueError):
        raise ConfigError(f"wait must be seconds or None, got {wait!r}") from None
    if math.isnan(seconds) or seconds < 0:
        raise ConfigError(f"wait must be seconds >= 0 or None, got {wait!r}")
    return seconds if seconds > 0 else None


def _my_turn(state: dict[str, Any], ticket: int, nbytes: int) -> bool:
    """FCFS: only the lowest waiting ticket may be granted, and only when it fits."""
    waiting = [w["ticket"] for w in state["waiters"]]
    return bool(waiting) and min(waiting) == ticket and reserved_bytes(state) + nbytes <= state["capacity"]


def _grant(txn: Txn, ticket: int, nbytes: int, label: str, me: tuple[int, int]) -> Reservation:
    state = txn.state
    state["waiters"] = [w for w in state["waiters"] if w["ticket"] != ticket]
    record = {"id": state["next_id"], "ticket": ticket, "bytes": nbytes, "label": label,
              "since": time.time(), "pids": [list(me)]}
    state["next_id"] += 1
    state["reservations"].append(record)
    txn.log(op="grant", **record)
    return Reservation(txn.paths, record, state["capacity"])


def _enqueue(txn: Txn, nbytes: int, label: str, me: tuple[int, int], requeued: bool = False) -> tuple[int, int]:
    """Queue a request; returns its ticket and the read end of its doorbell."""
    state = txn.state
    ticket = state["next_ticket"]
    state["next_ticket"] += 1
    bell = store.open_bell(txn.paths, ticket)  # before the commit that may ring it
    state["waiters"].append({"ticket": ticket, "bytes": nbytes, "label": label, "since": time.time(),
                             "pid": me[0], "start": me[1]})
    txn.log(op="enqueue", ticket=ticket, bytes=nbytes, pid=me[0], label=label, **({"requeued": True} if requeued else {}))
    return ticket, bell


def describe_holders(state: dict[str, Any], *, before_ticket: int | None = None) -> str:
    """Who holds what, on one line: "pid 12 'train' 8.00 GiB since 16:01:02; ...", then the queue."""
    parts = []
    for r in sorted(state["reservations"], key=lambda r: r["since"]):
        pids = ",".join(str(p) for p, _ in r["pids"])
        parts.append(f"pid {pids} {quote(r['label'])} {format_size(r['bytes'])} since "
                     f"{time.strftime('%H:%M:%S', time.localtime(r['since']))}")
    held = "; ".join(parts) if parts else "nobody"
    queue = [w for w in sorted(state["waiters"], key=lambda w: w["ticket"])
             if before_ticket is None or w["ticket"] < before_ticket]
    if queue:
        held += "; queued ahead: " + "; ".join(f"pid {w['pid']} {quote(w['label'])} {format_size(w['bytes'])}" for w in queue)
    return held


def _busy_message(state: dict[str, Any], nbytes: int, waited: float | None, ticket: int | None = None) -> str:
    free = state["capacity"] - reserved_bytes(state)
    when = f"within {waited:g} s" if waited is not None else "now"
    ahead = [w for w in state["waiters"] if ticket is None or w["ticket"] < ticket]
    queue = f", {len(ahead)} earlier request(s) waiting" if ahead else ""
    return (f"device {state['device']}: cannot reserve {format_size(nbytes)} {when} "
            f"({format_size(free)} free of {format_size(state['capacity'])}{queue}); "
            f"held by: {describe_holders(state, before_ticket=ticket)}")


def reserve(amount: int | str, *, device: int = 0, capacity: int | str | None = None,
            wait: float | None = None, label: str | None = None) -> Reservation:
    """Reserve part of a GPU's memory for this process; use it as a context manager.

    ```python
    with jaxmem.reserve("12GiB", device=0, wait=60, label="eval") as r:
        os.environ["XLA_CLIENT_MEM_FRACTION"] = r.fraction_text  # before JAX starts
        ...
    ```

    First come, first served: a request that cannot be granted at once queues behind every
    earlier waiting request, even a bigger one. The reservation is taken when `reserve`
    returns and given back when the `with` block ends, `release()` is called, or every
    process holding it has exited.

    Args:
        amount: bytes, a size ("12GiB") or a percentage of the capacity ("30%").
        device: the GPU index (as nvidia-smi numbers them).
        capacity: the device's memory total (bytes, "80GiB", or a preset like "h100-80gb"); only
            needed where nvidia-smi is missing and the device has no ledger yet.
        wait: seconds to wait for the memory; None fails at once; `math.inf` waits for ever.
        label: a name shown to others (default: the program's name).

    Returns:
        the granted `Reservation`. Raises LedgerError (who holds what) when it cannot be had
        in time, ConfigError for a bad amount, device or capacity.
    """
    device = _check_device(device)
    wait = _check_wait(wait)
    label = (_default_label() if label is None else str(label))[:store.LABEL_MAX]
    capacity_bytes = resolve_capacity(device, capacity)
    me = procinfo.identity(os.getpid())
    failure: LedgerError | None = None
    ticket = bell = None
    handed_over = False
    try:
        with transaction(device, None, capacity_bytes) as txn:
            state = txn.state
            nbytes = parse_amount(amount, state["capacity"])
            free = state["capacity"] - reserved_bytes(state)
            mine = sum(r["bytes"] for r in state["reservations"] if any(p == me[0] for p, _ in r["pids"]))
            if nbytes > state["capacity"]:
                failure = LedgerError(f"device {device}: {format_size(nbytes)} exceeds the whole device "
                                      f"({format_size(state['capacity'])})")
            elif not state["waiters"] and nbytes <= free:
                return _grant(txn, _take_ticket(state), nbytes, label, me)
            elif wait is None:
                failure = LedgerError(_busy_message(state, nbytes, None))
            elif nbytes > state["capacity"] - mine:
                failure = LedgerError(f"device {device}: {format_size(nbytes)} can never be granted while this "
                                      f"process itself holds {format_size(mine)} of {format_size(state['capacity'])}")
            else:
                ticket, bell = _enqueue(txn, nbytes, label, me)
        if failure is not None:
            raise failure
        handed_over = True  # from here _wait_for_turn owns the bell and cleans up after itself
        return _wait_for_turn(txn.paths, ticket, bell, nbytes, label, me, wait)
    except BaseException:
        # An interrupt between queueing and waiting must not leave a live process in the queue.
        if ticket is not None:
            _withdraw(device, None, ticket, nbytes, me)  # a no-op when already withdrawn
            if not handed_over:
                store.close_bell(store.paths_for(device), ticket, bell)
        raise


def _take_ticket(state: dict[str, Any]) -> int:
    ticket = state["next_ticket"]
    state["next_ticket"] += 1
    return ticket


def _wait_for_turn(paths: store.LedgerPaths, ticket: int, bell: int, nbytes: int, label: str,
                   me: tuple[int, int], wait: float) -> Reservation:
    """Wait until `ticket` is first in the queue and fits, or `wait` seconds pass.

    Between attempts the waiter sleeps on its doorbell, which the process making the next
    change rings; it also wakes every LIVENESS_S to reclaim holders that died (a dead process
    changes no file and rings no bell).
    """
    device, root = paths.device, paths.state.parent
    deadline = time.monotonic() + wait
    try:
        while True:
            message = None
            idle = _nothing_to_do(paths, ticket, nbytes) if time.monotonic() < deadline else None
            if idle is not None:
                select.select([bell], [], [], max(0.0, min(idle, deadline - time.monotonic())))
                store.drain_bell(bell)
                continue
            try:
                with transaction(device, root) as txn:
                    if not any(w["ticket"] == ticket for w in txn.state["waiters"]):
                        # Our entry is gone (the ledger was repaired): queue again, at the back.
                        store.close_bell(paths, ticket, bell)
                        bell = None
                        ticket, bell = _enqueue(txn, nbytes, label, me, requeued=True)
                    if _my_turn(txn.state, ticket, nbytes):
                        return _grant(txn, ticket, nbytes, label, me)
                    if time.monotonic() >= deadline:
                        message = _busy_message(txn.state, nbytes, wait, ticket)
                        txn.state["waiters"] = [w for w in txn.state["waiters"] if w["ticket"] != ticket]
                        txn.log(op="abandon", ticket=ticket, bytes=nbytes, pid=me[0], reason="timeout")
            except LedgerCorrupt:
                # Keep waiting: someone may run `jaxmem share repair` meanwhile. Out of time, say so.
                if time.monotonic() >= deadline:
                    raise
            if message is not None:
                raise LedgerError(message)
            remaining = deadline - time.monotonic()
            select.select([bell], [], [], max(0.0, min(LIVENESS_S, remaining)))
            store.drain_bell(bell)
    except BaseException:
        _withdraw(device, root, ticket, nbytes, me)
        raise
    finally:
        store.close_bell(paths, ticket, bell)


def _nothing_to_do(paths: store.LedgerPaths, ticket: int, nbytes: int) -> float | None:
    """A look without the lock. When taking the lock would change nothing (we are queued, it is
    not our turn, and the processes we watch are alive), returns how long to sleep before the
    next look unless the bell rings; else None.

    Only the first waiter watches the holders (a dead holder frees memory only it can use);
    each later waiter watches just the one ahead of it, and less often. So a long queue costs
    each look one /proc read instead of one per entry, and no waiter queues on the lock to learn
    nothing. Dead waiters are also swept by every change anyone makes.
    """
    try:
        peek = store.load(paths)
    except LedgerError:
        return None
    if peek is None or _my_turn(peek, ticket, nbytes):
        return None
    ahead = [w for w in peek["waiters"] if w["ticket"] < ticket]
    if not any(w["ticket"] == ticket for w in peek["waiters"]):
        return None
    if not ahead:
        alive = all(any(procinfo.is_alive(p, s) for p, s in r["pids"]) for r in peek["reservations"])
        return LIVENESS_S if alive else None
    previous = max(ahead, key=lambda w: w["ticket"])
    return 4 * LIVENESS_S if procinfo.is_alive(previous["pid"], previous["start"]) else None


def _withdraw(device: int, root: Path, ticket: int, nbytes: int, me: tuple[int, int]) -> None:
    """Leave the queue after an interrupt or error, so a live process never blocks it."""
    with contextlib.suppress(LedgerError, ConfigError, OSError):
        with transaction(device, root) as txn:
            if any(w["ticket"] == ticket for w in txn.state["waiters"]):
                txn.state["waiters"] = [w for w in txn.state["waiters"] if w["ticket"] != ticket]
                txn.log(op="abandon", ticket=ticket, bytes=nbytes, pid=me[0], reason="interrupted")


def status(root: Path | None = None) -> list[dict[str, Any]]:
    """Every known device's capacity, reserved and free bytes, reservations and queue.

    Devices come from the ledgers in the state directory plus, where nvidia-smi exists, every
    GPU it lists. Reading is an access: dead holders are reclaimed first. A corrupt ledger gives
    a row with an `error` instead of failing the rest.
    """
    totals = gpu.list_capacities()
    rows = []
    for device in sorted(set(store.devices_in(root)) | set(totals)):
        try:
            with transaction(device, root, create=False) as txn:
                state = txn.state
        except LedgerError as err:
            rows.append({"device": device, "error": str(err)})
            continue
        if state is None:
            state = store.new_state(device, totals[device]) if device in totals else None
        if state is None:
            continue
        reserved = reserved_bytes(state)
        rows.append({
            "device": device, "capacity": state["capacity"], "reserved": reserved,
            "free": state["capacity"] - reserved,
            "reservations": [{"id": r["id"], "pids": [p for p, _ in r["pids"]], "label": r["label"],
                              "bytes": r["bytes"], "since": r["since"]} for r in state["reservations"]],
            "waiters": [{"ticket": w["ticket"], "pid": w["pid"], "label": w["label"], "bytes": w["bytes"],
                         "since": w["since"]} for w in sorted(state["waiters"], key=lambda w: w["ticket"])],
        })
    return rows
