"""Every command takes a framework's step: `jaxmem analyze TARGET` and `jaxmem maxbatch` on
factories returning Flax NNX, Equinox and Keras steps (the program the framework compiles),
`jaxmem record` counting the steps of an `nnx.jit` loop and of Keras's `model.fit`, and
`record --predict` setting the pool's prediction for an NNX TARGET beside a recording."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jaxmem

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "KERAS_BACKEND": "jax", "PYTHONPATH": str(REPO / "src")}

NNX_FACTORY = """
    import jax, jax.numpy as jnp, optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(256, 512, rngs=rngs)
            self.l2 = nnx.Linear(512, 10, rngs=rngs)
        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    def make(batch=64):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        return train_step, (model, optimizer, jnp.ones((batch, 256)), jnp.zeros((batch, 10)))

    if __name__ == "__main__":
        import sys
        step = nnx.jit(train_step)
        _, (model, optimizer, x, y) = make()
        for _ in range(int(sys.argv[1])):
            float(step(model, optimizer, x, y))
        print("done")
"""

KERAS_FIT = """
    import os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    import keras, numpy as np
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((256, 32), np.float32), np.zeros((256, 1), np.float32), batch_size=32, epochs=int(sys.argv[1]),
              verbose=0)
    print("done")
"""


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "jaxmem", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def test_analyze_a_target_returning_a_plain_nnx_step_reads_the_program_nnx_runs(tmp_path):
    path = _write(tmp_path, "nnx_step.py", NNX_FACTORY)
    done = _run("analyze", f"{path}:make", "--device", "8GiB", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["framework"]["name"] == "Flax NNX" and "nnx.jit(train_step)" in data["framework"]["how"]
    # the updated state is an output: parameters and Adam's two moments, as nnx.jit returns them
    params = 256 * 512 * 4 + 512 * 4 + 512 * 10 * 4 + 10 * 4
    assert data["xla"]["output_bytes"] >= 3 * params


def test_maxbatch_of_an_nnx_factory_is_judged_on_the_program_nnx_runs():
    import jax.numpy as jnp
    import optax
    from flax import nnx

    def make(batch):
        model = nnx.Linear(1024, 1024, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = nnx.jit(lambda m, o, x: o.update(m, nnx.grad(lambda m: (m(x) ** 2).mean())(m)))
        return step, (model, optimizer, jnp.ones((batch, 1024)))

    result = jaxmem.maxbatch(make, arg="batch", device="tpu-v5e-16gb", lo=1024, hi=4096, quiet=True) \
        if _libtpu() else None
    if result is None:
        pytest.skip("deviceless XLA:TPU compiles cannot run here")
    assert result.value == 4096 and result.at_maximum and result.trials


def _libtpu():
    from jaxmem.xla.tpu.compile import unavailable_reason

    return unavailable_reason() is None


def _recorded_calls(tmp_path, name: str, source: str, arg: str) -> dict:
    """`jaxmem record` of `source` run as a program with `arg`: the calls it counted, by function;
    the program's own output is untouched."""
    program = _write(tmp_path, name, source)
    out = tmp_path / "rec"
    done = _run("record", "--out", str(out), "--interval", "0.05", "--", sys.executable, str(program), arg)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "done\n"
    return json.loads((out / "recording.json").read_text())["calls"]


def test_record_counts_the_steps_of_an_nnx_jit_loop(tmp_path):
    calls = _recorded_calls(tmp_path, "loop.py", NNX_FACTORY, "12")
    assert calls.get("train_step") == 12, calls


def test_record_counts_the_steps_of_keras_fit(tmp_path):
    calls = _recorded_calls(tmp_path, "fit.py", KERAS_FIT, "3")
    assert calls.get("train_step") == 3 * 256 // 32, calls


@pytest.mark.slow
def test_record_predict_takes_an_nnx_target(tmp_path):
    from jaxmem.recording.predict import pool_peaks

    if not _libtpu():
        pytest.skip("deviceless XLA:TPU compiles cannot run here")
    path = _write(tmp_path, "nnx_step.py", NNX_FACTORY)
    peaks = pool_peaks(f"{path}:make", "tpu-v5e-16gb", steps=2)
    assert len(peaks) == 2 and peaks[0] <= peaks[1] and peaks[0] > 3 * (256 * 512 * 4)
