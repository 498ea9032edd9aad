"""XLA:CPU has two schedulers, and a user should hear of the better one: `analyze --cpu-scheduler`
compares with each (compiled in a fresh process, as the benchmarks do), and `fit` says first when
one of them meets the budget with no recompute. Checked against XLA's own figures per scheduler."""

from __future__ import annotations

import json

import pytest

from jaxmem.cli.fit import scheduler_advice
from jaxmem.cli.main import main as cli_main
from jaxmem.xla.cpu.compile import SCHEDULER_FLAGS, xla_reference_in_subprocess

TARGET = "jaxmem.examples.suite:parallel_branches"   # XLA:CPU: dfs 217.1 MiB, bfs 238.1 MiB


@pytest.fixture(scope="module")
def xla_by_scheduler():
    return {name: xla_reference_in_subprocess(TARGET, scheduler=name).total_bytes for name in ("dfs", "bfs")}


def test_scheduler_advice_speaks_only_when_a_scheduler_does_as_well():
    flag = f"XLA_FLAGS=--xla_cpu_scheduler_type={SCHEDULER_FLAGS['dfs']}"
    assert scheduler_advice({"dfs": 90, "bfs": 120}, budget=100, fitted_total=95).endswith(flag)
    assert "meets the budget" in scheduler_advice({"dfs": 90, "bfs": 120}, budget=100, fitted_total=95)
    # over the budget, but below what the rewrite reached: still worth saying, and said so
    assert "needs less than the rewrite" in scheduler_advice({"dfs": 110, "bfs": 120}, budget=100, fitted_total=115)
    assert scheduler_advice({"dfs": 110, "bfs": 120}, budget=100, fitted_total=99) is None
    assert scheduler_advice({}, budget=100, fitted_total=99) is None


def test_analyze_compares_with_the_better_scheduler(capsys, xla_by_scheduler, monkeypatch):
    assert xla_by_scheduler["dfs"] < xla_by_scheduler["bfs"]        # the program is chosen so
    assert cli_main(["analyze", TARGET, "--xla", "cpu", "--cpu-scheduler", "both", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["xla_cpu_schedulers"] == xla_by_scheduler
    assert data["xla"]["scheduler"] == "dfs" and data["xla_total_bytes"] == xla_by_scheduler["dfs"]
    assert data["ratio_to_xla"] == pytest.approx(data["peak_bytes"] / xla_by_scheduler["dfs"])
    monkeypatch.setenv("COLUMNS", "200")
    assert cli_main(["analyze", TARGET, "--xla", "cpu", "--no-xla", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["xla_cpu_schedulers"] is None
    # the default compares with this process's scheduler, and says the other exists
    assert cli_main(["analyze", TARGET, "--xla", "cpu"]) == 0
    assert "--cpu-scheduler both" in capsys.readouterr().out


def test_fit_says_first_when_xla_own_scheduler_meets_the_budget(capsys, xla_by_scheduler, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    budget = (xla_by_scheduler["dfs"] + xla_by_scheduler["bfs"]) // 2
    assert cli_main(["fit", TARGET, "--budget", str(budget), "--rounds", "1", "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["xla_cpu_schedulers"] == xla_by_scheduler
    assert data["scheduler_advice"].startswith("XLA's own dfs scheduler meets the budget")
    assert cli_main(["fit", TARGET, "--budget", str(budget), "--rounds", "1"]) in (0, 1)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("first: XLA's own dfs scheduler") and SCHEDULER_FLAGS["dfs"] in first
