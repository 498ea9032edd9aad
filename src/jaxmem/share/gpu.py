"""A GPU's memory total from `nvidia-smi`, the number the reservation fractions are taken of.

    >>> query_capacity(0)   # on an H100 80GB, 81559 MiB in bytes (needs nvidia-smi)  # doctest: +SKIP
    85520809984

`nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i N` prints MiB. Where
nvidia-smi is not on PATH the caller falls back to a capacity it was given.
`JAXMEM_NVIDIA_SMI` names another nvidia-smi, or "none" to skip the query.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from jaxmem.errors import ConfigError
from jaxmem.units import MiB

_TIMEOUT_S = 20.0


def nvidia_smi() -> str | None:
    """Path of nvidia-smi, or None: `JAXMEM_NVIDIA_SMI` when set ("none" disables the query,
    e.g. to simulate a device on a GPU machine), else nvidia-smi on PATH."""
    chosen = os.environ.get("JAXMEM_NVIDIA_SMI")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "none") else chosen
    return shutil.which("nvidia-smi")


def parse_memory_total(text: str, device: int) -> int:
    """Bytes from nvidia-smi's `memory.total` output (MiB, one line per selected GPU).

    >>> parse_memory_total("81559\\n", 0) == 81559 * 1024 * 1024
    True

    Args:
        text: what nvidia-smi printed.
        device: the device asked for, for the error message.

    Returns:
        the memory total in bytes.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise ConfigError(f"nvidia-smi printed {len(lines)} lines for device {device}, expected one MiB figure: {text.strip()[:200]!r}")
    value = lines[0].removesuffix("MiB").strip()
    try:
        mib = int(value)
    except ValueError:
        raise ConfigError(f"cannot read nvidia-smi memory.total for device {device}: {lines[0][:200]!r}") from None
    if mib <= 0:
        raise ConfigError(f"nvidia-smi reports memory.total {mib} MiB for device {device}")
    return mib * MiB


def query_capacity(device: int) -> int | None:
    """Memory total of GPU `device` in bytes from nvidia-smi; None when nvidia-smi is not on PATH.

    Args:
        device: the GPU index as nvidia-smi numbers them (PCI bus order).

    Returns:
        bytes, or None without nvidia-smi. A failing nvidia-smi raises ConfigError.
    """
    exe = nvidia_smi()
    if exe is None:
        return None
    cmd = [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", str(device)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"nvidia-smi failed for device {device}: {err}") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"nvidia-smi failed for device {device} (exit {done.returncode}): {detail[0] if detail else 'no output'}")
    return parse_memory_total(done.stdout, device)


def list_capacities() -> dict[int, int]:
    """Every GPU nvidia-smi lists, as {index: memory total in bytes}; {} without nvidia-smi.

    Used by `jaxmem share status` to show devices nobody has reserved yet; a failing
    nvidia-smi gives {} here (status still shows the ledgers).
    """
    exe = nvidia_smi()
    if exe is None:
        return {}
    cmd = [exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if done.returncode != 0:
        return {}
    found = {}
    for line in done.stdout.splitlines():
        index, _, total = line.partition(",")
        try:
            found[int(index)] = int(total.strip().removesuffix("MiB").strip()) * MiB
        except ValueError:
            continue
    return found
