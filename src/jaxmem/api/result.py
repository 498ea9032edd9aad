"""What `jaxmem.analyze` returns: one analysis, read as attributes, a dict, terminal text or HTML.

    result = jaxmem.analyze(step, state, batch, device="tpu-v5e-16gb")
    result.fits, result.xla["total_bytes"], result.peak_buffers[0]["source"]
    print(result)          # the tables `jaxmem analyze` prints
    result                 # in Jupyter: the same as HTML
"""

from __future__ import annotations

import io
from typing import Any

from jaxmem.reports.analysis import AnalysisReport

# Keys of `to_dict()` that differ from run to run: timings, and whether XLA's figures came
# from the cache.
TIMING_KEYS = ("plan_seconds", "trace_seconds", "total_seconds", "compile_seconds", "seconds", "cached")


class Analysis:
    """One analysis of a program on a device.

    **Attributes:** `fits` (whether it fits the device over the steps: the pool's verdict, else
    jaxmem's plan against the usable memory; None where nothing judged it), `xla` (the device's
    XLA figures: XLA:GPU's or XLA:TPU's, else XLA:CPU's here; a dict), `pool` (the verdict over
    N steps, a dict, or None), `peak_buffers` (the largest buffers live at the peak, each with
    the user's source line: jaxmem's plan's, or XLA's where there is no plan), `plan` (jaxmem's
    `Plan`; None for a `jax.stages.Lowered`), `note` (what the result leaves out, or None),
    `device` (the device judged for) and `device_reason` (why, where none was named),
    `framework` (for a framework's step: whose program it is, how it was read, what the
    framework adds over the step written pure and the changes that remove it; else None).
    """

    def __init__(self, report: AnalysisReport) -> None:
        self.report = report

    @property
    def data(self) -> dict[str, Any]:
        return self.report.data

    @property
    def fits(self) -> bool | None:
        return self.data["fits"]

    @property
    def plan(self) -> Any:
        return self.report.plan

    @property
    def xla(self) -> dict[str, Any] | None:
        return self.data.get("xla_gpu") or self.data.get("xla_tpu") or self.data.get("xla")

    @property
    def pool(self) -> dict[str, Any] | None:
        return self.data.get("pool")

    @property
    def peak_buffers(self) -> list[dict[str, Any]]:
        if self.data["top_buffers"]:
            return self.data["top_buffers"]
        return self.data.get("xla_gpu_peak_buffers") or self.data.get("xla_tpu_peak_buffers") or []

    @property
    def device(self) -> str:
        return self.data["device"]["name"]

    @property
    def device_reason(self) -> str | None:
        return self.data["device"].get("chosen_because")

    @property
    def framework(self) -> dict[str, Any] | None:
        return self.data.get("framework")

    @property
    def note(self) -> str | None:
        notes = [n for n in (self.data.get("plan_note"), self.data.get("xla_note")) if n]
        return "; ".join(notes) or None

    def to_dict(self) -> dict[str, Any]:
        """The analysis as plain JSON values: what `jaxmem analyze TARGET --json` prints."""
        import json

        return json.loads(self.report.json())

    def text(self, width: int = 160) -> str:
        """The tables `jaxmem analyze` prints, as plain text `width` columns wide."""
        from rich.console import Console

        from jaxmem.reports.analysis_tables import render_report

        out = io.StringIO()
        render_report(self.report, Console(file=out, width=width, force_terminal=False, color_system=None))
        return out.getvalue()

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        xla = self.xla or {}
        return (f"<jaxmem.Analysis {self.data['target']} on {self.data['device']['name']}: fits={self.fits}, "
                f"XLA total {xla.get('total_bytes')} B>")

    def html(self) -> str:
        """The analysis as an HTML fragment (self-contained: nothing is fetched)."""
        from jaxmem.reports.analysis_html import render_analysis

        return render_analysis(self.data)

    def _repr_html_(self) -> str:
        return self.html()


def without_timings(data: Any) -> Any:
    """`data` (a `to_dict()`) with every timing key left out, at any depth: what two runs of
    one analysis share."""
    if isinstance(data, dict):
        return {k: without_timings(v) for k, v in data.items() if k not in TIMING_KEYS}
    if isinstance(data, list):
        return [without_timings(v) for v in data]
    return data
