"""Pool settings read from the environment variables JAX reads, with JAX's meanings.

    XLA_PYTHON_CLIENT_PREALLOCATE   only "false", "False" or "0" turn preallocation off
    XLA_CLIENT_MEM_FRACTION         fraction of device memory the pool may take (default 0.75)
    XLA_PYTHON_CLIENT_MEM_FRACTION  its deprecated name; setting both is an error
    TF_FORCE_UNIFIED_MEMORY         "1"/"true" allows a fraction above 1 (host memory spill)
    XLA_PYTHON_CLIENT_ALLOCATOR     "default" or "bfc" (the BFC pool), or "platform"

    config = config_from_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    config.preallocate   # False
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping

from jaxmem.errors import ConfigError

DEFAULT_MEM_FRACTION = 0.75

# XLA_PYTHON_CLIENT_ALLOCATOR value -> jaxmem allocator name.
ALLOCATORS = {"default": "bfc", "bfc": "bfc", "platform": "platform"}
# Values JAX accepts that jaxmem does not model: refused by name rather than run as something else.
UNMODELLED_ALLOCATORS = {"cuda_async": "CUDA's stream-ordered cudaMallocAsync pool"}


@dataclass(frozen=True)
class PoolConfig:
    """How a device's pool is set up: allocator name, preallocation, and the fraction cap."""

    allocator: str = "bfc"
    preallocate: bool = True
    mem_fraction: float = DEFAULT_MEM_FRACTION
    unified_memory: bool = False


def check_mem_fraction(fraction: object, *, unified_memory: bool = False, source: str = "mem_fraction") -> float:
    """`fraction` as a float in (0, 1], or above 1 when unified memory is on; else ConfigError.

    >>> check_mem_fraction("0.5")
    0.5
    """
    try:
        value = float(fraction)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{source} must be a number, got {fraction!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source} must be above 0, got {fraction!r}")
    if value > 1 and not unified_memory:
        raise ConfigError(f"{source}={fraction} is above 1, which needs TF_FORCE_UNIFIED_MEMORY=1")
    return value


def _flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in ("", "0", "false"):
        return False
    if value in ("1", "true"):
        return True
    raise ConfigError(f"{name} must be 1/true or 0/false, got {environ[name]!r}")


def config_from_env(environ: Mapping[str, str] | None = None) -> PoolConfig:
    """The pool settings JAX would take from `environ` (default: `os.environ`).

    >>> config_from_env({"XLA_CLIENT_MEM_FRACTION": ".5", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    PoolConfig(allocator='platform', preallocate=True, mem_fraction=0.5, unified_memory=False)

    Args:
        environ: a mapping of environment variables.

    Returns:
        A `PoolConfig`. Raises `ConfigError` on any value JAX would refuse or jaxmem cannot model.
    """
    environ = os.environ if environ is None else environ
    # JAX lower-cases the allocator name but not the preallocate flag ("FALSE" keeps it on).
    name = environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
    if name in UNMODELLED_ALLOCATORS:
        raise ConfigError(
            f"XLA_PYTHON_CLIENT_ALLOCATOR={name} ({UNMODELLED_ALLOCATORS[name]}) is not modelled "
            f"by jaxmem; use default, bfc or platform")
    if name not in ALLOCATORS:
        raise ConfigError(
            f'XLA_PYTHON_CLIENT_ALLOCATOR must be "default", "platform", "bfc" or "cuda_async", got "{name}"')
    preallocate_value = environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "")
    preallocate = preallocate_value not in ("false", "False", "0")
    fraction_value = environ.get("XLA_CLIENT_MEM_FRACTION", "")
    deprecated = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    source = "XLA_CLIENT_MEM_FRACTION"
    if deprecated:
        if fraction_value:
            raise ConfigError(
                "XLA_CLIENT_MEM_FRACTION is set together with XLA_PYTHON_CLIENT_MEM_FRACTION; "
                "remove the latter, it is deprecated")
        fraction_value, source = deprecated, "XLA_PYTHON_CLIENT_MEM_FRACTION"
    unified = _flag(environ, "TF_FORCE_UNIFIED_MEMORY")
    fraction = DEFAULT_MEM_FRACTION
    if fraction_value:
        fraction = check_mem_fraction(fraction_value, unified_memory=unified, source=source)
    return PoolConfig(ALLOCATORS[name], preallocate, fraction, unified)
