"""The report's peak step and its buffers, against a brute-force sweep over the plan."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.cli.analyze import parse_donate
from jaxmem.reports.analysis import live_bytes_by_step, peak_buffers, summarize
from jaxmem.compiler.planner import plan
from jaxmem.errors import PlanError
from jaxmem.examples.suite import PROGRAMS


@pytest.mark.parametrize("name", ["mlp_train", "rnn_scan_grad", "while_cond"])
def test_analyze_live_bytes_match_a_brute_force_sweep(name):
    fn, args = PROGRAMS[name].factory()
    p = plan(fn, *args, xla=False)
    live = live_bytes_by_step(p)
    assert len(live) == len(p.schedule) + 2
    for step in range(-1, len(p.schedule) + 1):
        assert live[step + 1] == sum(b.size for b in p.live_at(step)), step
    # Nothing live at once can need more than the arena the plan placed it in.
    assert max(live) <= p.arena_bytes

    peak_step, rows = peak_buffers(p, args, top=10**6)
    assert live[peak_step + 1] == max(live)
    in_arena = [r for r in rows if r["offset"] is not None]
    assert sum(r["size_bytes"] for r in in_arena) == max(live)
    outside = [r for r in rows if r["offset"] is None]
    assert sum(r["size_bytes"] for r in outside) == p.argument_bytes - sum(
        p.values[v].nbytes for v in p.invars if p.values[v].buffer is not None)


def test_analyze_argument_rows_are_named_by_their_pytree_path():
    def fn(params, x):
        return jnp.tanh(x @ params["w"]) + params["b"]

    args = ({"b": jnp.zeros(64), "w": jnp.ones((128, 64))}, jnp.ones((32, 128)))
    p = plan(fn, *args, xla=False)
    _, rows = peak_buffers(p, args, top=10)
    labels = {r["label"] for r in rows if r["kind"] == "argument"}
    assert "args[0]['w']" in labels and "args[1]" in labels


def test_analyze_summary_fit_threshold_is_75_percent():
    fn, args = PROGRAMS["while_cond"].factory()
    p = plan(fn, *args, xla=False)
    exact = int(np.ceil(p.peak_bytes / 0.75))
    fits = summarize(p, args, target="t", device=("x", exact + 4), top=3)
    short = summarize(p, args, target="t", device=("x", exact - 4), top=3)
    assert fits["fits"] is True and short["fits"] is False
    assert fits["xla_total_bytes"] is None and len(fits["top_buffers"]) <= 3


def test_analyze_parse_donate():
    assert parse_donate("", 3) == ()
    assert parse_donate("2,0,2", 3) == (0, 2)
    with pytest.raises(PlanError):
        parse_donate("3", 3)
    with pytest.raises(PlanError):
        parse_donate("-1", 3)
