"""What a person at a terminal sees: the help, and the transient progress bar while planning."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from jaxmem.cli.main import main as cli_main

ENTRY = "import sys; from jaxmem.cli.main import entry; sys.argv = ['jaxmem'] + sys.argv[1:]; entry()"


def test_analyze_help_and_command_list(capsys):
    assert cli_main([]) == 2
    assert "analyze" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli_main(["analyze", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "TARGET" in out and "--donate" in out and "--json" in out and "--execute" in out and "--html" in out


def _run_in_pty(argv: list[str], timeout: float = 300.0) -> tuple[int, str]:
    main_fd, child_fd = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-c", ENTRY, *argv], stdin=child_fd, stdout=child_fd,
                            stderr=child_fd, env=env, close_fds=True)
    os.close(child_fd)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main_fd], [], [], 0.5)
        if ready:
            try:
                data = os.read(main_fd, 65536)
            except OSError:   # the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(main_fd)
    return proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow   # the full default model, in a fresh interpreter
def test_analyze_shows_a_progress_bar_on_a_terminal_when_planning_is_slow():
    code, text = _run_in_pty(["analyze"])
    assert code == 0, text[-2000:]
    # The bar's label was drawn (on a terminal only; piped output never has it) ...
    assert "planning" in text
    # ... and the report followed it.
    assert "jaxmem peak" in text and "Largest buffers live at the peak" in text
