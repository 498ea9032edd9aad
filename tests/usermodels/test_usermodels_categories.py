"""On models written with Flax (linen and NNX) and Equinox: the batch is an input, the weights are
parameters and Adam's moments optimizer state, decided from data flow whatever the pytree."""

from __future__ import annotations

import jax
import pytest
from user_models import STEPS

import jaxmem
from jaxmem.reports.categories import argument_reasons, value_categories


@pytest.mark.parametrize("name", sorted(STEPS))
def test_a_train_step_batch_is_inputs_and_its_weights_parameters(name):
    step, args = STEPS[name]()
    plan = jaxmem.plan(step, *args, xla=False)
    cats, why = value_categories(plan), argument_reasons(plan)
    counts = [len(jax.tree.leaves(a)) for a in args]
    flat = [cats[v] for v in plan.invars]
    params, opt, batch = flat[:counts[0]], flat[counts[0]:counts[0] + counts[1]], flat[counts[0] + counts[1]:]
    assert set(params) == {"parameters"}
    assert set(batch) == {"inputs"} and len(batch) == 2
    # optax's adam state: the two moment trees are optimizer state, and so is its step count
    assert set(opt) == {"optimizer_state"}
    assert all(why[v] for v in plan.invars)
