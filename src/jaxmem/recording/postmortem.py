"""What was on the device when a program ran out of memory, written before the process ends.

    take_postmortem(recorder, message)   # called as JAX makes the RESOURCE_EXHAUSTED error

A post-mortem (`postmortem-N.json`, with the device memory profile of that moment) holds:
- the kind of failure, and what was asked against what was free (from the error's text, parsed
  by `oom_text`), with the largest free block (`memory_stats()`): fragmentation when the free
  total would have held the request, exhaustion when it would not;
- the live arrays at that moment by the innermost line of the user's code that made them, and
  what `bytes_in_use` holds besides them (the executables' code, the runtime's own buffers);
- the loaded executables and their code bytes, and the failing program's XLA figures;
- what to change, as commands.
"""

from __future__ import annotations

from typing import Any

from jaxmem.recording import jax_hooks
from jaxmem.recording.explain import explain_oom
from jaxmem.recording.oom_text import parse_oom
from jaxmem.units import format_size

_MiB = 1 << 20


def preset_for(device_kind: str, bytes_limit: int | None) -> str | None:
    """The jaxmem preset of a device, by what JAX calls it and what its runtime gives.

    >>> preset_for("TPU v5 lite", 16_909_336_064)
    'tpu-v5e-16gb'
    """
    from jaxmem.accelerators import ACCELERATORS

    kind = device_kind.lower()
    if "v5 lite" in kind or "v5e" in kind:
        return "tpu-v5e-16gb"
    for acc in ACCELERATORS.values():
        if bytes_limit and acc.capacity_bytes == bytes_limit:
            return acc.name
    return None


def _executables(recorder: Any) -> list[dict[str, Any]]:
    out = []
    for client in list(recorder.clients):
        for exe in jax_hooks.live_executables(client):
            figures = jax_hooks.executable_figures(exe)
            if figures:
                out.append(figures)
    out.sort(key=lambda f: -f["generated_code_size_in_bytes"])
    return out


def verdict(requested: int | None, free: int | None, largest_free: int | None) -> str:
    """"fragmentation" when the free total would have held the request but no one free block
    does; "exhaustion" when the free total is short; "unknown" without the figures.

    >>> verdict(100, 300, 50), verdict(100, 80, 80), verdict(None, 10, 10)
    ('fragmentation', 'exhaustion', 'unknown')
    """
    if requested is None or free is None:
        return "unknown"
    if free >= requested and largest_free is not None and largest_free < requested:
        return "fragmentation"
    return "exhaustion" if free < requested else "unknown"


def _held(record: dict[str, Any] | None, stats: dict[str, int] | None) -> dict[str, Any]:
    """The live arrays by line, and what bytes_in_use holds besides them."""
    if not record:
        return {"by_line": [], "array_bytes": None, "left_over_bytes": None}
    lines = [{"line": line, "bytes": b, "arrays": c} for line, (b, c) in record["by_line"].items()]
    arrays = record["buffer_bytes"]
    in_use = (stats or {}).get("bytes_in_use")
    left = None if in_use is None else in_use - arrays
    return {"by_line": lines, "array_bytes": arrays, "arrays": record["buffers"],
            "executable_bytes_in_profile": record["executable_bytes"], "executables_in_profile": record["executables"],
            "bytes_in_use": in_use, "left_over_bytes": left}


def left_over_note(left: int | None, executables: list[dict[str, Any]] | None = None) -> str:
    """What `bytes_in_use` holds besides the live arrays, said in words: the TPU runtime's own
    buffer, and the code of the programs whose sizes make up the rest, where some do exactly.

    >>> left_over_note(26_624)
    "the TPU runtime's own buffer (26,624 B, there from the start)"
    >>> left_over_note(71_680, [{"name": "jit_f", "generated_code_size_in_bytes": 45_056}])
    "the TPU runtime's own buffer (26,624 B) and the code of jit_f (45,056 B)"
    """
    from jaxmem.runtime.tpu_pool import RUNTIME_BYTES

    if left is None:
        return "no memory_stats() on this device"
    if left == RUNTIME_BYTES:
        return f"the TPU runtime's own buffer ({RUNTIME_BYTES:,} B, there from the start)"
    names = code_making(left - RUNTIME_BYTES, executables or [])
    if names:
        return f"the TPU runtime's own buffer ({RUNTIME_BYTES:,} B) and the code of {', '.join(names)} " \
               f"({left - RUNTIME_BYTES:,} B)"
    return f"{left:,} B not in any live array: the runtime's own buffers and loaded programs' code"


def code_making(total: int, executables: list[dict[str, Any]], most: int = 3) -> list[str]:
    """Names of at most `most` executables whose code sizes add up to `total` exactly, if any."""
    from itertools import combinations

    sized = [(e.get("name", "?"), int(e.get("generated_code_size_in_bytes", 0))) for e in executables[:40]]
    for k in range(1, most + 1):
        for group in combinations(sized, k):
            if sum(size for _, size in group) == total:
                return [name for name, _ in group]
    return []


def suggestions(kind: str, program: str | None, figures: dict[str, Any] | None, held: list[dict[str, Any]],
                preset: str | None) -> list[str]:
    """What to change, most direct first, as things to run or write."""
    out = []
    device = preset or "<preset>"
    if held:
        top = held[0]
        out.append(f"free what {top['line']} holds ({format_size(top['bytes'])} in {top['arrays']} arrays) "
                   "before the step: drop the reference (`del x`) or call `x.delete()`")
    if figures and figures.get("alias_size_in_bytes", 0) == 0 and figures.get("argument_size_in_bytes", 0) >= 64 * _MiB \
            and figures.get("output_size_in_bytes", 0) >= 64 * _MiB:
        out.append(f"donate the state to {program or 'the step'}: jax.jit(step, donate_argnums=(0,)) lets its "
                   "outputs reuse the state's buffers")
    out.append(f"jaxmem maxbatch FILE.py:make --arg batch --device {device}   # the largest batch that fits")
    out.append(f"jaxmem fit FILE.py:make --device {device}   # rematerialize until the step fits")
    if kind == "tpu_compile_hbm":
        out.insert(0, "the program's temporaries alone exceed the chip: a smaller batch, remat "
                      "(jax.checkpoint) or sharding over more chips")
    return out


def text_figures(message: str, largest_free: int | None = None) -> dict[str, Any]:
    """What the error's text says, read by `oom_text` and explained by `explain`: the kind, the
    figures in bytes, the verdict and what it means. `largest_free` (from `memory_stats()`)
    tells fragmentation where the text alone cannot."""
    parsed = parse_oom(message)
    if parsed is None:
        return {"kind": "unknown", "verdict": "unknown", "meaning": None, "program_in_text": None,
                **{k: None for k in ("requested", "free", "reserved", "reservable", "limit")}}
    explained = explain_oom(parsed)
    figures = {k: _bytes(parsed, k) for k in ("requested", "free", "reserved", "reservable", "limit")}
    mine = verdict(figures["requested"], figures["free"], largest_free)
    return {"kind": parsed.kind, **figures, "program_in_text": parsed.program,
            "verdict": "fragmentation" if mine == "fragmentation" else explained.verdict,
            "meaning": explained.meaning}


def take_postmortem(recorder: Any, message: str) -> str | None:
    """Write `postmortem-N.json` for an out-of-memory whose error text is `message`; its path."""
    devices = {name: stats for name, stats in recorder.last.items()}
    for device in recorder.devices():
        stats = jax_hooks.read_stats(device)
        if stats is not None:
            devices[f"{device.platform}:{device.id}"] = stats
    record = recorder.take_profile("oom")
    first = next((s for s in devices.values() if "bytes_in_use" in s), None)
    largest = (first or {}).get("largest_free_block_bytes")
    text = text_figures(message, largest)
    current = recorder.counter.current()
    program = text["program_in_text"] or (f"jit_{current}" if current else None)
    figures = next((p for p in reversed(recorder.programs) if p.get("name") == program), None)
    held = _held(record, first)
    executables = _executables(recorder)[:50]
    held["left_over"] = left_over_note(held["left_over_bytes"], executables)
    kind_name = _device_kind(recorder)
    preset = preset_for(kind_name, (first or {}).get("bytes_limit"))
    data = {"t": recorder.now(), "message": message[:4000], **text, "program": program,
            "largest_free_block": largest, "device_kind": kind_name, "preset": preset,
            "stats": devices, "held": held, "profile": record.get("file") if record else None,
            "executables": executables, "program_figures": figures,
            "calls": dict(recorder.counter.calls),
            "suggestions": suggestions(text["kind"], program, figures, held["by_line"], preset)}
    n = len(recorder.postmortems) + 1
    return str(recorder.store.write_json(f"postmortem-{n}.json", data))


def _bytes(parsed: Any, name: str) -> int | None:
    size = getattr(parsed, name, None) if parsed else None
    return None if size is None else int(size.bytes)


def _device_kind(recorder: Any) -> str:
    for device in recorder.devices():
        if device.platform != "cpu":
            return str(getattr(device, "device_kind", device.platform))
    devices = recorder.devices()
    return str(getattr(devices[0], "device_kind", "cpu")) if devices else ""
