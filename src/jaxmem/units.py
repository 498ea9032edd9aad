"""Byte sizes: parse "16GiB" / "80GB" / accelerator presets, and print them for people."""

from __future__ import annotations

import re

from jaxmem.accelerators import capacities
from jaxmem.errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": TiB,
}

# Device presets -> their memory as the runtime reports it, in bytes (`jaxmem.accelerators`,
# where every fact about a preset lives).
PRESETS: dict[str, int] = capacities()

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Bytes from an int, "512MiB", "80GB", "1.5GiB" or a preset name such as "h100-80gb".

    >>> parse_size("2KiB"), parse_size("a100-40gb") == 40960 * MiB
    (2048, True)
    """
    if isinstance(value, bool):
        raise ConfigError(f"size must be bytes or a string like '16GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"size must be positive, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"size must be bytes or a string like '16GiB', got {value!r}")
    key = value.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    match = _SIZE_RE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        names = ", ".join(sorted(PRESETS))
        raise ConfigError(f"cannot read size {value!r}: use bytes, '16GiB', '80GB' or a preset ({names})")
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number < 1:
        raise ConfigError(f"size must be at least one byte, got {value!r}")
    return int(number)


def format_size(nbytes: int | float) -> str:
    """"1.50 GiB" style, binary units, for reports."""
    sign = "-" if nbytes < 0 else ""
    n = abs(float(nbytes))
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
