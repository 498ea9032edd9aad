"""Crash safety: killed holders and waiters are reclaimed, reused pids are seen through, and a
damaged ledger is refused with a repair path that keeps the reservations of live processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from share_helpers import PYTHON, isolated_env, jaxmem_cmd, journal, replay_totals, run_cli

import jaxmem
from jaxmem.errors import LedgerError
from jaxmem.share import ledger, procinfo, repair, store
from jaxmem.units import GiB


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("JAXMEM_STATE_DIR", str(path))
    monkeypatch.setenv("JAXMEM_NVIDIA_SMI", "none")
    return path


def _holder(state: Path, amount: str, label: str, wait: float | None = None) -> subprocess.Popen:
    code = textwrap.dedent(f"""\
        import json, sys, jaxmem
        r = jaxmem.reserve({amount!r}, capacity="16GiB", wait={wait!r}, label={label!r})
        print(json.dumps({{"id": r.id}}), flush=True)
        sys.stdin.read()
        """)
    proc = subprocess.Popen([PYTHON, "-c", code], env=isolated_env(state), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if wait is None:
        assert proc.stdout.readline(), "holder failed to reserve"
    return proc


def _kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


# --- process identity ---------------------------------------------------------------------

def test_share_procinfo_start_times(tmp_path: Path) -> None:
    ticks_now = float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")
    me = procinfo.start_time(os.getpid())
    assert me is not None and 0 < me <= ticks_now
    # A name with spaces and parentheses must not shift the fields (comm is parsed after the last ')').
    odd = tmp_path / "we ird) (na me"
    odd.symlink_to(shutil.which("sleep"))
    child = subprocess.Popen([str(odd), "30"])
    try:
        assert "(na me" in Path(f"/proc/{child.pid}/stat").read_text()
        start = procinfo.start_time(child.pid)
        assert start is not None and me <= start <= ticks_now + 1000
        assert procinfo.is_alive(child.pid, start)
        assert not procinfo.is_alive(child.pid, start + 1)  # same pid, other process: reused
    finally:
        child.kill()
        child.wait()
    assert procinfo.start_time(child.pid) is None


def test_share_zombie_counts_as_dead() -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while "Z" not in Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert procinfo.start_time(child.pid) is None  # exited but not reaped: its memory is gone
    child.wait()


# --- reclaiming -------------------------------------------------------------------------------

def test_share_sigkilled_holders_are_reclaimed_at_next_access(state: Path) -> None:
    holders = [_holder(state, "4GiB", f"h{i}") for i in range(3)]
    assert ledger.status()[0]["reserved"] == 12 * GiB
    for proc in holders[:2]:
        _kill9(proc)
    # The next access (a reservation that needs their memory) reclaims them and succeeds at once.
    with jaxmem.reserve("12GiB", capacity="16GiB") as r:
        assert r.bytes == 12 * GiB
    reclaimed = [e for e in journal(state) if e["op"] == "reclaim"]
    assert sorted(e["label"] for e in reclaimed) == ["h0", "h1"]
    assert {e["reason"] for e in reclaimed} == {"dead"}
    assert [x["label"] for x in ledger.status()[0]["reservations"]] == ["h2"]
    holders[2].stdin.close()
    holders[2].wait(timeout=10)
    assert ledger.status()[0]["reserved"] == 0
    assert max(replay_totals(journal(state))) <= 16 * GiB


def test_share_sigkilled_waiter_does_not_block_the_queue(state: Path) -> None:
    holder = _holder(state, "12GiB", "holder")
    waiter = _holder(state, "8GiB", "doomed", wait=60)
    deadline = time.monotonic() + 20
    while not ledger.status()[0]["waiters"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    _kill9(waiter)
    # 4 GiB are free; the dead waiter ahead is reclaimed at this access, so no waiting at all.
    start = time.monotonic()
    with jaxmem.reserve("2GiB", wait=30):
        assert time.monotonic() - start < 2
    abandoned = [e for e in journal(state) if e["op"] == "abandon"]
    assert [(e["pid"], e["reason"]) for e in abandoned] == [(waiter.pid, "dead")]
    assert not list(state.glob("*.bell-*"))  # its doorbell is gone too
    holder.kill()
    holder.wait()


def test_share_reused_pid_is_reclaimed(state: Path) -> None:
    r = jaxmem.reserve("4GiB", capacity="16GiB", label="mine")
    paths = store.paths_for(0)
    # Pretend the reservation was made by an earlier process that had this same pid.
    with store.locked(paths):
        data = store.load(paths)
        data["reservations"][0]["pids"] = [[os.getpid(), procinfo.start_time(os.getpid()) - 1]]
        store.commit(paths, data, [])
    assert ledger.status()[0]["reserved"] == 0
    (event,) = [e for e in journal(state) if e["op"] == "reclaim"]
    assert (event["id"], event["reason"]) == (r.id, "pid reused")
    assert r.release() is False  # already gone


# --- a damaged ledger -----------------------------------------------------------------------------

def _damage(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x00\xff" * 50)
    elif how == "overbooked":  # valid JSON, impossible content
        data = json.loads(raw)
        data["reservations"][0]["bytes"] = data["capacity"] + 1
        path.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["truncate", "empty", "garbage", "overbooked"])
def test_share_corrupt_ledger_is_refused_then_repaired_keeping_live(state: Path, how: str) -> None:
    live = _holder(state, "4GiB", "live")
    dead = _holder(state, "3GiB", "dead")
    mine = jaxmem.reserve("2GiB", label="mine")
    released = jaxmem.reserve("1GiB", label="released")
    released.release()
    _kill9(dead)
    paths = store.paths_for(0)
    _damage(paths.state, how)

    # Every access refuses with one line naming the file and the way out; nothing is reset.
    for attempt in (lambda: jaxmem.reserve("1GiB"), mine.release):
        with pytest.raises(LedgerError) as err:
            attempt()
        assert str(paths.state) in str(err.value) and "jaxmem share repair --device 0" in str(err.value)
    done = run_cli(isolated_env(state), "share", "status")
    assert done.returncode == 1 and "is corrupt" in done.stdout
    mine.released = False  # the failed release above did not happen

    done = run_cli(isolated_env(state), "share", "repair", "--device", "0")
    assert done.returncode == 0, done.stderr
    assert "rebuilt" in done.stdout
    assert list(state.glob("device-0.json.corrupt-*"))  # the damaged file is kept for a look
    labels = sorted(r["label"] for r in ledger.status()[0]["reservations"])
    assert labels == ["live", "mine"]
    assert mine.release() is True
    live.stdin.close()
    live.wait(timeout=10)
    assert ledger.status()[0]["reserved"] == 0
    assert run_cli(isolated_env(state), "share", "repair").stdout.startswith("device 0: ledger is sound")


def test_share_repair_uses_rotated_journal(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "HISTORY_MAX_BYTES", 4000)
    keep = jaxmem.reserve("5GiB", capacity="16GiB", label="kept-across-rotation")
    for i in range(40):
        jaxmem.reserve("1GiB", label=f"churn{i}").release()
    paths = store.paths_for(0)
    assert paths.history_old.exists()
    first = json.loads(paths.history.read_text().splitlines()[0])
    assert first["op"] == "snapshot"
    paths.state.write_text("{")
    report = repair.repair(0)
    assert report["action"] == "rebuilt" and report["kept"] == [keep.id]
    assert ledger.status()[0]["reserved"] == 5 * GiB
    keep.release()


def test_share_deleted_ledger_is_rebuilt_from_journal(state: Path) -> None:
    keep = jaxmem.reserve("5GiB", capacity="16GiB")
    store.paths_for(0).state.unlink()
    with jaxmem.reserve("11GiB") as r:  # 5 GiB stay reserved: exactly what is left
        assert r.bytes == 11 * GiB
        with pytest.raises(LedgerError):
            jaxmem.reserve("1GiB")
    assert keep.release() is True


def test_share_journal_damage(state: Path) -> None:
    jaxmem.reserve("1GiB", capacity="16GiB").release()
    paths = store.paths_for(0)
    good = paths.history.read_bytes()
    paths.history.write_bytes(good + b'{"op":"gra')  # an append cut short by a kill: ignored
    assert len(store.read_history(paths)) == len(good.splitlines())
    paths.history.write_bytes(b"not json\n" + good)  # damage in the middle: refused
    with pytest.raises(LedgerError, match="damaged at line 1"):
        store.read_history(paths)


def test_share_without_journal_only_an_explicit_reset(state: Path) -> None:
    jaxmem.reserve("1GiB", capacity="16GiB").release()
    paths = store.paths_for(0)
    paths.state.write_text("{")
    paths.history.unlink()
    env = isolated_env(state)
    done = run_cli(env, "share", "repair", "--device", "0")
    assert done.returncode == 2 and "--reset" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert paths.state.read_text() == "{"  # untouched
    done = run_cli(env, "share", "repair", "--device", "0", "--reset", "--capacity", "16GiB")
    assert done.returncode == 0 and "reset" in done.stdout
    with jaxmem.reserve("16GiB") as r:
        assert r.capacity == 16 * GiB


def test_share_repair_requeues_live_waiters(state: Path) -> None:
    holder = _holder(state, "12GiB", "holder")
    waiter = _holder(state, "8GiB", "patient", wait=60)
    deadline = time.monotonic() + 20
    while not ledger.status()[0]["waiters"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    store.paths_for(0).state.write_text("{")
    assert repair.repair(0)["action"] == "rebuilt"
    holder.stdin.close()
    holder.wait(timeout=10)
    assert json.loads(waiter.stdout.readline())["id"]  # it queued again and got its memory
    waiter.stdin.close()
    waiter.wait(timeout=10)
    events = journal(state)
    assert [e for e in events if e["op"] == "enqueue" and e.get("requeued")]


def test_share_unusable_state_dir_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = isolated_env(blocker / "sub")
    done = run_cli(env, "run", "--memory", "1GiB", "--capacity", "16GiB", "--", "true")
    assert done.returncode == 2 and "cannot use state directory" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    readonly = tmp_path / "ro"
    readonly.mkdir()
    jaxmem_env = isolated_env(readonly)
    assert run_cli(jaxmem_env, "run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--", "true").returncode == 0
    if os.geteuid() != 0:  # root ignores permission bits
        readonly.chmod(0o500)
        done = run_cli(jaxmem_env, "run", "--memory", "1GiB", "--", "true")
        readonly.chmod(0o700)
        assert done.returncode == 2 and "cannot write ledger" in done.stderr, done.stderr


def test_share_repair_messages(state: Path) -> None:
    env = isolated_env(state)
    done = run_cli(env, "share", "repair", "--device", "5")
    assert done.returncode == 2 and "device 5 has no ledger" in done.stderr
    jaxmem.reserve("1GiB", capacity="16GiB").release()
    paths = store.paths_for(0)
    paths.state.write_text("{")
    paths.history.write_bytes(b"garbage\n" + paths.history.read_bytes())
    done = run_cli(env, "share", "repair")  # damage before an intact snapshot does not matter
    assert done.returncode == 0 and "rebuilt" in done.stdout, done.stderr
    paths.state.write_text("{")
    paths.history.write_bytes(b"garbage\n")  # nothing to start from: only --reset goes on
    done = run_cli(env, "share", "repair")
    assert done.returncode == 2 and "damaged at" in done.stderr and "--reset" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_share_queue_heals_itself_when_the_first_waiter_dies(state: Path) -> None:
    """No outside access at all: the waiter behind a killed head notices and moves up."""
    holder = _holder(state, "12GiB", "holder")
    head = _holder(state, "8GiB", "head", wait=60)
    _until_waiters(1)
    second = _holder(state, "2GiB", "second", wait=60)  # fits, but queued behind the head
    _until_waiters(2)
    _kill9(head)
    start = time.monotonic()
    assert json.loads(second.stdout.readline())["id"]  # granted without anyone else touching the ledger
    assert time.monotonic() - start < 10
    events = journal(state)
    assert [(e["pid"], e["reason"]) for e in events if e["op"] == "abandon"] == [(head.pid, "dead")]
    for proc in (holder, second):
        proc.kill()
        proc.wait()


def _until_waiters(n: int) -> None:
    deadline = time.monotonic() + 20
    while len(ledger.status()[0]["waiters"]) < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)
