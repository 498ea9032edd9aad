"""Where a recording goes on disk, bounded: JSON lines appended as the run goes, a ring of
profiles, and a byte limit.

    DIR/samples.jsonl     memory_stats() per device: at each completed call, and at an interval
    DIR/programs.jsonl    each compiled program: name, memory_analysis() figures, code bytes
    DIR/profiles.jsonl    each profile taken: why, when, calls so far, bytes by the user's line
    DIR/profiles/*.pb.gz  the profiles themselves (pprof; `pprof -diff_base A B` reads them)
    DIR/postmortem-N.json what was on the device when the program ran out of memory
    DIR/recording.json    the summary, written when the run ends

Lines are flushed as they are written, so a run that is killed leaves every line written so far
readable; `recording.json` can be rebuilt from them (`reports.load_recording`).
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

DEFAULT_MAX_BYTES = 512 << 20
DEFAULT_MAX_PROFILES = 24
# Profiles a ring never drops: the first, and those taken at an out-of-memory.
KEPT_REASONS = ("start", "oom")


class RecordingStore:
    """Appends a recording's files under `out`, within `max_bytes` and `max_profiles`."""

    def __init__(self, out: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_profiles: int = DEFAULT_MAX_PROFILES) -> None:
        self.out = Path(out)
        (self.out / "profiles").mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_profiles = max_bytes, max_profiles
        self.written = 0
        self.dropped_lines = 0
        self.lock = threading.Lock()
        self.files: dict[str, Any] = {}
        self.ring: deque[tuple[str, str]] = deque()  # (reason, path) of profiles a ring may drop
        self.profile_count = 0

    def append(self, name: str, record: dict[str, Any]) -> bool:
        """Append one JSON line to `name` (e.g. "samples.jsonl"); False once the limit is reached."""
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self.lock:
            if self.written + len(line) > self.max_bytes:
                self.dropped_lines += 1
                return False
            handle = self.files.get(name)
            if handle is None:
                handle = self.files[name] = open(self.out / name, "a", encoding="utf-8")
            handle.write(line)
            handle.flush()
            self.written += len(line)
        return True

    def profile(self, blob: bytes, reason: str) -> str | None:
        """Keep a profile's bytes; the oldest droppable profile goes when the ring is full.
        Returns its path relative to the recording, or None past the byte limit."""
        with self.lock:
            if self.written + len(blob) > self.max_bytes and reason != "oom":
                return None
            self.profile_count += 1
            rel = f"profiles/{self.profile_count:04d}-{reason}.pb.gz"
            (self.out / rel).write_bytes(blob)
            self.written += len(blob)
            if reason not in KEPT_REASONS:
                self.ring.append((reason, rel))
                while len(self.ring) > self.max_profiles:
                    self._drop(self.ring.popleft()[1])
            return rel

    def _drop(self, rel: str) -> None:
        path = self.out / rel
        try:
            self.written -= path.stat().st_size
            path.unlink()
        except OSError:
            pass

    def write_json(self, name: str, data: dict[str, Any]) -> Path:
        """Write a whole JSON file (a summary, a post-mortem) atomically."""
        path = self.out / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
        os.replace(tmp, path)
        return path

    def close(self) -> None:
        with self.lock:
            for handle in self.files.values():
                handle.close()
            self.files.clear()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a last line cut short by a killed run is skipped."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    out.append(record)
    except FileNotFoundError:
        return []
    return out
