"""Start JAX in jaxmem's own processes without the CUDA plugin's start-up noise.

Where `jax-cuda12-plugin` is on the path (jaxmem's compile processes put its folder of
compilers there, `xla.compilers`; a GPU user may have it installed), every JAX process on a
machine without a GPU prints absl lines such as
"cudart_stub.cc:31] Could not find cuda drivers on your machine" while importing JAX, and a
traceback ("Jax plugin configuration error") when it then looks for a CUDA backend. JAX falls
back to the CPU either way. jaxmem's commands start JAX through `quiet_jax_start()`, which:

- on a machine with no NVIDIA device node and no `JAX_PLATFORMS` set, asks JAX for the CPU
  backend only (what JAX would end up with anyway), so no CUDA backend is tried;
- filters those known lines out of what JAX and its plugins write to stderr while they start,
  and passes every other line through.

    quiet_jax_start()        # then import jax as usual
"""

from __future__ import annotations

import os
import sys
import tempfile

# Lines the CUDA plugin and libtpu write on a machine without a GPU or TPU; nothing else is filtered.
NOISE: tuple[str, ...] = (
    "cudart_stub.cc",
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "Failed to find host bounds for accelerator type",
    "Logging before InitGoogle() is written to STDERR",
)
_started = False


def has_nvidia_device() -> bool:
    """Whether this machine has an NVIDIA device node (a GPU the driver exposes).

    >>> isinstance(has_nvidia_device(), bool)
    True
    """
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


# JAX's report that the CUDA plugin found no CUDA runtime (a traceback, when JAX_PLATFORMS does
# not rule CUDA out), from its first line to the traceback's last.
_PLUGIN_ERROR = "Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda"
_TRACEBACK_LINE = ("  ", "Traceback (most recent call last)", "The above exception was the direct cause",
                   "RuntimeError: ")


def filter_noise(text: str) -> str:
    """`text` without the CUDA plugin's known start-up lines, and without JAX's traceback saying
    the plugin found no CUDA runtime; every other line is kept.

    >>> filter_noise("I0000 cudart_stub.cc:31] Could not find cuda drivers\\nreal line\\n")
    'real line\\n'
    """
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        if _PLUGIN_ERROR in line:
            skipping = True
            continue
        if skipping:
            if line.startswith(_TRACEBACK_LINE) or not line.strip():
                if line.startswith("RuntimeError: Unable to load CUDA"):
                    skipping = False
                continue
            skipping = False
        if not any(n in line for n in NOISE):
            kept.append(line)
    return "".join(kept)


def quiet_jax_start(host_devices: int | None = None) -> None:
    """Import JAX and start its backends, with the CUDA plugin's start-up lines filtered from
    stderr. Does nothing after the first call, or when JAX's backends already started.

    `host_devices`: give JAX's CPU backend that many devices (a factory may build a mesh of
    this host's devices), unless the user chose a number (`--xla_force_host_platform_device_count`
    in XLA_FLAGS, `JAX_NUM_CPU_DEVICES`)."""
    global _started
    if _started:
        return
    _started = True
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, AttributeError, ValueError):  # no real stderr (embedded interpreters)
        _start(host_devices)
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            _start(host_devices)
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            rest = filter_noise(sink.read().decode("utf-8", "replace"))
    if rest:
        sys.stderr.write(rest)
        sys.stderr.flush()


def _start(host_devices: int | None = None) -> None:
    import jax

    if not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms and not has_nvidia_device():
        jax.config.update("jax_platforms", "cpu")
    chosen = ("--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
              or os.environ.get("JAX_NUM_CPU_DEVICES") or getattr(jax.config, "jax_num_cpu_devices", -1) != -1)
    if host_devices and not chosen:
        try:
            jax.config.update("jax_num_cpu_devices", int(host_devices))
        except (AttributeError, RuntimeError, ValueError):  # an older JAX, or its backends already started
            pass
    try:
        jax.devices()
    except RuntimeError:  # a backend the user asked for is missing: JAX says so on first use
        pass
