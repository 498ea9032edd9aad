"""Record a running JAX program's device memory: `memory_stats()` over time, device memory
profiles, the compiled programs, and a post-mortem at an out-of-memory.

    with jaxmem.record("run1"):          # or: jaxmem record --out run1 -- python train.py
        for batch in data:
            state = train_step(state, batch)

What is read, and when (the module `jax_hooks` says how each hook enters JAX):
- `memory_stats()` of each device: when a call of a jitted function completes (the recorder's own
  thread waits for one of its outputs, so JAX's asynchronous dispatch is never blocked), and every
  `interval` seconds in between. Where a backend has no `memory_stats()` (JAX's CPU backend) the
  live arrays' bytes are read instead, and the recording says so.
- device memory profiles (`jax.profiler.device_memory_profile()`: every live buffer and executable
  with the Python stack that made it): at the start, after calls 1, 2, 4, 8, ... of each jitted
  function, at each new peak (at most one a second), every `profile_period` seconds, at an
  out-of-memory and at the end; a ring keeps the latest `max_profiles`. Those after a call (the
  points leaks are read from) wait for the calls in flight and hold the next one while the
  profile is read, so each holds exactly the arrays of the calls it is labelled with.
- each compiled program's `memory_analysis()` figures, when it is compiled.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from jaxmem.recording import jax_hooks
from jaxmem.recording.profile_read import group_by_line, group_by_line_and_size, read_profile
from jaxmem.recording.store import DEFAULT_MAX_BYTES, DEFAULT_MAX_PROFILES, RecordingStore

LINES_KEPT = 40
# Calls closer together than this are read only where memory changed (a loop of tiny calls makes
# thousands a second; each reading is a line on disk).
CALL_SAMPLE_GAP = 0.05  # lines of the user's code kept per profile in profiles.jsonl


@dataclass
class RecordOptions:
    """How a run is recorded: where to, how often, and within which bounds."""
    out: str = "jaxmem-recording"
    interval: float = 0.1
    profile_period: float = 60.0
    max_profiles: int = DEFAULT_MAX_PROFILES
    max_bytes: int = DEFAULT_MAX_BYTES
    count_calls: bool = True


def _device_name(device: Any) -> str:
    return f"{device.platform}:{device.id}"


def smallest_array(tree: Any) -> Any:
    """An output of a call to wait for: when it is ready, the call is done. The smallest array of
    the last output where the call returns a tuple (a loss, seldom donated to the next call, as
    the state is), else the smallest of all."""
    import jax

    if isinstance(tree, tuple) and len(tree) > 1:
        last = smallest_array(tree[-1])
        if last is not None:
            return last
    best = None
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and (best is None or leaf.nbytes < best.nbytes):
            best = leaf
    return best


class Recorder:
    """Records the devices of this process until `stop()` (or the process ends)."""

    def __init__(self, options: RecordOptions | None = None, argv: list[str] | None = None) -> None:
        self.options = options or RecordOptions()
        self.store = RecordingStore(self.options.out, self.options.max_bytes, self.options.max_profiles)
        self.argv = list(argv if argv is not None else sys.argv)
        self.hooks = jax_hooks.Hooks()
        self.counter = jax_hooks.CallCounter(self._on_call)
        self.clients: list[Any] = []
        self.seen_programs: set[int] = set()
        self.programs: list[dict[str, Any]] = []
        self.calls_done: queue.Queue = queue.Queue(maxsize=256)
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.started = time.time()
        self.last: dict[str, dict[str, int]] = {}
        self.peak_profiled = 0
        self.last_peak_profile = 0.0
        self.last_periodic = time.time()
        self.no_stats: set[str] = set()
        self.postmortems: list[str] = []
        self.donation_warnings: list[str] = []
        self.user_steps = 0
        self.untimed_calls = 0
        self.lock = threading.RLock()
        self.stopped = False
        self.started_profile = False
        self.errors_seen: list[str] = []
        self.last_call_sample = 0.0

    # -- starting and stopping ------------------------------------------------------------
    def start(self) -> "Recorder":
        """Install the hooks and start the recorder's threads. JAX must be importable; its
        backends are not started here."""
        self.hooks.backends(self._on_backend)
        self.hooks.compiles(self._on_compile)
        if self.options.count_calls:
            self.hooks.jit(self.counter)
        self.hooks.errors(self._on_error)
        self.hooks.warnings(self._on_warning)
        for target in (self._sample_loop, self._completion_loop):
            thread = threading.Thread(target=target, name=f"jaxmem-record-{target.__name__}", daemon=True)
            thread.start()
            self.threads.append(thread)
        atexit.register(self.stop)
        return self

    def stop(self) -> dict[str, Any]:
        """Finish the recording: last sample and profile, leaks, `recording.json`. Idempotent."""
        with self.lock:
            if self.stopped:
                return {}
            self.stopped = True
        try:
            self.calls_done.put(None, timeout=5.0)
        except queue.Full:
            pass
        deadline = time.time() + 5.0
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.time()))
        self.stopping.set()
        self.counter.active = False
        self.sample_all("end")
        self.take_profile("end")
        self.hooks.uninstall()
        from jaxmem.recording.summary import summarize

        summary = summarize(self)
        self.store.write_json("recording.json", summary)
        self.store.close()
        return summary

    def __enter__(self) -> "Recorder":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def step(self) -> None:
        """Mark the end of one step of the user's loop (optional: calls are counted anyway)."""
        self.user_steps += 1
        self.sample_all("step", step=self.user_steps)
        if _power_of_two(self.user_steps):
            self.take_profile("step", step=self.user_steps)

    # -- hooks ------------------------------------------------------------------------------
    def _on_backend(self, client: Any) -> None:
        with self.lock:
            self.clients.append(client)

    def _on_compile(self, fun_name: str) -> None:
        for client in list(self.clients):
            for exe in jax_hooks.live_executables(client):
                key = jax_hooks.executable_key(exe)
                if key in self.seen_programs:
                    continue
                self.seen_programs.add(key)
                figures = jax_hooks.executable_figures(exe)
                if figures:
                    record = {"t": self.now(), "jax_name": fun_name, "calls": dict(self.counter.calls), **figures}
                    self.programs.append(record)
                    self.store.append("programs.jsonl", record)

    def _on_call(self, name: str, n: int, out: Any) -> None:
        leaf = smallest_array(out)
        try:
            self.calls_done.put_nowait((name, n, leaf))
        except queue.Full:  # the recorder is behind: count the call, hold no array
            self.untimed_calls += 1

    def _on_error(self, message: str) -> None:
        from jaxmem.recording.postmortem import take_postmortem

        if message in self.errors_seen:  # the same error, seen made and then uncaught
            return
        self.errors_seen.append(message)
        try:
            path = take_postmortem(self, message)
        except Exception as err:  # a post-mortem must never replace the user's error
            self.store.append("errors.jsonl", {"t": self.now(), "postmortem_failed": repr(err)[:500]})
            return
        if path:
            self.postmortems.append(path)

    def _on_warning(self, text: str) -> None:
        if "donated buffers were not usable" in text:
            self.donation_warnings.append(text[:2000])
            self.store.append("events.jsonl", {"t": self.now(), "event": "donation_not_used", "text": text[:2000],
                                               "program": self.counter.current()})

    # -- threads ------------------------------------------------------------------------------
    def _completion_loop(self) -> None:
        while True:
            item = self.calls_done.get()
            if item is None:
                return
            try:
                self._completed(*item)
            except Exception as err:  # the recorder's thread must outlive any one reading
                self.store.append("errors.jsonl", {"t": self.now(), "call_reading_failed": repr(err)[:500]})

    def _completed(self, name: str, n: int, leaf: Any) -> None:
        devices = None
        if leaf is not None:
            try:
                devices = list(leaf.devices())
            except Exception:  # donated to the next call already
                leaf = None
        done = self._wait(leaf)
        del leaf
        now = time.time()
        if _power_of_two(n) or now - self.last_call_sample >= CALL_SAMPLE_GAP:
            self.last_call_sample = now
            self.sample_all("call", program=name, call=n, devices=devices, confirmed=done)
        else:  # many calls a second: one reading per CALL_SAMPLE_GAP unless memory changed
            self.sample_all("call", program=name, call=n, devices=devices, confirmed=done, only_changed=True)
        if _power_of_two(n):
            self.take_profile("call", program=name, call=n)

    @staticmethod
    def _wait(leaf: Any) -> bool:
        if leaf is None:
            return False
        try:
            leaf.block_until_ready()
            return True
        except Exception:  # donated to the next call, or deleted: that call's sample stands
            return False

    def _sample_loop(self) -> None:
        while not self.stopping.wait(self.options.interval):
            self.sample_all("interval", only_changed=True)
            self._maybe_profile()

    def _maybe_profile(self) -> None:
        now = time.time()
        if not self.started_profile and self.clients:
            self.started_profile = True
            self.take_profile("start")
            return
        peak = max((s.get("peak_bytes_in_use", 0) + s.get("peak_bytes_reserved", 0) for s in self.last.values()),
                   default=0)
        if peak > self.peak_profiled * 1.05 and now - self.last_peak_profile >= 1.0 and self.clients:
            self.peak_profiled, self.last_peak_profile = peak, now
            self.take_profile("peak")
        elif now - self.last_periodic >= self.options.profile_period and self.clients:
            self.last_periodic = now
            self.take_profile("periodic")

    # -- readings --------------------------------------------------------------------------------
    def now(self) -> float:
        return round(time.time() - self.started, 6)

    def devices(self) -> list[Any]:
        out = []
        for client in list(self.clients):
            try:
                out += list(client.local_devices())
            except Exception:
                continue
        return out

    def sample_all(self, why: str, *, devices: list[Any] | None = None, only_changed: bool = False,
                   **extra: Any) -> None:
        """Read every device's stats (or `devices`') and append one sample line per device."""
        for device in devices if devices is not None else self.devices():
            name = _device_name(device)
            stats = jax_hooks.read_stats(device)
            if stats is None:
                self._sample_live_arrays(device, name, why, only_changed, extra)
                continue
            if only_changed and self.last.get(name) == stats:
                continue
            self.last[name] = stats
            self.store.append("samples.jsonl", {"t": self.now(), "why": why, "device": name, **extra, **stats})

    def _sample_live_arrays(self, device: Any, name: str, why: str, only_changed: bool, extra: dict) -> None:
        # No memory_stats() (JAX's CPU backend): the live arrays' bytes on this device instead.
        self.no_stats.add(name)
        if only_changed and time.time() - self.last.get(name, {}).get("_t", 0) < 1.0:
            return
        live = live_bytes(device)
        self.last[name] = {"live_array_bytes": live, "_t": time.time()}
        self.store.append("samples.jsonl", {"t": self.now(), "why": why, "device": name, **extra,
                                            "live_array_bytes": live})

    def take_profile(self, reason: str, **extra: Any) -> dict[str, Any] | None:
        """Take a device memory profile now; keep it and its summary by line. One taken at a
        call or a step (the points leaks are read from) is taken with no call in flight, so the
        calls it is labelled with made exactly the arrays it holds."""
        if not self.clients:
            return None
        import jax

        still = self.counter.still() if reason in ("call", "step") else contextlib.nullcontext(None)
        try:
            with still as calls:
                blob = jax.profiler.device_memory_profile()
        except Exception as err:
            self.store.append("errors.jsonl", {"t": self.now(), "profile_failed": repr(err)[:500]})
            return None
        return self.keep_profile(blob, reason, calls=calls, **extra)

    def keep_profile(self, blob: bytes, reason: str, calls: dict[str, int] | None = None,
                     **extra: Any) -> dict[str, Any]:
        samples = read_profile(blob)
        by_line = group_by_line(samples)
        code = group_by_line(samples, "executable")
        record = {"t": self.now(), "why": reason, **extra,
                  "calls": dict(self.counter.calls) if calls is None else calls,
                  "user_steps": self.user_steps, "file": self.store.profile(blob, reason),
                  "buffer_bytes": sum(v.bytes for v in by_line.values()),
                  "buffers": sum(v.count for v in by_line.values()),
                  "executables": sum(v.count for v in code.values()),
                  "executable_bytes": sum(v.bytes for v in code.values()),
                  "by_line": {k: [v.bytes, v.count] for k, v in list(by_line.items())[:LINES_KEPT]},
                  "by_line_size": sorted(([line, size, count] for (line, size), count in group_by_line_and_size(samples).items()),
                                         key=lambda r: -r[1] * r[2])[:2 * LINES_KEPT]}
        self.store.append("profiles.jsonl", record)
        return record


def live_bytes(device: Any) -> int:
    """Bytes of the live arrays that have a shard on `device`."""
    import jax

    total = 0
    try:
        arrays = jax.live_arrays(device.platform)
    except Exception:
        return 0
    for array in arrays:
        try:
            total += sum(s.data.nbytes for s in array.addressable_shards if s.device == device)
        except Exception:
            continue
    return total


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def record(out: str | os.PathLike = "jaxmem-recording", *, interval: float = 0.1, profile_period: float = 60.0,
           max_profiles: int = DEFAULT_MAX_PROFILES, max_bytes: int = DEFAULT_MAX_BYTES,
           count_calls: bool = True) -> Recorder:
    """Record this process's device memory into `out` (a folder) until the `with` block ends.

    >>> import tempfile, jax.numpy as jnp
    >>> with record(tempfile.mkdtemp()) as rec:
    ...     x = jnp.ones(1000).block_until_ready()
    >>> sorted(rec.store.out.glob("recording.json"))[0].name
    'recording.json'

    Args:
        out: the folder to write (created); see `recording.store` for what is in it.
        interval: seconds between readings of `memory_stats()` besides those at each call.
        profile_period: seconds between periodic device memory profiles.
        max_profiles, max_bytes: the bounds of the profiles' ring and of the whole recording.
        count_calls: wrap `jax.jit` to count calls and read memory when each completes.

    Returns:
        A `Recorder`, to use as a context manager (`with record(...) as rec:`); `rec.step()`
        marks the end of a step where the loop is not one jitted function.
    """
    options = RecordOptions(out=os.fspath(out), interval=interval, profile_period=profile_period,
                            max_profiles=max_profiles, max_bytes=max_bytes, count_calls=count_calls)
    return Recorder(options)
