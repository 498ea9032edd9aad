"""A step whose program jaxmem cannot read as its framework runs it is refused in one line that
says what to pass instead, never analysed as a smaller program: from Python, a `JaxmemError`;
from the command line, one line on stderr and exit code 2. Nothing of the user's is changed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import jaxmem

DEVICE = "8GiB"   # a size: XLA:CPU alone judges it, so these cases need no deviceless compiler


def _refused(call):
    with pytest.raises(jaxmem.JaxmemError) as err:
        call()
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_an_update_to_a_global_is_refused_and_the_global_given_back():
    scope = {"jnp": jnp}
    exec(textwrap.dedent("""
        W = jnp.ones((4, 4))
        def step(x):
            global W
            W = W - x.sum()
            return (W * x).sum()
    """), scope)
    before = scope["W"]
    text = _refused(lambda: jaxmem.analyze(scope["step"], jnp.ones((4, 4)), device=DEVICE, quiet=True))
    assert "stores a traced value in" in text and ".W" in text and "return the new value" in text
    assert scope["W"] is before


def test_a_value_kept_by_a_closure_is_refused():
    def make():
        kept = []

        def step(x):
            kept.append(x * 2)
            return x.sum()
        return step

    text = _refused(lambda: jaxmem.analyze(make(), jnp.ones(3), device=DEVICE, quiet=True))
    assert "step's closed-over kept" in text


def test_an_argument_updated_in_place_and_not_returned_is_refused():
    def step(params, x):
        params["w"] = params["w"] - 0.1 * x
        return x.sum()

    text = _refused(lambda: jaxmem.analyze(step, {"w": jnp.ones(3)}, jnp.ones(3), device=DEVICE, quiet=True))
    assert "updates args[0]['w'] in place" in text and "jax.jit drops" in text


def test_an_update_made_in_place_and_returned_is_the_program():
    def step(params, x):
        params["w"] = params["w"] - 0.1 * x
        return params

    result = jaxmem.analyze(step, {"w": jnp.ones(3)}, jnp.ones(3), device=DEVICE, quiet=True)
    assert result.plan.output_bytes == 12


def test_an_object_jax_jit_cannot_take_names_its_place():
    class Model:   # a plain class: not a pytree, not a Flax or Equinox module
        w = jnp.ones(3)

    text = _refused(lambda: jaxmem.analyze(lambda model, x: model.w * x, Model(), jnp.ones(3), device=DEVICE,
                                           quiet=True))
    assert "argument model is a" in text and "Model" in text and "cannot take as an argument" in text


def test_a_jax_jit_step_whose_nnx_updates_are_dropped_is_refused():
    import optax
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: m(x).sum())(model)
        optimizer.update(model, grads)

    kernel = model.kernel[...]
    text = _refused(lambda: jaxmem.analyze(jax.jit(train_step), model, optimizer, jnp.ones((2, 8)), device=DEVICE,
                                           quiet=True))
    assert "jax.jit drops those updates" in text and "nnx.jit(train_step)" in text
    assert (model.kernel[...] == kernel).all()   # the user's model as it was


def _keras_model(build, compiled):
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)] if build else [keras.layers.Dense(3)])
    if compiled:
        model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("case, words", [("never built", "is not built"), ("never compiled", "is not compiled")])
def test_a_keras_model_that_cannot_run_fit_is_refused(case, words):
    import numpy as np

    model = _keras_model(build=case != "never built", compiled=case != "never compiled")
    text = _refused(lambda: jaxmem.analyze(model, np.ones((2, 4), np.float32), np.ones((2, 3), np.float32),
                                           device=DEVICE, quiet=True))
    assert words in text
    assert not model.built or case != "never built"   # jaxmem never builds the user's model


def test_fit_on_a_framework_step_says_what_to_fit_instead():
    import optax
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = nnx.jit(lambda model, optimizer, x: optimizer.update(model, nnx.grad(lambda m: m(x).sum())(model)))
    text = _refused(lambda: jaxmem.fit(step, model, optimizer, jnp.ones((2, 8)), budget="1GiB"))
    assert "not yet Flax NNX's" in text and "nnx.split" in text


FACTORIES = {
    "global": """
        import jax.numpy as jnp
        W = jnp.ones((4, 4))
        def step(x):
            global W
            W = W * x
            return x
        def make():
            return step, (jnp.ones((4, 4)),)
    """,
    "keras unbuilt": """
        import os
        os.environ["KERAS_BACKEND"] = "jax"
        import keras, numpy as np
        def make():
            model = keras.Sequential([keras.layers.Dense(3)])
            model.compile(optimizer="sgd", loss="mse")
            return model, (np.ones((2, 4), np.float32), np.ones((2, 3), np.float32))
    """,
    "nnx under jax.jit": """
        import jax, jax.numpy as jnp, optax
        from flax import nnx
        def step(model, optimizer, x):
            optimizer.update(model, nnx.grad(lambda m: m(x).sum())(model))
        def make():
            model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            return jax.jit(step), (model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), jnp.ones((2, 4)))
    """,
}


@pytest.mark.parametrize("case", sorted(FACTORIES))
def test_the_command_line_refuses_in_one_line_with_exit_2(case, tmp_path):
    path = tmp_path / "factory.py"
    path.write_text(textwrap.dedent(FACTORIES[case]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "jaxmem", "analyze", f"{path}:make", "--device", DEVICE, "--no-xla"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("jaxmem analyze: error:") and "Traceback" not in done.stderr


def test_plan_points_a_framework_step_to_analyze_and_refuses_dropped_updates():
    import optax
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def train_step(model, optimizer, x):
        optimizer.update(model, nnx.grad(lambda m: m(x).sum())(model))

    text = _refused(lambda: jaxmem.plan(train_step, model, optimizer, jnp.ones((2, 8))))
    assert "for a Flax NNX step use jaxmem.analyze" in text

    def step(params, x):
        params["w"] = params["w"] * x
        return x

    assert "in place" in _refused(lambda: jaxmem.plan(step, {"w": jnp.ones(3)}, jnp.ones(3)))
    assert jaxmem.plan(lambda w, x: (w * x).sum(), jnp.ones(3), jnp.ones(3)).valid
