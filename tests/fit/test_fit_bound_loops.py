"""Issue 12: the lower bound's loop term (`fitting.bound._loop_bound`). While a backward scan
runs it holds its results (the stacked weight gradients and the carried gradient), the residual
stack it reads (where it recomputes from the forward's carried inputs, as under `jax.checkpoint`
on the body), and inside an iteration what its body's heaviest kernel holds. Sound: never above
XLA:GPU's own total (deviceless memory_analysis()) of the step with any policy on its scan body,
offload of the layer input included; and it proves the half-temp budget of a scanned step with
`jax.checkpoint` on the body infeasible."""

from __future__ import annotations

import pytest
from bound_programs import scanned_bounds_script


# The body's own policy (as written), the layer input offloaded to the host, dots saved.
FEW = ["default", "offload_carry", "dots_with_no_batch_dims_saveable"]
EVERY = FEW + ["nothing_saveable", "dots_saveable", "everything_saveable", None]


def _check(got: dict) -> None:
    for label, total in got["totals"].items():
        assert got["bound"] <= total, (label, got["bound"], total, got["line"])
    # The loop term sets it, and proves the half-temp budget infeasible. The residual stack could
    # sit in host memory, but without it the bound (the softmax backward's operands counted where
    # they are read) still exceeds the budget, so the verdict claims offload policies too.
    assert got["line"].startswith("while the scan"), got["line"]
    assert got["bound"] > got["half_temp"]
    assert got["verdict"] is not None and "host offload included" in got["verdict"], got["verdict"]


@pytest.mark.slow  # benchmark-sized: XLA compiles of whole steps; in the slow pass
def test_the_loop_term_never_exceeds_xla_gpu_totals_and_proves_a_scanned_step_infeasible(run_gpu_script):
    """Three XLA:GPU compiles of a 4-layer scanned transformer: the body as written, its input
    offloaded, the dots saved."""
    _check(run_gpu_script(scanned_bounds_script(FEW)))


@pytest.mark.slow
def test_the_loop_term_never_exceeds_xla_gpu_totals_of_every_body_policy(run_gpu_script):
    _check(run_gpu_script(scanned_bounds_script(EVERY)))


def test_the_loop_state_and_residual_stack_are_the_parameters_gradients_and_the_layer_inputs():
    """Counted from the arguments, not the jaxpr: the backward scan's results are a gradient
    for every stacked layer parameter and the gradient of the scan's input; its residual stack
    holds one layer input per layer."""
    import jax
    from bound_programs import scanned_lm

    from jaxmem.fitting.bound import lower_bound

    fn, args = scanned_lm("default", layers=4, seq=128)
    params = args[0]
    stacked = sum(leaf.nbytes for leaf in jax.tree.leaves(params["layers"]))
    batch, seq = args[2].shape[0], args[2].shape[1] - 1
    layer_input = batch * seq * params["embed"].shape[1] * 4
    bound = lower_bound(fn, args, (0, 1))
    assert bound.loop == "scan"
    assert bound.loop_state_bytes == stacked + layer_input
    assert bound.residual_bytes == 4 * layer_input
    # Without `jax.checkpoint` on the body the backward reads what the forward saved, whose
    # content a policy changes: no residual stack is claimed.
    fn, args = scanned_lm(None, layers=4, seq=128)
    unchecked = lower_bound(fn, args, (0, 1))
    assert unchecked.loop == "scan" and unchecked.residual_bytes == 0
    assert unchecked.loop_state_bytes == stacked + layer_input
