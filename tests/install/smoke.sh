#!/usr/bin/env bash
# jaxmem installed beside a JAX a user already has: for each JAX version given, a fresh venv
# holding only that JAX; jaxmem installed into it as the README's "Installing beside your own
# JAX" says; then checks that
#   (a) that JAX version is still the one installed,
#   (b) `python -c "import jax; print(jax.numpy.ones(3).sum())"` prints byte for byte what it
#       printed before, stdout and stderr,
#   (c) after `jaxmem compilers install`, `jaxmem analyze` on the built-in example compiles
#       deviceless for each --device given (XLA:GPU for h100-80gb, XLA:TPU for tpu-v5e-16gb).
#
#   tests/install/smoke.sh 0.9.2 0.8.3                   # both devices, each JAX
#   JAXMEM_SMOKE_DEVICES=h100-80gb tests/install/smoke.sh 0.9.2
#
# Each step prints its seconds. The venvs and the compilers go under $JAXMEM_SMOKE_DIR (default:
# a new temporary folder, removed at the end unless JAXMEM_SMOKE_KEEP=1).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
devices=${JAXMEM_SMOKE_DEVICES:-h100-80gb tpu-v5e-16gb}
work=${JAXMEM_SMOKE_DIR:-$(mktemp -d -t jaxmem-smoke-XXXXXX)}
[ "${JAXMEM_SMOKE_KEEP:-0}" = 1 ] || [ -n "${JAXMEM_SMOKE_DIR:-}" ] || trap 'rm -rf "$work"' EXIT
export JAXMEM_HOME="$work/home"
probe='import jax; print(jax.numpy.ones(3).sum())'

step() {   # step LABEL COMMAND...: run it, print its seconds; its output only when it fails
  local label=$1 started=$SECONDS log="$work/step.log"
  shift
  if ! "$@" >"$log" 2>&1; then
    cat "$log"; echo "smoke: FAILED: $label"; return 1
  fi
  echo "smoke: $label: $((SECONDS - started)) s"
}

smoke() {
  local version=$1 venv="$work/venv-$1" out="$work/out-$1"
  mkdir -p "$out"
  step "jax $version: venv with only jax==$version" \
    bash -c "python3 -m venv '$venv' && '$venv/bin/pip' install -q 'jax==$version'"
  (cd "$work" && "$venv/bin/python" -c "$probe" >"$out/before.out" 2>"$out/before.err" || true)
  step "jax $version: pip install jaxmem" "$venv/bin/pip" install -q "$repo"
  local now
  now=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("jax"))')
  [ "$now" = "$version" ] || { echo "smoke: FAILED: jax $version became $now"; return 1; }
  (cd "$work" && "$venv/bin/python" -c "$probe" >"$out/after.out" 2>"$out/after.err" || true)
  cmp "$out/before.out" "$out/after.out" && cmp "$out/before.err" "$out/after.err" \
    || { echo "smoke: FAILED: jax $version prints otherwise after jaxmem's install"; return 1; }
  echo "smoke: jax $version: still $now; '$probe' prints the same ($(wc -l <"$out/after.out") line(s), $(wc -c <"$out/after.err") B on stderr)"
  local kinds=()
  case "$devices" in *h100*|*a100*) kinds+=(--gpu) ;; esac
  case "$devices" in *tpu*) kinds+=(--tpu) ;; esac
  [ ${#kinds[@]} -eq 2 ] && kinds=()
  step "jax $version: jaxmem compilers install ${kinds[*]}" "$venv/bin/jaxmem" compilers install "${kinds[@]}"
  for device in $devices; do
    step "jax $version: jaxmem analyze --device $device" \
      bash -c "cd '$repo' && '$venv/bin/jaxmem' analyze --device $device >'$out/$device.txt' 2>&1"
    local row="XLA:GPU $device"
    case "$device" in tpu-*) row="XLA:TPU $device" ;; esac
    grep -q "^  $row " "$out/$device.txt" \
      || { cat "$out/$device.txt"; echo "smoke: FAILED: jax $version: no '$row' row"; return 1; }
    echo "smoke: jax $version: $(grep "^  $row " "$out/$device.txt" | tr -s ' ' | cut -c1-110)"
  done
}

[ $# -gt 0 ] || { echo "usage: tests/install/smoke.sh JAX_VERSION..."; exit 2; }
for version in "$@"; do
  smoke "$version"
done
echo "smoke: passed for jax $*"
