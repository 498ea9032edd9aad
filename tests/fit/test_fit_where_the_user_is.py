"""`jaxmem.fit` judged by a device's XLA from a process whose JAX was not started on the CPU alone
(a notebook on a TPU VM, the training script itself): each candidate is lowered there and
compiled deviceless in a child. The truth is the same compile made in a process started with
JAX_PLATFORMS=cpu, where the compiler runs in-process (itself held to the chips' figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, jax, jax.numpy as jnp
import jaxmem
from jaxmem.fitting.judge import Judge

def step(w, x):
    def loss(w):
        h = x
        for _ in range(4):
            h = jnp.tanh(h @ w)
        return (h ** 2).sum()
    return w - 0.1 * jax.grad(loss)(w)

w, x = jnp.ones((512, 512)), jnp.ones((2048, 512))
judge = Judge({device!r})
figures = judge.figures(step, (w, x), (0,))
out = {{"platforms": jax.config.jax_platforms, "figures": [figures.argument, figures.output, figures.temp, figures.alias]}}
if {fit}:
    result = jaxmem.fit(step, w, x, budget="half-temp", donate_argnums=0, device={device!r}, source_rewrites=False)
    out.update(fits=result.fits, total=result.xla_total_bytes, budget=result.budget_bytes, code=result.policy_code)
print(json.dumps(out))
"""


def _run(device: str, on_cpu: bool, fit: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if on_cpu:   # as `jaxmem fit --device` starts: the compilers in this process, set up as libtpu needs
        from jaxmem.xla.tpu.compile import DEVICELESS_ENV

        env.update(DEVICELESS_ENV, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(device=device, fit=fit)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _needs(device: str) -> None:
    from jaxmem.xla.gpu.compile import unavailable_reason as gpu_reason
    from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

    if tpu_reason() if device.startswith("tpu") else gpu_reason():
        pytest.skip("the device's compiler is not installed here")


def test_a_candidate_is_judged_the_same_from_a_process_not_started_on_the_cpu():
    _needs("h100-80gb")
    here, child = _run("h100-80gb", on_cpu=True, fit=False), _run("h100-80gb", on_cpu=False, fit=False)
    assert here["platforms"] == "cpu" and child["platforms"] in (None, "")
    assert child["figures"] == here["figures"]


@pytest.mark.slow
def test_fit_for_a_tpu_answers_the_same_from_a_process_not_started_on_the_cpu():
    _needs("tpu-v5e-16gb")
    here, child = _run("tpu-v5e-16gb", on_cpu=True, fit=True), _run("tpu-v5e-16gb", on_cpu=False, fit=True)
    assert child["figures"] == here["figures"]
    assert (child["fits"], child["total"], child["budget"], child["code"]) == \
        (here["fits"], here["total"], here["budget"], here["code"])
