"""What `jaxmem.maxbatch` answers: the value found, every trial and what decided it (one device
or a mesh), as lines, JSON and HTML."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from jaxmem.units import format_size


@dataclass
class Trial:
    """One judged value: whether it fits, XLA's total there, and what decided it."""

    value: int
    fits: bool
    total_bytes: int
    cached: bool
    decided_by: str


@dataclass
class MaxbatchResult:
    """The search's answer: `value` fits and `value + 1` does not (or `value` is the top of the
    range searched: `at_maximum`); every trial; how many compiles it took."""

    arg: str
    value: int
    device: str
    limit_bytes: int
    steps: int
    total_bytes: int
    next_total_bytes: int | None
    at_maximum: bool
    trials: list[Trial]
    compiles: int
    cached_compiles: int
    guess: int | None
    guess_from: str
    guess_seconds: float
    predictions: int
    seconds: float
    xla_name: str = ""
    is_tpu: bool = False
    multiple: int = 1                      # on a mesh: the value moves in steps of this
    devices: int = 1
    mesh: dict[str, int] | None = None     # on a mesh: its axes and their sizes

    def to_dict(self) -> dict[str, Any]:
        """What `jaxmem maxbatch --json` prints."""
        return {
            "arg": self.arg, "value": self.value, "total_bytes": self.total_bytes,
            "next_total_bytes": self.next_total_bytes, "limit_bytes": int(self.limit_bytes),
            "seconds": round(self.seconds, 3), "compiles": self.compiles, "cached_compiles": self.cached_compiles,
            "device": self.device, "steps": self.steps, "at_maximum": self.at_maximum, "planner_guess": self.guess,
            "planner_seconds": round(self.guess_seconds, 3), "guess_from": self.guess_from,
            "predictions": self.predictions, "devices": self.devices, "mesh": self.mesh, "multiple": self.multiple,
            "judged": [asdict(t) for t in sorted(self.trials, key=lambda t: t.value)],
        }

    def lines(self) -> list[str]:
        """The answer and how it was found, as plain lines."""
        where = "chip" if self.is_tpu else "pool"
        on = self.device if self.mesh is None else (
            f"every one of {self.devices} x {self.device} ({' x '.join(f'{k}={v}' for k, v in self.mesh.items())})")
        total = f"{self.xla_name} total" if self.mesh is None else f"{self.xla_name} per-device total"
        following = self.value + self.multiple
        if self.at_maximum:
            head = f"{self.arg} = {self.value} fits {on} (the largest value searched)"
        else:
            head = (f"{self.arg} = {self.value} is the largest that fits {on}: {total} "
                    f"{format_size(self.total_bytes)}; at {following}: {format_size(self.next_total_bytes or 0)}, "
                    f"which the {where} cannot hold over {self.steps} steps")
        cached = f" + {self.cached_compiles} cached" if self.cached_compiles else ""
        if self.mesh is not None:
            how = (f"{where} limit {format_size(self.limit_bytes)} per device; {arg_steps(self)}; "
                   f"{self.compiles} {self.xla_name} per-device compiles{cached}; {self.seconds:.1f} s")
        else:
            source = "the predicted XLA:GPU total" if self.guess_from == "predicted_xla" else "jaxmem's planner"
            how = (f"{where} limit {format_size(self.limit_bytes)}; {self.compiles} {self.xla_name} compiles{cached}, "
                   f"guess {self.guess if self.guess is not None else '—'} from {source} ({self.guess_seconds:.1f} s); "
                   f"{self.seconds:.1f} s")
        return [head, how] + [f"  {self.arg}={t.value}: {'fits' if t.fits else 'does not fit'} — {t.decided_by}"
                              for t in sorted(self.trials, key=lambda t: t.value)]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        from jaxmem.reports.html import render_table

        rows = [[str(t.value), "fits" if t.fits else "does not fit", format_size(t.total_bytes), t.decided_by]
                for t in sorted(self.trials, key=lambda t: t.value)]
        head, how = (html_escape(x) for x in self.lines()[:2])
        return (f"<div class=\"jaxmem-maxbatch\"><p><b>{head}</b></p><p>{how}</p>"
                + render_table("Trials", [self.arg, "verdict", f"{self.xla_name} total", "decided by"], rows)
                + "</div>")


def arg_steps(result: MaxbatchResult) -> str:
    """How the value moves on a mesh, in words."""
    if result.multiple == 1:
        return f"{result.arg} in steps of 1"
    return f"{result.arg} in steps of {result.multiple}, what its sharded dimensions need"


def html_escape(text: str) -> str:
    import html

    from jaxmem.reports.escape import plain

    return html.escape(plain(text))
