"""`jaxmem fit`'s text for a step on a mesh: every change compiled, per device, then the answer and
its code."""

from __future__ import annotations

from typing import Any

from jaxmem.units import format_size


def _moved(c: Any) -> str:
    return "?" if c.collective_bytes is None else format_size(c.collective_bytes)


def _added(c: Any, before: Any) -> str:
    if c.collective_bytes is None or before.collective_bytes is None:
        return ""
    delta = c.collective_bytes - before.collective_bytes
    return f" ({'+' if delta >= 0 else '-'}{format_size(abs(delta))})"


def _row(c: Any, before: Any, width: int) -> str:
    verdict = "fits" if c.fits else ("refused by XLA" if c.refused else "over")
    flops = f"+{100 * c.extra_flops_ratio:.1f}%"
    return (f"  {c.label:<{width}} {format_size(c.total_bytes):>11} {verdict:<14} {flops:>7}  "
            f"{_moved(c)}{_added(c, before)}")


def render(result: Any) -> str:
    """The table of a `fitting.mesh.MeshFitResult` and its answer."""
    mesh = " x ".join(f"{k}={v}" for k, v in result.mesh.items())
    width = max([len("change"), *(len(c.label) for c in [result.before, *result.candidates])])  # whole: each is pasted by name
    lines = [f"fit on {result.devices} x {result.device} (mesh {mesh}): budget {format_size(result.budget_bytes)} "
             f"per device, judged by {result.judge}",
             f"  {'change':<{width}} {'per device':>11} {'':<14} {'FLOPs':>7}  collectives per step per device",
             _row(result.before, result.before, width)]
    lines += [_row(c, result.before, width) for c in result.candidates]
    lines.append("")
    if result.before.fits:
        lines.append(f"fits as written: {format_size(result.before.total_bytes)} per device within "
                     f"{format_size(result.budget_bytes)}")
    elif result.best is None:
        closest = result.closest
        lines.append(f"no change compiled fits: the closest is {closest.label} at "
                     f"{format_size(closest.total_bytes)} per device (budget {format_size(result.budget_bytes)})")
    else:
        best = result.best
        lines.append(f"answer: {best.label}: {format_size(result.before.total_bytes)} -> "
                     f"{format_size(best.total_bytes)} per device, +{100 * best.extra_flops_ratio:.1f}% FLOPs, "
                     f"collectives {_moved(best)} per step per device{_added(best, result.before)}")
        lines += ["", best.code]
        if result.fewer_collectives is not None:
            other = result.fewer_collectives
            lines += ["", f"also fits with fewer collective bytes, at more FLOPs: {other.label} "
                          f"({format_size(other.total_bytes)}, +{100 * other.extra_flops_ratio:.1f}% FLOPs, "
                          f"{_moved(other)}); which is faster depends on the machine's FLOPs and links"]
    for why in result.left_out:
        lines.append(f"not tried: {why}")
    lines.append(f"{result.compiles} per-device compiles, {result.cached} from the cache, {result.seconds:.0f} s")
    return "\n".join(lines)


__all__ = ["render"]
