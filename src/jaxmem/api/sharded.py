"""`jaxmem.analyze` of a function whose arguments carry `NamedSharding`s over several devices.

The per-device analysis (`xla/sharding.py`) compiles in a child that loads a TARGET by name:
from Python, a sharded program is not yet handed to it, and says so in one line.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxmem.errors import PlanError


def analyze_sharded(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, donate: Any, options: Any,
                    busy: Callable[[str], Any]) -> Any:
    """Refused in one line, pointing at `jaxmem analyze TARGET`, which analyses it per device."""
    raise PlanError("the arguments carry NamedShardings over several devices: the per-device analysis runs "
                    "from the command line for now (jaxmem analyze module:factory --device ...)")
