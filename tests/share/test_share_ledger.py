"""The ledger in one process: amounts, capacity sources, refusals, FCFS across processes, and
accounting checked step by step against a brute-force model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from share_helpers import PYTHON, check_fcfs, isolated_env, journal, replay_totals

import jaxmem
from jaxmem.errors import ConfigError, LedgerError
from jaxmem.share import gpu, ledger, store
from jaxmem.units import GiB, MiB


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("JAXMEM_STATE_DIR", str(path))
    monkeypatch.setenv("JAXMEM_NVIDIA_SMI", "none")
    return path


def _fake_nvidia_smi(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return script


# --- amounts and capacity -------------------------------------------------------------------

def test_share_parse_amount() -> None:
    cap = 16 * GiB
    assert ledger.parse_amount("25%", cap) == 4 * GiB
    assert ledger.parse_amount(" 100 % ", cap) == cap
    assert ledger.parse_amount("0.5%", cap) == cap // 200 + (cap % 200 != 0)
    assert ledger.parse_amount("12GiB", cap) == 12 * GiB
    assert ledger.parse_amount(1234, cap) == 1234
    assert ledger.parse_amount("a100-40gb", cap) == 40960 * MiB  # a preset (too big: refused at reserve)
    for bad in ("0%", "101%", "-5%", "x%", "nan%", "12 apples", 0, -1, True):
        with pytest.raises(ConfigError):
            ledger.parse_amount(bad, cap)


def test_share_percentage_fraction_reads_back_exactly() -> None:
    from jaxmem.share.ledger import fraction_text
    for cap in (16 * GiB, 81559 * MiB, 143771 * MiB, 10**9 + 7):
        for pct in (1, 12.5, 30, 33, 50, 99.9, 100):
            nbytes = ledger.parse_amount(f"{pct}%", cap)
            text = fraction_text(nbytes, cap)
            assert float(text) * cap <= nbytes  # JAX's pool never exceeds what is reserved
            assert abs(float(text) - pct / 100) < 1e-6


def test_share_no_capacity_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="capacity is unknown"):
        jaxmem.reserve("1GiB")


def test_share_capacity_from_fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "args.txt"
    _fake_nvidia_smi(tmp_path / "bin", f"""\
        echo "$@" >> {log}
        case "$*" in *"-i 3"*) echo "81559" ;; *) echo "no such device" >&2; exit 6 ;; esac
        """)
    monkeypatch.delenv("JAXMEM_NVIDIA_SMI")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert gpu.query_capacity(3) == 81559 * MiB
    assert "--query-gpu=memory.total --format=csv,noheader,nounits -i 3" in log.read_text()
    with jaxmem.reserve("25%", device=3) as r:
        assert (r.capacity, r.bytes) == (81559 * MiB, 81559 * MiB // 4)
    with jaxmem.reserve("25%", device=3, capacity="h100-80gb") as r:  # agrees: 81559 MiB
        assert r.capacity == 81559 * MiB
    with pytest.raises(ConfigError, match="nvidia-smi reports 79.65 GiB for device 3"):
        jaxmem.reserve("1GiB", device=3, capacity="16GiB")
    with pytest.raises(ConfigError, match=r"nvidia-smi failed for device 0 \(exit 6\): no such device"):
        jaxmem.reserve("1GiB", device=0)


def test_share_status_lists_every_gpu_nvidia_smi_knows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvidia_smi(tmp_path / "bin", """\
        case "$*" in
          *index,memory.total*) printf '0, 16384\\n1, 81559\\n' ;;
          *"-i 0"*) echo 16384 ;;
          *"-i 1"*) echo 81559 ;;
        esac
        """)
    monkeypatch.delenv("JAXMEM_NVIDIA_SMI")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert gpu.list_capacities() == {0: 16 * GiB, 1: 81559 * MiB}
    with jaxmem.reserve("4GiB", device=1, label="on-one"):
        rows = {row["device"]: row for row in ledger.status()}
        assert (rows[0]["capacity"], rows[0]["free"], rows[0]["reservations"]) == (16 * GiB, 16 * GiB, [])
        assert (rows[1]["capacity"], rows[1]["reserved"]) == (81559 * MiB, 4 * GiB)


def test_share_parse_memory_total() -> None:
    assert gpu.parse_memory_total("16384\n", 0) == 16 * GiB
    assert gpu.parse_memory_total("  143771 MiB \n", 0) == 143771 * MiB
    for bad in ("", "16384\n16384\n", "N/A", "[Not Supported]", "0"):
        with pytest.raises(ConfigError):
            gpu.parse_memory_total(bad, 0)


def test_share_capacity_change_refused_while_held() -> None:
    with jaxmem.reserve("1GiB", capacity="16GiB"):
        with pytest.raises(LedgerError, match="records capacity 16.00 GiB, not 8.00 GiB"):
            jaxmem.reserve("1GiB", capacity="8GiB")
        with jaxmem.reserve("1GiB") as same:  # no capacity given: the ledger's
            assert same.capacity == 16 * GiB
    with jaxmem.reserve("1GiB", capacity="8GiB") as r:  # nothing held: the capacity may change
        assert r.capacity == 8 * GiB


def test_share_bad_arguments() -> None:
    for kwargs in ({"device": -1}, {"device": "0"}, {"wait": -1}, {"wait": "soon"}, {"wait": float("nan")}):
        with pytest.raises(ConfigError):
            jaxmem.reserve("1GiB", capacity="16GiB", **kwargs)
    with pytest.raises(LedgerError, match="exceeds the whole device"):
        jaxmem.reserve("17GiB", capacity="16GiB")


# --- granting and refusing -------------------------------------------------------------------

def test_share_reserve_release_and_journal(state: Path) -> None:
    with jaxmem.reserve("30%", capacity="16GiB", label="first") as a:
        assert abs(a.fraction - 0.3) < 1e-9 and a.fraction_text == "0.3"
        b = jaxmem.reserve("8GiB", label="second")
        rows = ledger.status()
        assert rows[0]["reserved"] == a.bytes + b.bytes and rows[0]["free"] == 16 * GiB - a.bytes - b.bytes
        assert {r["label"] for r in rows[0]["reservations"]} == {"first", "second"}
        assert rows[0]["reservations"][0]["pids"] == [os.getpid()]
        assert b.release() is True and b.release() is False
    assert ledger.status()[0]["reserved"] == 0
    events = journal(state)
    assert [e["op"] for e in events] == ["snapshot", "grant", "grant", "release", "release"]
    assert replay_totals(events) == [0, a.bytes, a.bytes + b.bytes, a.bytes, 0]


def test_share_refusal_lists_holders() -> None:
    with jaxmem.reserve("12GiB", capacity="16GiB", label="trainer"):
        start = time.monotonic()
        with pytest.raises(LedgerError) as err:
            jaxmem.reserve("6GiB")
        assert time.monotonic() - start < 1
        text = str(err.value)
        assert "\n" not in text
        assert f"pid {os.getpid()} 'trainer' 12.00 GiB since" in text
        assert "cannot reserve 6.00 GiB now (4.00 GiB free of 16.00 GiB)" in text


def test_share_wait_times_out_and_leaves_the_queue(state: Path) -> None:
    # The holder is another process, so this one's request could in principle be granted.
    holder = _spawn_holder(state, "12GiB", "other")
    try:
        start = time.monotonic()
        with pytest.raises(LedgerError, match=r"cannot reserve 6.00 GiB within 0.6 s .* 'other' 12.00 GiB"):
            jaxmem.reserve("6GiB", wait=0.6)
        assert 0.55 < time.monotonic() - start < 5
        assert ledger.status()[0]["waiters"] == []
        assert [e["reason"] for e in journal(state) if e["op"] == "abandon"] == ["timeout"]
    finally:
        holder.kill()
        holder.wait()


def test_share_self_deadlock_is_refused_at_once() -> None:
    with jaxmem.reserve("12GiB", capacity="16GiB"):
        start = time.monotonic()
        with pytest.raises(LedgerError, match="can never be granted while this process itself holds 12.00 GiB"):
            jaxmem.reserve("6GiB", wait=30)
        assert time.monotonic() - start < 1


def _spawn_holder(state: Path, amount: str, label: str, wait: float | None = None, extra: str = "") -> subprocess.Popen:
    """A process that reserves, prints one JSON line, then sleeps until killed or stdin closes."""
    code = textwrap.dedent(f"""\
        import json, sys, time, jaxmem
        r = jaxmem.reserve({amount!r}, capacity="16GiB", wait={wait!r}, label={label!r})
        print(json.dumps({{"id": r.id, "ticket": r.ticket, "t": time.monotonic()}}), flush=True)
        {extra}
        sys.stdin.read()
        """)
    proc = subprocess.Popen([PYTHON, "-c", code], env=isolated_env(state), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if wait is None:
        line = proc.stdout.readline()
        assert line, "holder failed to reserve"
    return proc


def _wait_for_waiters(n: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while len(ledger.status()[0]["waiters"]) < n:
        assert time.monotonic() < deadline, "waiters never queued"
        time.sleep(0.02)


def test_share_first_come_first_served(state: Path) -> None:
    """A small later request does not overtake an earlier big one, though it would fit."""
    holder = _spawn_holder(state, "10GiB", "holder")
    big = _spawn_holder(state, "8GiB", "big", wait=30)
    _wait_for_waiters(1)
    small = _spawn_holder(state, "2GiB", "small", wait=30)  # 6 GiB are free: it would fit
    _wait_for_waiters(2)
    time.sleep(0.6)  # a few liveness rounds: still nobody overtakes
    assert [w["label"] for w in ledger.status()[0]["waiters"]] == ["big", "small"]
    holder.stdin.close()
    holder.wait(timeout=20)
    got_big, got_small = json.loads(big.stdout.readline()), json.loads(small.stdout.readline())
    assert got_big["ticket"] < got_small["ticket"]
    # the order of the grants is the journal's (below): two processes woken by grants made
    # microseconds apart may read their clocks in either order on a loaded machine
    for p in (big, small):
        p.stdin.close()
        p.wait(timeout=20)
    events = journal(state)
    assert [e["label"] for e in events if e["op"] == "grant"] == ["holder", "big", "small"]
    assert check_fcfs(events) == 2
    assert max(replay_totals(events)) <= 16 * GiB


# --- accounting against a brute-force model ----------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("reserve"), st.integers(1, 9 * 1024)),
                          st.tuples(st.just("release"), st.integers(0, 20))), max_size=25))
def test_share_accounting_matches_model(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    """Any sequence of reserve/release agrees with a list-of-holdings model at every step."""
    os.environ["JAXMEM_STATE_DIR"] = str(tmp_path_factory.mktemp("model"))
    cap = 16 * GiB
    jaxmem.reserve(1, capacity=cap).release()  # create the ledger
    held: list = []  # (Reservation, bytes)
    for op, arg in ops:
        if op == "reserve":
            nbytes = arg * MiB
            fits = sum(b for _, b in held) + nbytes <= cap
            try:
                r = jaxmem.reserve(nbytes, capacity=cap)
            except LedgerError:
                assert not fits
            else:
                assert fits
                held.append((r, nbytes))
        elif held:
            r, _ = held.pop(arg % len(held))
            assert r.release()
        row = ledger.status()[0]
        assert row["reserved"] == sum(b for _, b in held) <= cap
        assert sorted(x["id"] for x in row["reservations"]) == sorted(r.id for r, _ in held)
        assert store.validate(store.load(store.paths_for(0)), 0) is None
    for r, _ in held:
        r.release()
    events = journal(Path(os.environ["JAXMEM_STATE_DIR"]))
    assert replay_totals(events)[-1] == 0
