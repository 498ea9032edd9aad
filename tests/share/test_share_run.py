"""`jaxmem run`: the environment a real JAX program is given, exit codes, signals, and who holds
the reservation when the wrapper or the command dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from share_helpers import PYTHON, isolated_env, jaxmem_cmd, journal, run_cli

import jaxmem
from jaxmem.share import ledger, store
from jaxmem.units import GiB, MiB


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("JAXMEM_STATE_DIR", str(path))
    monkeypatch.setenv("JAXMEM_NVIDIA_SMI", "none")
    return path


def _reserved(device: int = 0) -> int:
    rows = [r for r in ledger.status() if r["device"] == device]
    return rows[0]["reserved"] if rows else 0


def _until(predicate, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:  # it will never happen now: say why at once
            raise AssertionError(f"process exited ({proc.returncode}) first: {proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def _queued() -> list:
    """The waiters, read without the lock: a poller that took the ledger's lock fifty times a
    second would, when descheduled while holding it on a loaded machine, stall the very
    process it waits for."""
    state = store.load(store.paths_for(0))
    return state["waiters"] if state else []


SHOW_ENV = textwrap.dedent("""\
    import json, os, jax
    from jaxlib import xla_client
    from jaxmem.share.ledger import status
    names = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES",
             "CUDA_DEVICE_ORDER", "JAXMEM_RESERVATION", "XLA_PYTHON_CLIENT_PREALLOCATE")
    print(json.dumps({"env": {n: os.environ.get(n) for n in names},
                      "sum": float(jax.numpy.ones(3).sum()), "pid": os.getpid(), "ppid": os.getppid(),
                      "gpu_options": xla_client.generate_pjrt_gpu_plugin_options(),
                      "status": status()}))
    """)


def test_share_run_real_jax_program(state: Path) -> None:
    # The brief's own one-liner first: the fraction JAX sees, and JAX really running.
    done = subprocess.run(jaxmem_cmd("run", "--memory", "30%", "--capacity", "16GiB", "--",
                                     PYTHON, "-c", "import os, jax; print(os.environ['XLA_CLIENT_MEM_FRACTION'], jax.numpy.ones(3).sum())"),
                          env=isolated_env(state), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.3", "3.0"]
    assert "reserved 4.80 GiB of device 0 (16.00 GiB); XLA_CLIENT_MEM_FRACTION=0.3" in done.stderr

    done = subprocess.run(jaxmem_cmd("run", "--memory", "6GiB", "--label", "jaxjob", "--", PYTHON, "-c", SHOW_ENV),
                          env=isolated_env(state), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    env = seen["env"]
    assert env["XLA_CLIENT_MEM_FRACTION"] == "0.375"  # 6 / 16
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] is None  # never both: JAX would refuse the pair
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("0", "PCI_BUS_ID")
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] is None  # preallocation left at JAX's default: on
    assert seen["sum"] == 3.0
    # JAX's own reading of that environment for its GPU client: the fraction, nothing else.
    assert seen["gpu_options"]["memory_fraction"] == 0.375
    assert "preallocate" not in seen["gpu_options"]
    # While it ran, the command itself was a holder of the reservation, next to the wrapper.
    (row,) = seen["status"]
    (held,) = row["reservations"]
    assert held["label"] == "jaxjob" and held["bytes"] == 6 * GiB
    assert sorted(held["pids"]) == sorted([seen["ppid"], seen["pid"]])
    assert env["JAXMEM_RESERVATION"] == f"0:{held['id']}"
    assert _reserved() == 0  # released when it ended


def test_share_jax_refuses_both_fraction_variables() -> None:
    """Why `jaxmem run` sets one spelling only: JAX's GPU option reader rejects the pair."""
    from jaxlib import xla_client
    saved = {n: os.environ.get(n) for n in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    try:
        os.environ["XLA_CLIENT_MEM_FRACTION"] = os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.3"
        with pytest.raises(ValueError, match="specified together"):
            xla_client.generate_pjrt_gpu_plugin_options()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    from jaxmem.cli.run import NEW_VAR, fraction_variable
    assert fraction_variable() == NEW_VAR  # this jaxlib knows the current name


def test_share_run_replaces_user_settings_and_keeps_preallocate_choice(state: Path) -> None:
    env = isolated_env(state, XLA_PYTHON_CLIENT_MEM_FRACTION="0.9", XLA_PYTHON_CLIENT_PREALLOCATE="false",
                       CUDA_VISIBLE_DEVICES="3")
    done = subprocess.run(jaxmem_cmd("run", "--memory", "4GiB", "--capacity", "16GiB", "--", PYTHON, "-c", SHOW_ENV),
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["env"]["XLA_CLIENT_MEM_FRACTION"] == "0.25" and seen["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] is None
    assert seen["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and seen["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert seen["gpu_options"]["memory_fraction"] == 0.25 and seen["gpu_options"]["preallocate"] is False
    assert "replacing XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in done.stderr
    assert "XLA_PYTHON_CLIENT_PREALLOCATE is false" in done.stderr
    assert "replacing CUDA_VISIBLE_DEVICES=3 with 0" in done.stderr
    # For an older JAX: the old spelling only.
    done = subprocess.run(jaxmem_cmd("run", "-q", "--memory", "4GiB", "--fraction-var", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                     "--", PYTHON, "-c", SHOW_ENV), env=isolated_env(state), capture_output=True, text=True, timeout=120)
    seen = json.loads(done.stdout)
    assert (seen["env"]["XLA_CLIENT_MEM_FRACTION"], seen["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == (None, "0.25")
    assert seen["gpu_options"]["memory_fraction"] == 0.25
    # `-q`: jaxmem says nothing. What the child's JAX prints at start-up when the CUDA plugin is
    # installed on a machine with no GPU (absl lines, JAX's plugin traceback) is not jaxmem's.
    from jaxmem.xla.start import filter_noise

    assert filter_noise(done.stderr) == ""


def test_share_run_capacity_from_fake_nvidia_smi(tmp_path: Path, state: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text('#!/bin/sh\ncase "$*" in *"-i 1"*) echo 81559 ;; *) exit 3 ;; esac\n')
    (bindir / "nvidia-smi").chmod(0o755)
    env = isolated_env(state, PATH=f"{bindir}:{os.environ['PATH']}")
    del env["JAXMEM_NVIDIA_SMI"]
    code = "import os; print(os.environ['XLA_CLIENT_MEM_FRACTION'], os.environ['CUDA_VISIBLE_DEVICES'])"
    done = subprocess.run(jaxmem_cmd("run", "--memory", "25%", "--device", "1", "--", PYTHON, "-c", code),
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.25", "1"]
    assert "of device 1 (79.65 GiB)" in done.stderr  # 81559 MiB
    assert [e for e in journal(state, device=1) if e["op"] == "grant"][0]["bytes"] == 81559 * MiB // 4


@pytest.mark.parametrize("script, code", [("exit 0", 0), ("exit 1", 1), ("exit 7", 7), ("exit 255", 255),
                                          ("kill -TERM $$", 128 + 15), ("kill -KILL $$", 128 + 9)])
def test_share_run_exit_codes_pass_through(state: Path, script: str, code: int) -> None:
    done = run_cli(isolated_env(state), "run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--", "sh", "-c", script)
    assert done.returncode == code, done.stderr
    assert _reserved() == 0
    assert [e["op"] for e in journal(state)][-1] == "release"


def test_share_run_errors_are_one_line(state: Path) -> None:
    env = isolated_env(state)
    for args, text in ((["run", "--memory", "1GiB", "--capacity", "16GiB"], "no command to run"),
                       (["run", "--memory", "lots", "--capacity", "16GiB", "--", "true"], "cannot read size 'lots'"),
                       (["run", "--memory", "1GiB", "--", "true"], "capacity is unknown"),
                       (["run", "--memory", "20GiB", "--capacity", "16GiB", "--", "true"], "exceeds the whole device")):
        done = run_cli(env, *args)
        assert done.returncode == 2 and text in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    done = run_cli(env, "run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--", "no-such-command-xyz")
    assert done.returncode == 127 and "cannot run 'no-such-command-xyz'" in done.stderr
    assert _reserved() == 0


TRAP = textwrap.dedent("""\
    import os, signal, sys, time
    def stop(signum, frame):
        open(sys.argv[1], "w").write(str(signum))
        os._exit(40 + signum)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    print(os.getpid(), flush=True)
    time.sleep(60)
    """)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_share_run_signals_reach_the_command_and_release(tmp_path: Path, state: Path, signum: int) -> None:
    marker = tmp_path / "got"
    wrapper = subprocess.Popen(jaxmem_cmd("run", "-q", "--memory", "4GiB", "--capacity", "16GiB", "--",
                                          PYTHON, "-c", TRAP, str(marker)),
                               env=isolated_env(state), stdout=subprocess.PIPE, text=True)
    child = int(wrapper.stdout.readline())
    assert _reserved() == 4 * GiB
    wrapper.send_signal(signum)
    assert wrapper.wait(timeout=20) == 40 + signum  # the command's own exit code
    assert marker.read_text() == str(int(signum))  # it got the signal, once
    assert _reserved() == 0
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1][:3]


def test_share_run_default_sigterm_kills_command(state: Path) -> None:
    wrapper = subprocess.Popen(jaxmem_cmd("run", "-q", "--memory", "4GiB", "--capacity", "16GiB", "--",
                                          PYTHON, "-c", "import time; print('up', flush=True); time.sleep(60)"),
                               env=isolated_env(state), stdout=subprocess.PIPE, text=True)
    assert wrapper.stdout.readline().strip() == "up"
    wrapper.terminate()
    assert wrapper.wait(timeout=20) == 128 + signal.SIGTERM
    assert _reserved() == 0


def test_share_run_wrapper_sigkilled_command_keeps_reservation(tmp_path: Path, state: Path) -> None:
    go = tmp_path / "go"
    code = f"import os, pathlib, time\nprint(os.getpid(), flush=True)\nwhile not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
    wrapper = subprocess.Popen(jaxmem_cmd("run", "-q", "--memory", "5GiB", "--capacity", "16GiB", "--label", "orphan",
                                          "--", PYTHON, "-c", code),
                               env=isolated_env(state), stdout=subprocess.PIPE, text=True)
    child = int(wrapper.stdout.readline())
    wrapper.kill()
    wrapper.wait(timeout=10)
    # The wrapper is gone; the command lives on, and so does its memory.
    time.sleep(0.3)
    assert _reserved() == 5 * GiB
    (held,) = ledger.status()[0]["reservations"]
    assert held["pids"] == [wrapper.pid, child] and held["label"] == "orphan"
    with pytest.raises(jaxmem.LedgerError, match="'orphan' 5.00 GiB"):
        jaxmem.reserve("12GiB")
    go.touch()
    _until(lambda: _reserved() == 0)  # reclaimed once the command has exited
    (event,) = [e for e in journal(state) if e["op"] == "reclaim"]
    assert event["reason"] == "dead" and event["label"] == "orphan"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_share_run_signal_while_waiting_leaves_queue(state: Path, signum: int) -> None:
    # A queued wrapper exits about 20 ms after either signal; the waits are hang detectors (120 s),
    # and the poller reads without the ledger's lock. The wrapper honours a signal its parent
    # ignores (as nohup's users expect), and a shell without job control starts its background
    # jobs with SIGINT ignored (`pytest ... &` in a script: this case then hung for 120 s), so the
    # wrapper starts here with SIGINT at its default, as from a terminal.
    with jaxmem.reserve("12GiB", capacity="16GiB", label="big"):
        wrapper = subprocess.Popen(jaxmem_cmd("run", "-q", "--memory", "8GiB", "--wait", "600", "--",
                                              "sh", "-c", "echo ran"),
                                   env=isolated_env(state), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        _until(_queued, timeout=120, proc=wrapper)
        wrapper.send_signal(signum)
        assert wrapper.wait(timeout=120) == 128 + signum
        assert wrapper.stdout.read() == ""  # the command never ran
        assert ledger.status()[0]["waiters"] == []
    events = journal(state)
    assert [e["reason"] for e in events if e["op"] == "abandon"] == ["interrupted"]


def test_share_run_waits_then_runs(state: Path) -> None:
    held = jaxmem.reserve("12GiB", capacity="16GiB", label="big")
    wrapper = subprocess.Popen(jaxmem_cmd("run", "-q", "--memory", "8GiB", "--wait", "60", "--", "sh", "-c", "echo ran"),
                               env=isolated_env(state), stdout=subprocess.PIPE, text=True)
    _until(lambda: ledger.status()[0]["waiters"])
    held.release()
    assert wrapper.wait(timeout=30) == 0
    assert wrapper.stdout.read() == "ran\n"
    done = run_cli(isolated_env(state), "run", "--memory", "12GiB", "--wait", "0.5", "--", "true")
    assert done.returncode == 0


def test_share_status_cli(state: Path) -> None:
    with jaxmem.reserve("25%", capacity="16GiB", label="shown"):
        env = isolated_env(state)
        done = run_cli(env, "share", "status", "--json")
        assert done.returncode == 0
        data = json.loads(done.stdout)
        assert data["state_dir"] == str(state)
        (row,) = data["devices"]
        assert (row["capacity"], row["reserved"], row["free"]) == (16 * GiB, 4 * GiB, 12 * GiB)
        assert row["reservations"][0]["label"] == "shown" and row["reservations"][0]["pids"] == [os.getpid()]
        done = run_cli(env, "share", "status")
        assert done.returncode == 0
        assert "device 0: 16.00 GiB total, 4.00 GiB reserved, 12.00 GiB free" in done.stdout
        assert "shown" in done.stdout and "25.0%" in done.stdout
    done = run_cli(isolated_env(state), "share", "bogus")
    assert done.returncode == 2 and "Traceback" not in done.stderr


COUNT_SIGINT = textwrap.dedent("""\
    import os, signal, sys, time
    count = 0
    def bump(signum, frame):
        global count
        count += 1
    signal.signal(signal.SIGINT, bump)
    print("ready", flush=True)
    while count == 0:
        time.sleep(0.01)
    time.sleep(1.0)  # a second, duplicated delivery would land in this window
    open(sys.argv[1], "w").write(str(count))
    """)


def test_share_run_terminal_ctrl_c_is_not_delivered_twice(tmp_path: Path, state: Path) -> None:
    """Ctrl-C at a terminal reaches the whole foreground group, the command included; the wrapper
    must not forward that one again. A real pseudo-terminal, so the kernel sends it."""
    import fcntl
    import pty
    import termios

    marker = tmp_path / "count"
    master, slave = pty.openpty()

    def take_terminal() -> None:  # runs in the wrapper's process after setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    wrapper = subprocess.Popen(jaxmem_cmd("run", "-q", "--memory", "1GiB", "--capacity", "16GiB", "--",
                                          PYTHON, "-c", COUNT_SIGINT, str(marker)),
                               env=isolated_env(state), stdin=slave, stdout=slave, stderr=slave,
                               start_new_session=True, preexec_fn=take_terminal)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    while b"ready" not in seen:
        assert time.monotonic() < deadline, seen
        seen += os.read(master, 1024)
    os.write(master, b"\x03")  # the terminal's interrupt character: the kernel signals the group
    assert wrapper.wait(timeout=30) == 0
    assert marker.read_text() == "1"
    os.close(master)
    assert _reserved() == 0


def test_share_run_forwarding_rule() -> None:
    from jaxmem.cli.run import should_forward
    kernel, user, queued = 0x80, 0, -1  # SI_KERNEL, SI_USER, SI_QUEUE
    assert not should_forward(kernel, 100, 100)  # terminal signal, command in our group: it has it
    assert should_forward(kernel, 200, 100)  # command moved to its own group: it did not get it
    assert should_forward(user, 100, 100) and should_forward(queued, 100, 100)  # kill()/sigqueue(): ours alone


def test_share_run_keeps_exit_code_when_ledger_breaks_meanwhile(state: Path) -> None:
    ledger_file = state / "device-0.json"
    done = run_cli(isolated_env(state), "run", "-q", "--memory", "2GiB", "--capacity", "16GiB", "--",
                   "sh", "-c", f"printf '{{' > {ledger_file}; exit 5")
    assert done.returncode == 5
    assert "could not release the reservation" in done.stderr and "jaxmem share repair" in done.stderr
    done = run_cli(isolated_env(state), "share", "repair")
    assert done.returncode == 0 and "kept 0 live reservation(s)" in done.stdout and "dropped 1" in done.stdout
    assert _reserved() == 0


def test_share_fraction_variable_follows_the_installed_jaxlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.machinery
    import importlib.util

    from jaxmem.cli import run

    old = tmp_path / "jaxlib"
    old.mkdir()
    (old / "xla_client.py").write_text("memory_fraction = os.getenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '')\n")
    spec = importlib.machinery.ModuleSpec("jaxlib", None, is_package=True)
    spec.submodule_search_locations = [str(old)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    assert run.fraction_variable() == run.OLD_VAR  # an older jaxlib reads only the old name
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert run.fraction_variable() == run.NEW_VAR  # no jaxlib beside jaxmem: the current name
    assert run.fraction_variable(run.OLD_VAR) == run.OLD_VAR


def test_share_run_warns_about_platform_allocator(state: Path) -> None:
    env = isolated_env(state, XLA_PYTHON_CLIENT_ALLOCATOR="platform")
    done = run_cli(env, "run", "--memory", "1GiB", "--capacity", "16GiB", "--", "true")
    assert done.returncode == 0 and "platform ignores the memory fraction" in done.stderr
