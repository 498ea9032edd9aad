"""Abuse cases, as a hostile or careless user would try them: planted files in a shared ledger
directory, other users, hostile traces, markup and escape sequences, and inputs that used to end
in a traceback. Each case asserts its one-line error and exit code 2 (or the right behaviour),
that a hostile file is answered within 2 s with bounded memory, and that nothing outside the
state directory changed.

Second-uid cases run as uid 65534 through `setpriv` where this process is root and uid 65534
can run a Python with jaxmem (`JAXMEM_OTHER_UID_PYTHON` names one); otherwise they skip, saying
why. Run as an unprivileged user, the planted-file cases plant as that same user.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from abuse_helpers import (HOSTILE_S, NOBODY, Outcome, as_uid, assert_bounded, assert_one_line, child_env, cli,
                           dag, fingerprint, jaxmem_argv, other_python, pickled, second_uid_reason, snapshot)

import jaxmem
from jaxmem.share import ledger, store
from jaxmem.units import GiB

ESC = "\x1b"


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    """Import what the in-process CLI imports once, so no case's time counts imports."""
    import jaxmem.cli.replay  # noqa: F401
    import jaxmem.cli.share  # noqa: F401
    import jaxmem.traces.replay  # noqa: F401
    import rich.console  # noqa: F401


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A state directory, and a check after the case that nothing else under tmp_path changed
    (tmp_path holds the victim files planted links point at, and the hostile inputs)."""
    path = tmp_path / "state"
    path.mkdir()
    victims = tmp_path / "victim"
    victims.mkdir()
    (victims / "bashrc").write_text("export PATH=/usr/bin\n")
    (victims / "notes.txt").write_text("mine\n")
    (tmp_path / "out").mkdir()  # what a case writes on purpose (reports)
    (tmp_path / "in").mkdir()   # the hostile inputs a case writes
    monkeypatch.setenv("JAXMEM_STATE_DIR", str(path))
    monkeypatch.setenv("JAXMEM_NVIDIA_SMI", "none")
    before = fingerprint(tmp_path, skip=(path, tmp_path / "out", tmp_path / "in"))
    yield path
    assert fingerprint(tmp_path, skip=(path, tmp_path / "out", tmp_path / "in")) == before, "a file outside the state directory changed"


def _victim(state: Path, name: str = "bashrc") -> Path:
    return state.parent / "victim" / name


def _plant(state: Path, name: str, kind: str) -> Path:
    """Put something other than a ledger file at `name` in the state directory."""
    path = state / name
    if kind == "symlink":
        path.symlink_to(_victim(state))
    elif kind == "dangling":
        path.symlink_to(state.parent / "victim" / "created-through-link")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "hardlink":
        os.link(_victim(state), path)
    return path


def _ledger_with_holder(state: Path, label: str = "holder") -> ledger.Reservation:
    return jaxmem.reserve("4GiB", capacity="16GiB", label=label)


# ==== planted files in the ledger directory ===================================================

PLANTED = [(name, kind) for name in ("device-0.history", "device-0.lock", "device-0.json")
           for kind in ("symlink", "dangling", "fifo", "directory", "hardlink")]


@pytest.mark.parametrize("name,kind", PLANTED, ids=[f"{n}-{k}" for n, k in PLANTED])
def test_abuse_planted_file_is_refused_in_one_line(state: Path, capsys, name: str, kind: str) -> None:
    if kind == "hardlink" and os.stat(_victim(state)).st_dev != os.stat(state).st_dev:
        pytest.skip("the victim file is on another file system")
    _plant(state, name, kind)
    result = cli(capsys, "run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--", "true",
                 measure_memory=False)
    assert_one_line(result, name)
    assert result.seconds < HOSTILE_S  # a FIFO never blocks the open
    assert not (state.parent / "victim" / "created-through-link").exists()


def test_abuse_planted_temp_names_are_not_used(state: Path) -> None:
    # The old writer used device-0.json.tmp.<pid>: plant that for every pid nearby.
    me = os.getpid()
    for pid in range(me - 50, me + 400):
        (state / f"device-0.json.tmp.{pid}").symlink_to(_victim(state))
    with _ledger_with_holder(state):
        pass
    assert _victim(state).read_text() == "export PATH=/usr/bin\n"


@pytest.mark.parametrize("kind", ["symlink", "regular"])
def test_abuse_planted_doorbell_is_not_written(state: Path, kind: str) -> None:
    holder = _ledger_with_holder(state)
    target = _victim(state, "notes.txt")
    # The next waiter will take ticket 2; its doorbell name is planted before it queues.
    bell = store.bell_path(store.paths_for(0), 2)
    if kind == "symlink":
        bell.symlink_to(target)
    else:
        bell.write_text("planted\n")
    waiter = subprocess.Popen(jaxmem_argv("run", "-q", "--memory", "14GiB", "--wait", "30", "--", "true"),
                              env=child_env(state), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (ledger.status()[0]["waiters"] or waiter.poll() is not None):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    store.ring(store.paths_for(0), 2)  # what any other process does after a change
    holder.release()
    assert waiter.wait(timeout=60) == 0, waiter.stderr.read()
    assert target.read_text() == "mine\n"


def test_abuse_ring_never_writes_a_planted_regular_file(state: Path) -> None:
    bell = store.bell_path(store.paths_for(0), 7)
    bell.write_text("x")
    store.ring(store.paths_for(0), 7)
    assert bell.read_text() == "x"


def test_abuse_history_directory_is_one_line(state: Path, capsys) -> None:
    with _ledger_with_holder(state):
        pass
    paths = store.paths_for(0)
    paths.history.unlink()
    paths.history.mkdir()
    result = cli(capsys, "run", "-q", "--memory", "1GiB", "--", "true", measure_memory=False)
    assert_one_line(result, "device-0.history", "is a directory")
    (state / "device-0.json").unlink()  # now the journal is needed to rebuild: still one line
    assert_one_line(cli(capsys, "share", "repair", measure_memory=False), "device-0.history", "is a directory")


def test_abuse_giant_state_file_is_refused_without_reading(state: Path, capsys) -> None:
    path = state / "device-0.json"
    with open(path, "wb") as f:
        f.truncate(store.STATE_MAX_BYTES + 1)  # sparse: costs nothing to make
    result = cli(capsys, "run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--", "true")
    assert_one_line(result, "more than a ledger ever holds")
    assert_bounded(result, 0)


def test_abuse_deeply_nested_state_file_is_one_line(state: Path, capsys) -> None:
    (state / "device-0.json").write_text("[" * 100_000 + "]" * 100_000)
    result = cli(capsys, "run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--", "true")
    assert_one_line(result, "is corrupt")
    assert_bounded(result, 200_000)


def test_abuse_huge_value_in_state_file_is_quoted_short(state: Path, capsys) -> None:
    with _ledger_with_holder(state):
        pass
    path = store.paths_for(0).state
    data = json.loads(path.read_text())
    data["capacity"] = "9" * 5_000_000
    path.write_text(json.dumps(data))
    result = cli(capsys, "run", "-q", "--memory", "1GiB", "--", "true")
    assert_one_line(result, "field 'capacity'")
    assert_bounded(result, 5_000_000)


@pytest.mark.parametrize("mode", [0o1777, 0o1770])
def test_abuse_sticky_shared_directory_is_refused(tmp_path: Path, monkeypatch, capsys, mode: int) -> None:
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv("JAXMEM_STATE_DIR", str(shared))
    monkeypatch.setenv("JAXMEM_NVIDIA_SMI", "none")
    assert_one_line(cli(capsys, "share", "status", measure_memory=False), "sticky")


def test_abuse_default_directory_planted_as_a_link(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("JAXMEM_STATE_DIR", raising=False)
    monkeypatch.setenv("JAXMEM_NVIDIA_SMI", "none")
    name = f"jaxmem-test-{os.getpid()}-link"
    monkeypatch.setattr(store, "NODE_DIR", name)
    planted = store.node_dir()
    planted.symlink_to(tmp_path)
    try:
        assert_one_line(cli(capsys, "share", "status", measure_memory=False), "symbolic link")
        assert os.listdir(tmp_path) == []
    finally:
        planted.unlink()


def test_abuse_default_directory_is_node_wide_and_shared(monkeypatch) -> None:
    monkeypatch.delenv("JAXMEM_STATE_DIR", raising=False)
    monkeypatch.setenv("JAXMEM_NVIDIA_SMI", "none")
    name = f"jaxmem-test-{os.getpid()}-node"
    monkeypatch.setattr(store, "NODE_DIR", name)
    old = os.umask(0o077)  # a private umask must not make the node's directory private
    try:
        path = store.state_dir()
        assert path == store.node_dir() and path.name == name  # one name for every user: no uid in it
        assert stat.S_IMODE(path.stat().st_mode) == 0o777
        with jaxmem.reserve("1GiB", capacity="16GiB"):
            for f in ("device-0.json", "device-0.lock", "device-0.history"):
                assert stat.S_IMODE((path / f).stat().st_mode) == 0o666, f
    finally:
        os.umask(old)
        for f in path.iterdir():
            f.unlink()
        path.rmdir()


def test_abuse_unwritable_state_directory_names_owner_and_mode(tmp_path: Path, monkeypatch, capsys) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes any directory; the second-uid case below covers this as root")
    shared = tmp_path / "ro"
    shared.mkdir()
    shared.chmod(0o555)
    monkeypatch.setenv("JAXMEM_STATE_DIR", str(shared))
    try:
        assert_one_line(cli(capsys, "share", "status", measure_memory=False), "not writable", "mode 0555")
    finally:
        shared.chmod(0o755)


# ==== other users =============================================================================

@pytest.fixture
def shared_dir(tmp_path_factory):
    """A directory both uids can reach (pytest's own tmp is private to root)."""
    import shutil
    import tempfile

    why = second_uid_reason()
    if why:
        pytest.skip(why)
    base = Path(tempfile.mkdtemp(prefix="jaxmem-abuse-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    base.chmod(0o755)
    (base / "victim").mkdir()
    (base / "victim" / "rc").write_text("root's file\n")
    yield base
    shutil.rmtree(base)


def _nobody_cli(state: Path, *args: str, groups: str | None = None) -> subprocess.CompletedProcess:
    env = child_env(state)
    return as_uid(NOBODY, jaxmem_argv(*args, python=other_python()), env, groups=groups)


def test_abuse_two_users_share_one_ledger(shared_dir: Path) -> None:
    state = shared_dir / "ledger"
    state.mkdir()
    state.chmod(0o777)
    env = child_env(state)
    held = subprocess.Popen(jaxmem_argv("run", "-q", "--memory", "80%", "--capacity", "16GiB", "--label", "root-job",
                                        "--", "sleep", "30"), env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (state / "device-0.json").exists() or "root-job" not in (state / "device-0.json").read_text():
            assert time.monotonic() < deadline and held.poll() is None
            time.sleep(0.05)
        done = _nobody_cli(state, "run", "-q", "--memory", "80%", "--", "true")
        assert_one_line(done, "root-job")  # the second user sees the first: no 160%
        done = _nobody_cli(state, "run", "-q", "--memory", "15%", "--", "true")
        assert done.returncode == 0, done.stderr  # and can write the journal root created
        status = json.loads(_nobody_cli(state, "share", "status", "--json").stdout)
        assert [r["label"] for r in status["devices"][0]["reservations"]] == ["root-job"]
    finally:
        held.send_signal(signal.SIGTERM)
        held.wait(timeout=60)


def test_abuse_other_users_waiter_is_woken(shared_dir: Path) -> None:
    """A waiter of one uid queues behind another's reservation and is granted when it ends:
    the doorbell (a FIFO the waiter made) can be rung by the other user."""
    state = shared_dir / "ledger"
    state.mkdir()
    state.chmod(0o777)
    with _env_reserve(state, "12GiB"):
        waiter = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                   *jaxmem_argv("run", "-q", "--memory", "8GiB", "--wait", "120", "--", "true",
                                                python=other_python())],
                                  env=child_env(state), stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not json.loads((state / "device-0.json").read_text())["waiters"]:
            assert time.monotonic() < deadline and waiter.poll() is None, waiter.stderr.read() if waiter.poll() else ""
            time.sleep(0.05)
        (bell,) = state.glob("device-0.bell-*")
        assert bell.stat().st_uid == NOBODY and stat.S_ISFIFO(bell.stat().st_mode)
        released = time.monotonic()
    assert waiter.wait(timeout=60) == 0, waiter.stderr.read()
    assert time.monotonic() - released < 30


@pytest.mark.slow
def test_abuse_two_uids_racing_never_oversubscribe(shared_dir: Path) -> None:
    """Eight processes of two uids, each taking 30% five times, waiting their turn."""
    why = second_uid_reason(through_shell=True)
    if why:
        pytest.skip(why)
    state = shared_dir / "race"
    state.mkdir()
    state.chmod(0o777)
    with _env_reserve(state, "1GiB"):
        pass  # the ledger exists with its capacity; every racer finds it
    loop = ("for i in 1 2 3 4 5; do {jaxmem} run -q --memory 30% --wait 300 -- sleep 0.05 || exit 1; done")
    argv = " ".join(jaxmem_argv(python=other_python())[:3]).replace("; entry()", "; entry()'").replace(
        "-c from", "-c 'from")
    racers = []
    for k in range(8):
        cmd = ["sh", "-c", loop.format(jaxmem=argv)]
        if k % 2:
            cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
        racers.append(subprocess.Popen(cmd, env=child_env(state), stderr=subprocess.PIPE, text=True))
    for racer in racers:
        assert racer.wait(timeout=600) == 0, racer.stderr.read()
    held: dict[int, int] = {}
    grants = 0
    for line in (state / "device-0.history").read_text().splitlines():
        event = json.loads(line)
        if event["op"] == "snapshot":
            held = {r["id"]: r["bytes"] for r in event["state"]["reservations"]}
        elif event["op"] == "grant":
            held[event["id"]] = event["bytes"]
            grants += 1
        elif event["op"] in ("release", "reclaim"):
            held.pop(event["id"])
        assert sum(held.values()) <= 16 * GiB
    assert grants >= 40


def test_abuse_group_directory_works_for_every_member(shared_dir: Path) -> None:
    state = shared_dir / "group-ledger"
    state.mkdir()
    os.chown(state, 0, NOBODY)
    state.chmod(0o2770)
    old = os.umask(0o077)
    try:
        with _env_reserve(state, "1GiB"):
            done = _nobody_cli(state, "run", "-q", "--memory", "2GiB", "--", "true", groups=str(NOBODY))
            assert done.returncode == 0, done.stderr
        for f in ("device-0.json", "device-0.history", "device-0.lock"):
            assert stat.S_IMODE((state / f).stat().st_mode) == 0o660, f
    finally:
        os.umask(old)


class _env_reserve:
    """A reservation in `state` made by this process (uid 0)."""

    def __init__(self, state: Path, amount: str) -> None:
        self.state, self.amount = state, amount

    def __enter__(self):
        self.old = os.environ.get("JAXMEM_STATE_DIR")
        os.environ["JAXMEM_STATE_DIR"] = str(self.state)
        self.r = jaxmem.reserve(self.amount, capacity="16GiB", label="root")
        return self.r

    def __exit__(self, *exc) -> None:
        self.r.release()
        if self.old is None:
            os.environ.pop("JAXMEM_STATE_DIR", None)
        else:
            os.environ["JAXMEM_STATE_DIR"] = self.old


@pytest.mark.parametrize("name", ["device-0.history", "device-0.lock", "device-0.json"])
def test_abuse_other_user_plants_a_link_for_root(shared_dir: Path, name: str) -> None:
    state = shared_dir / "ledger"
    state.mkdir()
    state.chmod(0o777)
    victim = shared_dir / "victim" / "rc"
    planted = as_uid(NOBODY, ["ln", "-s", str(victim), str(state / name)], env=dict(os.environ))
    assert planted.returncode == 0, planted.stderr
    done = subprocess.run(jaxmem_argv("run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--label", "EVIL\n",
                                      "--", "true"), env=child_env(state), capture_output=True, text=True, timeout=60)
    assert_one_line(done, "symbolic link")
    assert victim.read_text() == "root's file\n"


def test_abuse_other_users_files_in_private_directory(shared_dir: Path) -> None:
    state = shared_dir / "mine"
    state.mkdir()  # root's, mode 0755: nobody may not write it
    done = _nobody_cli(state, "run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--", "true")
    assert_one_line(done, "not writable", "owner uid 0")


def test_abuse_old_private_journal_names_the_right_file(shared_dir: Path) -> None:
    state = shared_dir / "ledger"
    state.mkdir()
    state.chmod(0o777)
    with _env_reserve(state, "1GiB"):
        pass
    (state / "device-0.history").chmod(0o644)  # as an older jaxmem made it
    done = _nobody_cli(state, "run", "-q", "--memory", "1GiB", "--", "true")
    assert_one_line(done, "device-0.history", "permission denied")


# ==== repair never drops a live holder =========================================================

def _live_holder(state: Path, amount: str, label: str) -> subprocess.Popen:
    """`jaxmem run` holding `amount` for a command that has started (so its environment,
    not the wrapper's, is what /proc shows)."""
    started = state.parent / "out" / f"started-{label}"
    proc = subprocess.Popen(jaxmem_argv("run", "-q", "--memory", amount, "--capacity", "16GiB", "--label", label,
                                        "--", "sh", "-c", f"touch {started}; exec sleep 60"),
                            env=child_env(state), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc


def test_abuse_early_journal_damage_then_repair_keeps_live(state: Path, capsys) -> None:
    holder = _live_holder(state, "40%", "live")
    try:
        paths = store.paths_for(0)
        lines = paths.history.read_bytes().split(b"\n")
        lines.insert(0, b"{damaged")
        paths.history.write_bytes(b"\n".join(lines))
        paths.state.write_text("{")
        result = cli(capsys, "share", "repair", measure_memory=False)
        assert result.code == 0 and "rebuilt" in result.out, result.err
        assert [r["label"] for r in ledger.status()[0]["reservations"]] == ["live"]
        assert_one_line(cli(capsys, "run", "-q", "--memory", "70%", "--", "true", measure_memory=False), "'live'")
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=60)


def test_abuse_reset_keeps_live_holder(state: Path, capsys) -> None:
    holder = _live_holder(state, "40%", "live")
    try:
        paths = store.paths_for(0)
        # The journal's snapshots are damaged (nothing to rebuild from), its grant is not.
        lines = [b"{damaged" if b'"op":"snapshot"' in line else line
                 for line in paths.history.read_bytes().split(b"\n")]
        paths.history.write_bytes(b"\n".join(lines))
        paths.state.write_text("{")
        assert_one_line(cli(capsys, "share", "repair", measure_memory=False), "--reset")
        result = cli(capsys, "share", "repair", "--reset", "--capacity", "16GiB", measure_memory=False)
        assert result.code == 0 and "reset" in result.out, result.err
        (kept,) = ledger.status()[0]["reservations"]
        assert kept["label"] == "live"
        assert_one_line(cli(capsys, "run", "-q", "--memory", "70%", "--", "true", measure_memory=False), "'live'")
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=60)


def test_abuse_damage_after_the_snapshot_keeps_live_from_state_file(state: Path, capsys) -> None:
    holder = _live_holder(state, "40%", "live")
    try:
        paths = store.paths_for(0)
        lines = paths.history.read_bytes().split(b"\n")
        grant = next(i for i, line in enumerate(lines) if b'"op":"grant"' in line)
        lines[grant] = b"{torn"
        paths.history.write_bytes(b"\n".join(lines))
        data = json.loads(paths.state.read_text())
        data["capacity"] = -1  # damaged, but its reservations still parse
        paths.state.write_text(json.dumps(data))
        result = cli(capsys, "share", "repair", measure_memory=False)
        assert result.code == 0 and "skipped 1 damaged journal line" in result.out, result.out + result.err
        assert [r["label"] for r in ledger.status()[0]["reservations"]] == ["live"]
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=60)


def test_abuse_reset_with_no_record_left_keeps_live_run(state: Path, capsys) -> None:
    holder = _live_holder(state, "40%", "live")
    try:
        paths = store.paths_for(0)
        paths.history.write_bytes(b"garbage\n")  # every record gone
        paths.state.write_text("{")
        result = cli(capsys, "share", "repair", "--reset", "--capacity", "16GiB", measure_memory=False)
        assert result.code == 0 and "reset" in result.out, result.err
        (kept,) = ledger.status()[0]["reservations"]
        assert kept["bytes"] >= 0.4 * 16 * GiB and kept["label"].startswith("recovered from pid")
        assert_one_line(cli(capsys, "run", "-q", "--memory", "70%", "--", "true", measure_memory=False), "recovered")
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=60)


def test_abuse_reset_needs_capacity(state: Path, capsys) -> None:
    (state / "device-0.json").write_text("{")
    assert_one_line(cli(capsys, "share", "repair", "--reset", measure_memory=False), "--capacity")


# ==== labels and names on other people's terminals ============================================

MARKUP_LABELS = ["[/bold] x", "[red]x[/]", "[/]", "\\[bold]", "x\\", "[link=file:///etc/passwd]x[/link]"]
ESCAPE_LABELS = [ESC + "]0;pwned" + "\x07", ESC + "[2J" + ESC + "[H", "a\rb\nc\td", "\u202eevil\u202c", "\x9b31m"]


@pytest.mark.parametrize("label", MARKUP_LABELS + ESCAPE_LABELS)
def test_abuse_label_is_shown_literally(state: Path, capsys, label: str) -> None:
    with jaxmem.reserve("1GiB", capacity="16GiB", label=label):
        result = cli(capsys, "share", "status", measure_memory=False)
        assert result.code == 0, result.err
        assert ESC not in result.out and "\x9b" not in result.out and "\u202e" not in result.out
        if label in MARKUP_LABELS:
            assert label in result.out  # shown as typed, not taken as markup
        refused = cli(capsys, "run", "-q", "--memory", "16GiB", "--", "true", measure_memory=False)
        assert_one_line(refused, "cannot reserve")
        assert ESC not in refused.err and "\x9b" not in refused.err


def test_abuse_long_label_is_cut(state: Path, capsys) -> None:
    with jaxmem.reserve("1GiB", capacity="16GiB", label="L" * 10_000) as r:
        assert len(r.label) == store.LABEL_MAX
        refused = cli(capsys, "run", "-q", "--memory", "16GiB", "--", "true", measure_memory=False)
        assert_one_line(refused, "cannot reserve")


def test_abuse_planted_huge_label_in_ledger_is_corrupt(state: Path, capsys) -> None:
    with jaxmem.reserve("1GiB", capacity="16GiB"):
        pass
    with jaxmem.reserve("1GiB", capacity="16GiB") as r:
        path = store.paths_for(0).state
        data = json.loads(path.read_text())
        data["reservations"][0]["label"] = "[/bold]" * 1_000_000
        path.write_text(json.dumps(data))
        result = cli(capsys, "share", "status")
        assert result.code == 1 and "is corrupt" in result.out and len(result.out) < 2000
        assert_bounded(result, 7_000_000)
        r.released = True


# ==== hostile traces ==========================================================================

def _replay(capsys, path: Path, *extra: str) -> Outcome:
    return cli(capsys, "replay", str(path), "--allocator", "bfc", *extra)


PICKLES = {
    "dag-address": lambda: snapshot(segments=[dict(snapshot()["segments"][0], address=dag())]),
    "dag-total-size": lambda: snapshot(segments=[dict(snapshot()["segments"][0], total_size=dag())]),
    "dag-stream": lambda: snapshot(segments=[dict(snapshot()["segments"][0], stream=dag())]),
    "dag-event-size": lambda: snapshot(device_traces=[[{"action": "alloc", "addr": 1, "size": dag()}]]),
    "dag-event-time": lambda: snapshot(device_traces=[[{"action": "alloc", "addr": 1, "size": 8, "time_us": dag()}]]),
    "dag-segments": lambda: snapshot(segments=dag()),
    "dag-device-traces": lambda: snapshot(device_traces=dag()),
    "dag-entries": lambda: snapshot(device_traces=[dag()]),
    "shared-block-list": lambda: _shared_blocks(),
    "huge-string-address": lambda: snapshot(segments=[dict(snapshot()["segments"][0], address="7" * 20_000_000)]),
    "huge-int-size": lambda: snapshot(device_traces=[[{"action": "alloc", "addr": 1, "size": 10 ** 100_000}]]),
    "negative-size": lambda: snapshot(device_traces=[[{"action": "alloc", "addr": 1, "size": -5}]]),
    "not-a-dict": lambda: [1, 2, 3],
}


def _shared_blocks() -> dict:
    blocks = [{"size": 1024, "state": "inactive"} for _ in range(2000)]
    segs = [{"device": 0, "address": k << 30, "total_size": 2000 * 1024, "blocks": blocks} for k in range(2000)]
    return snapshot(segments=segs, device_traces=[[]])


@pytest.mark.parametrize("case", sorted(PICKLES))
def test_abuse_hostile_pickle_is_answered_quickly(state: Path, capsys, case: str) -> None:
    path = state.parent / "in" / "in.pickle"
    data = pickled(PICKLES[case]())
    path.write_bytes(data)
    result = _replay(capsys, path)
    assert_one_line(result, "in.pickle")
    assert_bounded(result, len(data))
    if case.startswith("dag"):
        assert len(data) < 4000  # the 1.2 KB class of file


def test_abuse_dag_as_action_is_skipped(state: Path, capsys) -> None:
    data = pickled(snapshot(device_traces=[[{"action": dag(), "addr": 1, "size": 8}]]))
    path = state.parent / "in" / "action.pickle"
    path.write_bytes(data)
    result = _replay(capsys, path, "--json")
    assert result.code == 0, result.err  # not an action PyTorch writes: skipped, as unknown ones are
    assert_bounded(result, len(data))


def test_abuse_dag_in_settings_and_frames_is_not_expanded(state: Path, capsys) -> None:
    shared_frames = [{"filename": dag(), "line": dag(), "name": "[/bold]" + ESC + "[31m"}] * 50
    events = [{"action": "alloc", "addr": (k + 1) << 12, "size": 512, "frames": shared_frames} for k in range(200)]
    data = pickled(snapshot(device_traces=[events], allocator_settings={"max_split_size": dag(), "x": dag()},
                            segments=[]))
    path = state.parent / "in" / "frames.pickle"
    path.write_bytes(data)
    result = _replay(capsys, path, "--json")
    assert result.code == 0, result.err
    assert_bounded(result, len(data))


@pytest.mark.parametrize("opcode", [b"cos\nsystem\n", b"cbuiltins\neval\n", b"csubprocess\nPopen\n"])
def test_abuse_pickle_globals_never_run(state: Path, capsys, opcode: bytes) -> None:
    marker = state.parent / "out" / "ran"
    payload = opcode + b"(V" + f"touch {marker}".encode() + b"\ntR."
    path = state.parent / "in" / "evil.pickle"
    path.write_bytes(payload)
    result = _replay(capsys, path)
    assert_one_line(result, "refuses to load global")
    assert not marker.exists()


def test_abuse_truncated_pickle(state: Path, capsys) -> None:
    path = state.parent / "in" / "cut.pickle"
    path.write_bytes(pickled(snapshot())[:-20])
    assert_one_line(_replay(capsys, path), "pickle")


def test_abuse_deeply_nested_pickle(state: Path, capsys) -> None:
    depth = 100_000  # made from opcodes: pickle.dumps itself would recurse too deeply
    nested = b"]" * depth + b"a" * (depth - 1)
    data = (b"\x80\x02}" + b"X\x08\x00\x00\x00segments" + nested + b"s"
            + b"X\x0d\x00\x00\x00device_traces]s.")
    path = state.parent / "in" / "deep.pickle"
    path.write_bytes(data)
    result = _replay(capsys, path)
    assert_one_line(result, "deep.pickle")
    assert_bounded(result, len(data))


def _chrome(events) -> bytes:
    return json.dumps({"traceEvents": events}).encode()


def _mem(**args) -> dict:
    base = {"Addr": 4096, "Bytes": 512, "Total Allocated": 512, "Total Reserved": 2 << 20, "Device Type": 1, "Device Id": 0}
    base.update(args)
    return {"name": "[memory]", "ph": "i", "ts": 1, "args": base}


CHROME = {
    "nested-100000": b'{"traceEvents": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "list-device-id": _chrome([_mem(**{"Device Id": [0]})]),
    "dict-device-type": _chrome([_mem(**{"Device Type": {"a": 1}})]),
    "huge-string-addr": _chrome([_mem(Addr="4" * 20_000_000)]),
    "huge-number": _chrome([_mem(Bytes=1e300)]),
    "no-memory-events": _chrome([{"name": "op", "ph": "X"}]),
    "args-not-dict": _chrome([{"name": "[memory]", "args": [1]}]),
    "traceEvents-not-list": b'{"traceEvents": {"a": 1}}',
    "truncated": _chrome([_mem()])[:-5],
}


@pytest.mark.parametrize("case", sorted(CHROME))
def test_abuse_hostile_chrome_trace(state: Path, capsys, case: str) -> None:
    path = state.parent / "in" / "trace.json"
    path.write_bytes(CHROME[case])
    result = _replay(capsys, path)
    assert_one_line(result, "trace.json")
    assert_bounded(result, len(CHROME[case]))


def _jaxmem_trace(header_over: dict | None = None, events: list | None = None) -> bytes:
    header = {"format": "jaxmem-trace", "version": 1, "source": "t"}
    header.update(header_over or {})
    lines = [json.dumps(header)] + [json.dumps(e) for e in (events or [{"action": "alloc", "addr": 0, "size": 8}])]
    return ("\n".join(lines) + "\n").encode()


JAXMEM = {
    "settings-list": _jaxmem_trace({"allocator_settings": [1, 2]}),
    "meta-string": _jaxmem_trace({"meta": "x"}),
    "segments-int": _jaxmem_trace({"initial_segments": 5}),
    "segments-bad-pool": _jaxmem_trace({"initial_segments": [{"addr": 0, "size": 8, "pool": [1]}]}),
    "blocks-dict": _jaxmem_trace({"initial_blocks": {"a": 1}}),
    "nested-event": _jaxmem_trace(events=[]) + b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "nested-header": b'{"format": "jaxmem-trace", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    "huge-size": _jaxmem_trace(events=[{"action": "alloc", "addr": 0, "size": 10 ** 30}]),
    "string-size": _jaxmem_trace(events=[{"action": "alloc", "addr": 0, "size": "9" * 20_000_000}]),
    "nan-time": _jaxmem_trace(events=[{"action": "alloc", "addr": 0, "size": 8, "time_us": float("nan")}]),
    "list-action": _jaxmem_trace(events=[{"action": ["alloc"], "addr": 0, "size": 8}]),
    "frame-not-strings": _jaxmem_trace(events=[{"action": "alloc", "addr": 0, "size": 8, "frames": [[1, 2, 3]]}]),
    "frames-dict": _jaxmem_trace(events=[{"action": "alloc", "addr": 0, "size": 8, "frames": {"a": 1}}]),
}


@pytest.mark.parametrize("case", sorted(JAXMEM))
def test_abuse_hostile_jaxmem_trace(state: Path, capsys, case: str) -> None:
    path = state.parent / "in" / "t.jsonl"
    path.write_bytes(JAXMEM[case])
    result = _replay(capsys, path)
    assert_one_line(result, "t.jsonl")
    assert_bounded(result, len(JAXMEM[case]))


RMM = {
    "huge-pointer": "Thread,Time,Action,Pointer,Size,Stream\n1,0.0,allocate," + "9" * 5000 + ",8,0\n",
    "64bit-overflow": "Thread,Time,Action,Pointer,Size,Stream\n1,0.0,allocate,0x1,99999999999999999999999,0\n",
    "giant-field": "Thread,Time,Action,Pointer,Size,Stream\n1,0.0,allocate,0x1,\"" + "8" * 300_000 + "\",0\n",
    "long-action": "Thread,Time,Action,Pointer,Size,Stream\n1,0.0," + "[/bold]" * 100_000 + ",0x1,8,0\n",
}


@pytest.mark.parametrize("case", sorted(RMM))
def test_abuse_hostile_rmm_log(state: Path, capsys, case: str) -> None:
    path = state.parent / "in" / "log.csv"
    path.write_text(RMM[case])
    result = _replay(capsys, path)
    assert_one_line(result, "log.csv")
    assert_bounded(result, len(RMM[case]))


def test_abuse_gzip_bomb_default_limit(state: Path, capsys) -> None:
    inflater = zlib.compressobj(9, zlib.DEFLATED, 31)
    data = b"".join(inflater.compress(b"\0" * (16 << 20)) for _ in range(8)) + inflater.flush()  # 128 MiB
    path = state.parent / "in" / "bomb.pickle.gz"
    path.write_bytes(data)
    result = _replay(capsys, path)
    assert_one_line(result, "decompresses to more than 64.00 MiB")
    assert_bounded(result, len(data) + (64 << 20) // 8)


def test_abuse_gzip_bomb_is_refused(state: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("JAXMEM_TRACE_MAX_BYTES", "8MiB")
    inflater = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"\0" * (16 << 20)
    data = b"".join(inflater.compress(chunk) for _ in range(8)) + inflater.flush()  # 128 MiB of zeros
    path = state.parent / "in" / "bomb.json.gz"
    path.write_bytes(data)
    result = _replay(capsys, path)
    assert_one_line(result, "decompresses to more than 8.00 MiB")
    assert_bounded(result, len(data) + (8 << 20) // 8)


@pytest.mark.parametrize("cut", ["truncated", "garbage-after-header"])
def test_abuse_broken_gzip(state: Path, capsys, cut: str) -> None:
    data = gzip.compress(_jaxmem_trace())
    data = data[:-12] if cut == "truncated" else data[:12] + b"\xff" * 40
    path = state.parent / "in" / "t.jsonl.gz"
    path.write_bytes(data)
    assert_one_line(_replay(capsys, path), "gzip")


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "binary"])
def test_abuse_unreadable_trace_file(state: Path, capsys, kind: str) -> None:
    path = state.parent / "out" / "x.bin"
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 10)
    assert_one_line(_replay(capsys, path), "x.bin")


def test_abuse_frame_names_and_paths_are_not_markup(state: Path, capsys) -> None:
    frames = [["[/bold]" + ESC + "]0;x\x07.py", 1, "[/]" + ESC + "[2J"]]
    events = [{"action": "alloc", "addr": k << 20, "size": 1 << 20, "frames": frames} for k in range(4)]
    (state.parent / "out" / "a[bold][").mkdir()
    path = state.parent / "out" / "a[bold][" / "]b.jsonl"  # the path holds "[/]"
    path.write_bytes(_jaxmem_trace({"source": "src[/]" + ESC + "[31m"}, events=events))
    result = _replay(capsys, path, "--capacity", "2MiB")
    assert result.code == 0, result.err
    assert "src[/]\\x1b[31m" in result.out and "[/]\\x1b[2J" in result.out
    assert ESC not in result.out and "out of memory" in result.out


@pytest.mark.parametrize("name", ["two\nlines.pickle", "esc" + ESC + "]0;title" + "\x07.pickle", "bidi\u202e.pickle"])
def test_abuse_error_quoting_a_hostile_path_stays_one_line(state: Path, capsys, name: str) -> None:
    path = state.parent / "out" / name
    path.write_bytes(b"\x80\x04garbage")
    result = _replay(capsys, path)
    assert_one_line(result, "pickle")
    assert ESC not in result.err and "\u202e" not in result.err


# ==== errors that used to be tracebacks ======================================================

def test_abuse_png_given_a_directory(state: Path, capsys) -> None:
    path = state.parent / "in" / "t.jsonl"
    path.write_bytes(_jaxmem_trace())
    result = _replay(capsys, path, "--png", str(state.parent / "out"))
    assert_one_line(result, "cannot write PNG timeline")


@pytest.mark.parametrize("name", ["out", "out.PNG"])
def test_abuse_png_is_written_where_asked(state: Path, capsys, name: str) -> None:
    path = state.parent / "in" / "t.jsonl"
    path.write_bytes(_jaxmem_trace())
    target = state.parent / "out" / name
    result = _replay(capsys, path, "--png", str(target))
    assert result.code == 0, result.err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(target.parent)) == [name]


@pytest.mark.parametrize("flag,name", [("--png", "out.xyz"), ("--png", "out.html"), ("--html", "out.png"),
                                       ("--pprof", "out.pb"), ("--chrome-trace", "out.json.bz2")])
def test_abuse_report_of_the_wrong_extension_is_refused(state: Path, capsys, flag: str, name: str) -> None:
    path = state.parent / "in" / "t.jsonl"
    path.write_bytes(_jaxmem_trace())
    result = _replay(capsys, path, flag, str(state.parent / "out" / name))
    assert_one_line(result, flag, name)
    assert os.listdir(state.parent / "out") == []


@pytest.mark.parametrize("sink", ["closed-pipe", "full-disk"])
@pytest.mark.parametrize("command", [("share", "status", "--json"), ("replay", "TRACE", "--json")])
def test_abuse_output_that_cannot_be_written(state: Path, sink: str, command: tuple) -> None:
    if sink == "full-disk" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    trace = state.parent / "in" / "t.jsonl"
    trace.write_bytes(_jaxmem_trace())
    argv = jaxmem_argv(*[str(trace) if a == "TRACE" else a for a in command])
    with jaxmem.reserve("1GiB", capacity="16GiB", label="x" * 150):
        if sink == "full-disk":
            with open("/dev/full", "w") as full:
                done = subprocess.run(argv, env=child_env(state), stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
        else:
            proc = subprocess.Popen(argv, env=child_env(state), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            proc.stdout.close()
            err = proc.stderr.read()
            done = subprocess.CompletedProcess(argv, proc.wait(timeout=60), "", err)
    assert_one_line(done, "cannot write the output")


@pytest.mark.parametrize("argv,needle", [
    (["run", "--memory", "200%", "--capacity", "16GiB", "--", "true"], "percentage"),
    (["run", "--memory", "nan%", "--capacity", "16GiB", "--", "true"], "percentage"),
    (["run", "--memory", "inf%", "--capacity", "16GiB", "--", "true"], "percentage"),
    (["run", "--memory", "1GiB", "--capacity", "16GiB", "--device", "-1", "--", "true"], "device"),
    (["run", "--memory", "1GiB", "--capacity", "16GiB", "--wait", "nan", "--", "true"], "wait"),
    (["run", "--memory", "1GiB", "--capacity", "16GiB"], "no command"),
    (["run", "--memory", "[/bold]", "--capacity", "16GiB", "--", "true"], "[/bold]"),
    (["share", "repair", "--device", "9"], "no ledger"),
    (["replay", "x.json", "--allocator", "bogus[/]"], "bogus[/]"),
])
def test_abuse_bad_arguments_are_one_line(state: Path, capsys, argv: list, needle: str) -> None:
    assert_one_line(cli(capsys, *argv, measure_memory=False), needle)


def test_abuse_run_label_from_command_with_escapes(state: Path) -> None:
    done = subprocess.run(jaxmem_argv("run", "--memory", "1GiB", "--capacity", "16GiB", "--",
                                      "sh", "-c", "exit 0", ESC + "[2J[/bold]"),
                          env=child_env(state), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


ZERO_TARGETS = """\
import jax.numpy as jnp


def returns_none():
    return (lambda x: None), (jnp.ones(3),)


def returns_empty():
    return (lambda x: jnp.zeros((0,))), (jnp.ones(3),)
"""


@pytest.fixture
def zero_targets(state: Path) -> Path:
    folder = state.parent / "out" / "t["  # with the file's "]": a TARGET path holding "[/]"
    folder.mkdir()
    path = folder / "]zero.py"
    path.write_text(ZERO_TARGETS)
    return path


@pytest.mark.parametrize("factory", ["returns_none", "returns_empty"])
def test_abuse_analyze_where_xla_holds_nothing(zero_targets: Path, capsys, factory: str) -> None:
    result = cli(capsys, "analyze", f"{zero_targets}:{factory}", measure_memory=False)
    assert result.code == 0, result.err
    assert "t[/]" in result.out and "XLA holds nothing" in result.out


@pytest.mark.parametrize("budget", ["inf%", "nan%", "-5%", "0%"])
def test_abuse_fit_budget_that_is_no_share(zero_targets: Path, capsys, budget: str) -> None:
    result = cli(capsys, "fit", f"{zero_targets}:returns_empty", f"--budget={budget}", measure_memory=False)
    assert_one_line(result, "budget")


# ==== what the command started ================================================================

def _run_detached(state: Path, *args: str) -> subprocess.CompletedProcess:
    """`jaxmem run --memory 40% ARGS`, its stderr through a file: a pipe would stay open in
    the processes the command leaves running, and waiting for its end would wait for them."""
    err = state.parent / "out" / "stderr"
    with open(err, "w") as sink:
        done = subprocess.run(jaxmem_argv("run", "--memory", "40%", "--capacity", "16GiB", *args),
                              env=child_env(state), stdout=subprocess.DEVNULL, stderr=sink, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, "", err.read_text())


@pytest.fixture
def gate(state: Path):
    """A file whose creation ends the processes a case leaves running (they also stop by
    themselves after about a minute, so a failing case leaves nothing behind for long)."""
    path = state.parent / "out" / "go"
    yield path
    path.touch()


def _until_gate(gate: Path) -> str:
    return f"for i in $(seq 1200); do [ -e {gate} ] && break; sleep 0.05; done"


def test_abuse_backgrounded_child_keeps_the_reservation(state: Path, gate: Path) -> None:
    script = f"({_until_gate(gate)}) & exit 0"
    done = _run_detached(state, "--label", "bg", "--", "sh", "-c", script)
    assert done.returncode == 0 and "process(es) running" in done.stderr, done.stderr
    try:
        (held,) = ledger.status()[0]["reservations"]
        assert held["label"] == "bg"
        with pytest.raises(jaxmem.LedgerError, match="'bg'"):
            jaxmem.reserve("70%")  # no 110%
    finally:
        gate.touch()
    deadline = time.monotonic() + 60
    while ledger.status()[0]["reservations"]:
        assert time.monotonic() < deadline, "never reclaimed after the background child exited"
        time.sleep(0.05)


def test_abuse_detached_daemon_keeps_the_reservation(state: Path, gate: Path) -> None:
    daemon = f"setsid sh -c '({_until_gate(gate)}) & exit 0' & exit 0"
    done = _run_detached(state, "--label", "daemon", "--", "sh", "-c", daemon)
    assert done.returncode == 0, done.stderr
    try:
        assert [r["label"] for r in ledger.status()[0]["reservations"]] == ["daemon"], done.stderr
    finally:
        gate.touch()


# ==== the library ==============================================================================

def test_abuse_jit_keyword_arguments() -> None:
    import jax.numpy as jnp
    import numpy as np

    def f(x, y=1.0):
        return x * y + 1

    np.testing.assert_allclose(jaxmem.jit(f)(jnp.ones(3), y=2.0), np.full(3, 3.0))
    np.testing.assert_allclose(jaxmem.jit(f)(jnp.ones(3)), np.full(3, 2.0))


def test_abuse_host_device_larger_than_memory() -> None:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    device = jaxmem.Device(capacity=4 * total, backend="host", preallocate=False)
    buffer = device.allocate(1 << 20)
    device.view(buffer)[:] = 7
    assert int(device.view(buffer)[-1]) == 7
