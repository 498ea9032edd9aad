"""Which device a question is judged for when the caller names none: the one the arguments
live on.

The chip or GPU the arguments' arrays are on; else JAX's default device, where it is a GPU or a
TPU; only with no accelerator in sight a preset (an H100 80GB). The choice says why, and the
result shows it.

    choice = choose_device(devices_of((args, kwargs)))
    choice.device, choice.reason     # ('tpu-v5e-16gb', 'the arguments are on TPU_0 (TPU v5 lite)')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxmem.accelerators import ACCELERATORS, for_device
from jaxmem.units import format_size

FALLBACK_PRESET = "h100-80gb"


@dataclass(frozen=True)
class DeviceChoice:
    """The device a question is judged for (a preset, or a size where jaxmem has no preset
    for the device), and why, in words."""

    device: str
    reason: str


def _platform(device: Any) -> str:
    platform = str(getattr(device, "platform", "")).lower()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _memory(device: Any) -> int | None:
    """The device's memory as its runtime states it (`memory_stats()["bytes_limit"]`)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend with no statistics
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if isinstance(limit, (int, float)) and limit > 0 else None


def _default_device() -> Any:
    """JAX's default device, or None where JAX cannot name one."""
    import jax

    try:
        return jax.devices()[0]
    except Exception:  # no backend could start: no accelerator in sight
        return None


def judged_on(device: Any, lead: str) -> DeviceChoice:
    """The preset for `device` (a JAX device), `lead` and the device named as the reason; its
    memory as a size where jaxmem has no preset for it."""
    kind = str(getattr(device, "device_kind", "")) or _platform(device)
    memory = _memory(device)
    preset = for_device(_platform(device), kind, memory)
    if preset is not None:
        return DeviceChoice(preset.name, f"{lead} {device} ({kind})")
    if memory is None:
        return DeviceChoice(FALLBACK_PRESET, f"{lead} {device} ({kind}), which jaxmem has no preset for and whose "
                                             f"memory JAX does not state: judged for {FALLBACK_PRESET}; device= names another")
    return DeviceChoice(str(memory), f"{lead} {device} ({kind}), which jaxmem has no preset for: judged on its "
                                     f"{format_size(memory)} with XLA:CPU's figures; device= names a preset")


def choose_device(devices: Sequence[Any], default: Callable[[], Any] = _default_device) -> DeviceChoice:
    """The device to judge for, given the devices the arguments live on.

    >>> class Chip:
    ...     platform, device_kind, id = "tpu", "TPU v5 lite", 0
    ...     def memory_stats(self): return {"bytes_limit": 16909336064}
    ...     def __str__(self): return "TPU_0(process=0,(0,0,0,0))"
    >>> choose_device([Chip()]).device
    'tpu-v5e-16gb'
    """
    on = [d for d in devices if _platform(d) in ("gpu", "tpu")]
    if on:
        return judged_on(on[0], "the arguments are on")
    device = default()
    if device is not None and _platform(device) in ("gpu", "tpu"):
        return judged_on(device, "JAX's default device is")
    preset = ACCELERATORS[FALLBACK_PRESET]
    where = f"JAX's default device is {device}" if device is not None else "JAX names no device"
    return DeviceChoice(preset.name, f"no GPU or TPU in sight ({where}); device= names another")
