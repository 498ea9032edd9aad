"""Usage errors (an unknown flag, a missing argument, a bad choice) are one line on stderr and
exit code 2 for every subcommand, like every other error a user can cause."""

from __future__ import annotations

import pytest

from jaxmem.cli.main import SUBCOMMANDS, main

BAD = {
    "demo": ["--no-such-flag"],
    "analyze": ["--top"],
    "fit": ["jaxmem.examples.suite:mlp_train", "--budget"],
    "replay": [],
    "run": ["--memory"],
    "share": ["no-such-action"],
    "maxbatch": ["jaxmem.examples.suite:mlp_train"],
    "optimize": ["--json"],
    "explain": ["--no-such-flag"],
    "record": ["--interval"],
    "compilers": ["--no-such-flag"],
}


def test_every_subcommand_has_a_bad_usage_case() -> None:
    assert set(SUBCOMMANDS) <= set(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_usage_error_is_one_line(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([name, *BAD[name]])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"jaxmem {name}: error: ") and f"jaxmem {name} --help" in err


def test_help_still_shows_the_full_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["maxbatch", "--help"])
    assert exit_.value.code == 0
    assert "usage: jaxmem maxbatch" in capsys.readouterr().out
