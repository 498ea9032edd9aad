"""The compile children's protocol, both sides: what `child_reply` prints and exits with is what
`child_answer` reads back, the figures as they were or the error as its own kind in one line."""

from __future__ import annotations

import pytest

from jaxmem.errors import PlanError, ShardingError
from jaxmem.xla.gpu.compile import GpuUnavailable, child_answer, child_reply


def _round_trip(capsys, compile):
    code = child_reply(compile)
    out = capsys.readouterr()
    assert out.err.count("\n") <= 1
    return child_answer(code, "plugin noise\n" + out.out, "I0000 log line\n" + out.err, failed="compile of t: ")


def test_figures_come_back_as_printed(capsys):
    assert _round_trip(capsys, lambda: {"total_bytes": 7, "cached": False}) == {"total_bytes": 7, "cached": False}


@pytest.mark.parametrize("kind", [GpuUnavailable, ShardingError])
def test_error_kinds_come_back_as_themselves(capsys, kind):
    def compile():
        raise kind("the mesh has 16 devices")

    with pytest.raises(kind, match=r"^the mesh has 16 devices$"):
        _round_trip(capsys, compile)


def test_any_other_error_is_a_plan_error_with_the_callers_words(capsys):
    def compile():
        raise PlanError("TARGET 'x' must be 'path/to/file.py:factory'")

    with pytest.raises(PlanError, match=r"^compile of t: TARGET 'x' must be") as info:
        _round_trip(capsys, compile)
    assert type(info.value) is PlanError


def test_a_child_that_died_without_a_word_names_its_exit_code():
    with pytest.raises(PlanError, match="exit 139"):
        child_answer(139, "", "")
