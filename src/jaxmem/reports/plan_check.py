"""Whether jaxmem's own plan is shown beside XLA's figure for the device.

jaxmem plans the program's jaxpr; XLA compiles a different program for the device (fused, laid
out, and on a mesh partitioned, with loop bodies at their per-device shapes). Where jaxmem's plan
is more than `SHOWN_WITHIN` times XLA's total for the device, it describes buffers that program
never holds (whole stacked weights a loop body only slices, values XLA fuses away), so neither
its peak nor its table of buffers is shown: XLA's figures, its peak buffers and the pool's
verdict stand alone, and one line says why. A plan below XLA's is jaxmem's own schedule (XLA
will not run it unless told to) and is shown as such.
"""

from __future__ import annotations

from typing import Any

from jaxmem.units import format_size

SHOWN_WITHIN = 1.25


def withheld_because(plan_peak: int | None, xla: dict[str, Any] | None, who: str,
                     per_device: bool = False) -> str | None:
    """The one line that says why jaxmem's plan (`plan_peak` bytes) is not shown beside `who`'s
    figures `xla` (a dict with `total_bytes`; `oom` where XLA refused the program), or None
    where it is shown; `per_device` for a program partitioned over a mesh.

    >>> withheld_because(208 << 20, {"total_bytes": 136 << 20}, "XLA:TPU")[:62]
    "jaxmem's own plan is not shown: 1.53x XLA:TPU's total (208.00 "
    >>> withheld_because(130 << 20, {"total_bytes": 136 << 20}, "XLA:TPU") is None
    True
    """
    if plan_peak is None or not xla or xla.get("oom") or not xla.get("total_bytes"):
        return None
    ratio = plan_peak / xla["total_bytes"]
    if ratio <= SHOWN_WITHIN:
        return None
    total = "per-device total" if per_device else "total"
    return (f"jaxmem's own plan is not shown: {ratio:.2f}x {who}'s {total} ({format_size(plan_peak)} against "
            f"{format_size(xla['total_bytes'])}) on this program, so it would list buffers the compiled "
            f"program never holds; the figures and peak buffers are {who}'s")


def withhold(data: dict[str, Any], xla: dict[str, Any] | None, who: str, plan_keys: tuple[str, ...]) -> dict[str, Any]:
    """`data` with jaxmem's plan moved out of sight where `withheld_because` says so: its figures
    under `plan_withheld` (`peak_bytes`, `ratio_to_xla`, `why`), the keys `plan_keys` None (or
    empty), and the line in `plan_note`."""
    why = withheld_because(data.get("peak_bytes"), xla, who)
    if why is None:
        return data
    out = dict(data)
    out["plan_withheld"] = {"peak_bytes": data["peak_bytes"], "ratio_to_xla": data["peak_bytes"] / xla["total_bytes"],
                            "why": why}
    for key in plan_keys:
        out[key] = [] if isinstance(data.get(key), list) else None
    out["plan_note"] = why
    return out
