"""A floating-point warning inside a planned step names the user's line, not the generated code,
and numpy's own settings (np.seterr) still decide what happens."""

from __future__ import annotations

import inspect
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem


def overflowing(x):
    y = jnp.exp(x * 100.0)
    return jnp.log1p(y).sum()


EXP_LINE = inspect.getsourcelines(overflowing)[1] + 1


def test_an_overflow_warning_names_the_users_line():
    x = np.linspace(0, 10, 1000, dtype=np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxmem.jit(overflowing)(x)
    mine = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert mine, "numpy's overflow in exp was not reported"
    assert all("<jaxmem plan>" not in w.filename for w in mine)
    first = mine[0]
    assert first.filename == __file__ and first.lineno == EXP_LINE
    assert str(first.message) == "overflow encountered in exp"


def test_numpy_settings_are_kept():
    x = np.linspace(0, 10, 1000, dtype=np.float32)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        jaxmem.jit(overflowing)(x)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxmem.jit(overflowing)(x)           # ignored, as the user asked: no warning to raise
