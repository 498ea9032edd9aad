#!/usr/bin/env bash
# Set-up on the machine with the TPU v5e before benchmarks/tpu_chip.py (or tpu_chip_frameworks.py)
# runs there: JAX, jaxlib and libtpu are the machine's own (JAX 0.10.2, libtpu 0.0.42.1); flax,
# optax, h5py, rich and sortedcontainers come from its package index; Equinox, dm-haiku, Keras and
# the needs of theirs the index lacks from wheels in .whl-tpu/ (made with `pip download --no-deps
# equinox==0.13.8 jaxtyping==0.3.11 wadler_lindig==0.1.8 dm-haiku==0.0.17 jmp==0.0.4
# tabulate==0.10.0 keras==3.15.1 namex==0.1.0 optree==0.20.0`, the versions constraints.txt pins).
# Both go at the end of PYTHONPATH, after the machine's JAX. Source it: `. benchmarks/tpu_chip_setup.sh`.
export PIP_CONFIG_FILE=/dev/null
python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site-index \
  "flax==0.12.8" "optax==0.2.8" h5py rich sortedcontainers >/tmp/pip-index.log 2>&1 \
  || python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site-index \
  flax optax h5py rich sortedcontainers >>/tmp/pip-index.log 2>&1 || tail -5 /tmp/pip-index.log
if ls .whl-tpu/*.whl >/dev/null 2>&1; then
  python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-wheels .whl-tpu/*.whl
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:/tmp/site-wheels:/tmp/site-index
export PYTHONUNBUFFERED=1
export KERAS_BACKEND=jax
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
python3 -c "import equinox, haiku, keras; print('equinox', equinox.__version__, 'haiku', haiku.__version__, 'keras', keras.__version__)" || true
