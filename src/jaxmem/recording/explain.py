"""What an out-of-memory text means and what to change: `explain(text) -> Explanation`.

    >>> e = explain("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
    ...             "for HLO temporaries (16.54G) exceeds available HBM (15.75G).")
    >>> e.verdict, e.preset
    ('compile', 'tpu-v5e-16gb')

The verdict is one of:

- `exhaustion`: the memory free was less than what was asked for; arrays held (and programs
  loaded) fill the rest.
- `fragmentation`: the memory free would have held it, but not in one piece.
- `reservation`: a TPU program's temporaries are reserved as one range at the bottom of memory
  when it loads; the chip had the memory free, but not there (arrays sit in the way).
- `compile`: the program alone needs more than the device has: XLA refused it before it ran, so
  nothing held at run time is to blame.
- `unknown`: the text gives too few figures to tell.

An `Explanation` renders as terminal text (`str`), a dict (`to_dict`, for `--json`) and a
self-contained HTML page (`html`); every piece of text from the log is escaped in each.
"""

from __future__ import annotations

import html as _html
from dataclasses import dataclass, field

from jaxmem.recording.oom_text import OomText, Size, parse_all, pick
from jaxmem.reports.escape import plain
from jaxmem.errors import OomTextError
from jaxmem.units import PRESETS

VERDICTS = ("exhaustion", "fragmentation", "reservation", "compile", "unknown")

_WHAT = {
    "tpu_buffer": "The TPU runtime could not allocate a buffer (E0100).",
    "tpu_program_load": "The TPU runtime could not load a program: its temporaries could not be reserved (E0101).",
    "tpu_compile_hbm": "XLA:TPU refused to compile the program: it needs more memory than the chip has.",
    "gpu_xla_oom": "XLA:GPU could not allocate a program's memory when it ran.",
    "gpu_bfc": "The GPU's BFC allocator could not allocate a buffer.",
    "cpu_alloc": "JAX's CPU backend could not allocate a buffer in the host's memory.",
}
_FIGURES = (("requested", "asked for"), ("free", "free"), ("reserved", "reserved"),
            ("reservable", "reservable"), ("largest_free_block", "largest free block"),
            ("limit", "device limit"), ("in_use", "in use"))


@dataclass(frozen=True)
class Step:
    """One thing to try: why, and the command or code that does it."""

    why: str
    command: str


@dataclass(frozen=True)
class Explanation:
    """An out-of-memory error explained: what happened, its figures, what it means, what next."""

    kind: str
    what: str
    figures: tuple[tuple[str, str], ...]
    verdict: str
    meaning: str
    blame: tuple[dict, ...]
    steps: tuple[Step, ...]
    preset: str | None
    others: tuple[str, ...]
    oom: OomText = field(repr=False)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "what": self.what, "figures": [list(f) for f in self.figures],
                "verdict": self.verdict, "meaning": self.meaning, "blame": list(self.blame),
                "next": [{"why": s.why, "command": s.command} for s in self.steps],
                "preset": self.preset, "other_errors": list(self.others), "parsed": self.oom.to_dict()}

    def __str__(self) -> str:
        return render_text(self)

    def html(self) -> str:
        return render_html(self)


# ---------------------------------------------------------------- verdicts

def _gt(a: Size | None, b: Size | None) -> bool | None:
    """a > b, or None when either is missing. Rounded figures compare as printed."""
    if a is None or b is None:
        return None
    return a.bytes > b.bytes


def _free_of(oom: OomText) -> Size | None:
    """What was free: the text's own figure, else the limit less what was in use (BFC)."""
    if oom.free is not None:
        return oom.free
    if oom.limit is not None and oom.in_use is not None:
        return Size(oom.limit.bytes - oom.in_use.bytes, f"{oom.limit.bytes - oom.in_use.bytes}", True)
    return None


def _runtime_verdict(oom: OomText) -> tuple[str, str]:
    """Exhaustion or fragmentation of a run-time allocation (E0100, XLA:GPU, BFC)."""
    free, req = _free_of(oom), oom.requested
    short = _gt(req, free)
    if short:
        return "exhaustion", (f"Only {free.describe()} was free and {req.describe()} was asked for: arrays still "
                              f"held, and programs loaded, fill the rest of the device.")
    if short is False:
        largest = oom.largest_free_block
        piece = f"; the largest free block was {largest.describe()}" if largest is not None else ""
        return "fragmentation", (f"{free.describe()} was free, enough for the {req.describe()} asked for, but not "
                                 f"in one piece{piece}: the free memory lies in gaps between arrays held.")
    if oom.kind == "gpu_xla_oom":
        return "unknown", ("XLA:GPU's pool could not give the program this allocation at run time. The text "
                           "does not say what was free; the BFC allocator's lines beside it would tell "
                           "exhaustion from fragmentation.")
    if free is not None:
        return "unknown", (f"{free.describe()} was free (the limit less what was in use), but the text does not "
                           f"say how much was asked for, so it cannot tell exhaustion from fragmentation.")
    return "unknown", "The text gives too few figures to tell exhaustion from fragmentation."


def _program_verdict(oom: OomText) -> tuple[str, str]:
    """E0101: the reservation at the bottom of memory."""
    req, free, reservable = oom.requested, oom.free, oom.reservable
    if _gt(req, free):
        return "exhaustion", (f"The program's temporaries need {req.describe()} but only {free.describe()} was "
                              f"free: the arrays held fill the chip.")
    if _gt(req, reservable):
        return "reservation", (f"{free.describe()} was free, but the program's {req.describe()} of temporaries "
                               f"must be one range at the bottom of memory and only {reservable.describe()} "
                               f"could be reserved there: arrays held sit where the reservation must go.")
    return "reservation", (f"The program's temporaries ({req.describe() if req else 'their size not given'}) "
                           f"could not be reserved at the bottom of memory when it loaded: arrays held (or "
                           f"another program's reservation) sit where they must go.")


def _compile_verdict(oom: OomText) -> tuple[str, str]:
    req, limit = oom.requested, oom.limit
    need = req.describe() if req else "more"
    has = limit.describe() if limit else "the chip's memory"
    temps = oom.breakdown.get("program.HLO temp")
    extra = f" Of it, XLA's temporaries are {temps.describe()}." if temps else ""
    return "compile", (f"The program needs {need}; XLA can use {has}. It was refused before it ran, so the "
                       f"arrays you hold are not to blame: the program's own temporaries, arguments and "
                       f"outputs are.{extra} Recompute values in the backward pass, use a smaller batch, or "
                       f"shard the program over more chips.")


def verdict(oom: OomText) -> tuple[str, str]:
    """(one of `VERDICTS`, a sentence or two saying what it means)."""
    if oom.kind == "tpu_compile_hbm":
        return _compile_verdict(oom)
    if oom.kind == "tpu_program_load":
        return _program_verdict(oom)
    return _runtime_verdict(oom)


# ---------------------------------------------------------------- what to do next

def guess_preset(oom: OomText) -> str | None:
    """The preset whose capacity the text's limit matches within 1% (15.75G: tpu-v5e-16gb)."""
    if oom.limit is None:
        return None
    for name, capacity in PRESETS.items():
        if abs(capacity - oom.limit.bytes) <= capacity // 100:
            return name
    return None


def next_steps(oom: OomText, kind_of_verdict: str, preset: str | None) -> tuple[Step, ...]:
    """The commands to run next, most useful first; `--device PRESET` where the text's limit
    matches no preset (a preset name: `jaxmem analyze --help` lists them)."""
    device = preset or "PRESET"   # the text names no device jaxmem knows: the user's own
    record = Step("see which arrays hold the memory when it fails, and which line made each",
                  "jaxmem record -- python train.py")
    donate = Step("let the step write its results into its inputs' memory (parameters, optimizer state)",
                  "step = jax.jit(train_step, donate_argnums=(0, 1))")
    drop = Step("drop arrays you no longer need before the step (old parameters, cached batches, results "
                "kept in a list)", "del old_state  # or x.delete(); keep no reference in lists or closures")
    fit = Step("make the step fit by recomputing values in the backward pass",
               f"jaxmem fit TARGET --budget 90% --device {device}")
    maxbatch = Step("find the largest batch that fits", f"jaxmem maxbatch TARGET --arg batch --device {device}")
    analyze = Step("see the program's temporaries, arguments and outputs before it runs",
                   f"jaxmem analyze TARGET --device {device}")
    if kind_of_verdict == "compile":
        return fit, maxbatch, analyze, donate
    if kind_of_verdict == "reservation":
        return drop, donate, fit, record
    if kind_of_verdict == "fragmentation":
        return record, donate, drop, maxbatch
    return record, drop, donate, maxbatch, fit


def _blame(oom: OomText, limit: int = 5) -> tuple[dict, ...]:
    """The largest allocations the text lists, as rows: size, shape, where (file:line or op)."""
    rows = sorted(oom.allocations, key=lambda a: -(a.size.bytes if a.size else 0))[:limit]
    out = []
    for a in rows:
        padded = ""
        if a.size and a.unpadded and a.unpadded.bytes and a.size.bytes >= 2 * a.unpadded.bytes:
            padded = f"{a.size.bytes / a.unpadded.bytes:.1f}x its unpadded size (layout padding)"
        out.append({"size": a.size.text if a.size else "?", "shape": a.shape or "", "where": a.source or "",
                    "op": a.op_name or a.label or a.allocation_type or "", "note": padded})
    return tuple(out)


def _figures(oom: OomText) -> tuple[tuple[str, str], ...]:
    rows = [(label, getattr(oom, name).describe()) for name, label in _FIGURES if getattr(oom, name) is not None]
    for name, size in list(oom.breakdown.items())[:12]:
        rows.append((name, size.describe()))
    for name in ("program", "device", "op"):
        if getattr(oom, name):
            rows.append((name, getattr(oom, name)))
    if oom.bins:
        free_chunks = sum(b.total_chunks - b.chunks_in_use for b in oom.bins)
        rows.append(("bins", f"{len(oom.bins)} listed, {free_chunks} free chunks among them"))
    return tuple(rows)


def explain_oom(oom: OomText, others: tuple[str, ...] = ()) -> Explanation:
    """An `Explanation` of one parsed error; `others`: the kinds of the other errors in the log."""
    kind_of_verdict, meaning = verdict(oom)
    preset = guess_preset(oom)
    return Explanation(kind=oom.kind, what=_WHAT[oom.kind], figures=_figures(oom), verdict=kind_of_verdict,
                       meaning=meaning, blame=_blame(oom), steps=next_steps(oom, kind_of_verdict, preset),
                       preset=preset, others=others, oom=oom)


def explain_found(found: list[OomText]) -> Explanation:
    """The most specific of the errors found, explained; `OomTextError` when there are none."""
    oom = pick(found)
    if oom is None:
        raise OomTextError("no out-of-memory error found in the text (known: the TPU runtime's E0100 and "
                           "E0101, XLA:TPU's and XLA:GPU's out-of-memory reports, the BFC allocator's log)")
    others = tuple(o.kind for o in found if o is not oom)
    return explain_oom(oom, others)


def explain(text: str) -> Explanation:
    """Explain the most specific out-of-memory error in a text; `OomTextError` when it holds none."""
    return explain_found(parse_all(text))


# ---------------------------------------------------------------- rendering

def render_text(e: Explanation) -> str:
    """Terminal text; everything from the log shown with control characters escaped."""
    lines = [e.what, "", f"  error line: {plain(e.oom.line[:300])}"]
    lines += [f"  {label:<32} {plain(value)}" for label, value in e.figures]
    lines += ["", f"What it means ({e.verdict}): {e.meaning}"]
    if e.blame:
        lines += ["", "Largest allocations the text lists:"]
        for row in e.blame:
            where = row["where"] or row["op"]
            note = f"  [{row['note']}]" if row["note"] else ""
            lines.append(f"  {plain(row['size']):>10}  {plain(row['shape'][:60]):<40} {plain(where[:160])}{note}")
    lines += ["", "Next:" + ("" if e.preset else " (PRESET: your device's preset, e.g. tpu-v5e-16gb or h100-80gb)")]
    lines += [f"  - {s.why}:\n      {plain(s.command)}" for s in e.steps]
    if e.others:
        lines += ["", f"The text holds {len(e.others)} more out-of-memory report(s): {', '.join(e.others)}."]
    return "\n".join(lines)


def _h(text: object) -> str:
    """Text from a log made safe in HTML: control characters shown, markup escaped."""
    return _html.escape(plain(text), quote=True)


_CSS = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:.2em .8em;text-align:left}"
        "code,pre{background:#f4f4f4}th{background:#eee}")


def _table(head: list[str], rows: list[list[str]]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{_h(c)}</td>" for c in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{_h(c)}</th>" for c in head) + f"</tr>{cells}</table>"


def render_html(e: Explanation) -> str:
    """A self-contained page (no script, nothing fetched); every text from the log is escaped."""
    parts = [f"<!doctype html><html><head><meta charset=\"utf-8\"><title>jaxmem explain</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{_h(e.what)}</h1>",
             f"<pre>{_h(e.oom.line[:2000])}</pre>", _table(["figure", "value"], [list(f) for f in e.figures]),
             f"<h2>What it means: {_h(e.verdict)}</h2><p>{_h(e.meaning)}</p>"]
    if e.blame:
        parts.append("<h2>Largest allocations</h2>" + _table(
            ["size", "shape", "where", "op", "note"],
            [[r["size"], r["shape"], r["where"], r["op"], r["note"]] for r in e.blame]))
    steps = "".join(f"<li>{_h(s.why)}<br><code>{_h(s.command)}</code></li>" for s in e.steps)
    note = "" if e.preset else "<p>PRESET: your device's preset, e.g. tpu-v5e-16gb or h100-80gb.</p>"
    parts.append(f"<h2>Next</h2>{note}<ol>{steps}</ol>")
    if e.others:
        parts.append(f"<p>The text holds {len(e.others)} more out-of-memory report(s): {_h(', '.join(e.others))}.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
