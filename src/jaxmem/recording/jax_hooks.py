"""Where the recorder meets JAX: the one module that reaches into JAX while the user's program runs.

Each hook is JAX's public one where JAX has one, and says so where it is not:

- backends: `jax._src.xla_bridge.register_backend_initialization_hook` (called with each backend
  the user's JAX starts, when it starts it: the recorder never starts a backend itself, so
  `jax.distributed.initialize()` and platform settings keep working);
- compiles: `jax.monitoring`'s duration events ("/jax/core/compile/backend_compile_duration",
  public), then the backend's `live_executables()` for the new programs' `memory_analysis` figures;
- calls: JAX has no hook per call of a compiled program, so `jax.jit` is wrapped while recording:
  the wrapper counts calls by function and hands one output of each call to the recorder, which
  waits for it in its own thread (dispatch waits only while a profile after a call is read);
- errors: JAX raises RESOURCE_EXHAUSTED as `jax.errors.JaxRuntimeError`; its `__init__` is wrapped
  so that a post-mortem is taken when the error is made, whether the program then catches it or
  not;
- donation: JAX's "Some donated buffers were not usable" is a Python warning; `warnings.showwarning`
  is wrapped to see it (a warning the program filters out is not seen).

Every wrapper calls what it wraps with the same arguments and returns or raises what it did, and
`uninstall()` puts everything back.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
STAT_KEYS = ("bytes_in_use", "peak_bytes_in_use", "bytes_reserved", "peak_bytes_reserved", "bytes_limit",
             "bytes_reservable_limit",
             "largest_free_block_bytes", "num_allocs", "largest_alloc_size")


class CallCounter:
    """Calls of jitted functions by name; what the recorder is told of each call."""

    def __init__(self, on_call: Callable[[str, int, Any], None]) -> None:
        self.on_call = on_call
        self.calls: dict[str, int] = {}
        self.local = threading.local()
        self.lock = threading.Lock()
        self.active = True  # functions jitted while recording outlive it: then they only call
        # Dispatches in flight, and whether a reading waits for none to be (`still`).
        self.gate = threading.Condition()
        self.dispatching = 0
        self.held = False
        self.reading = threading.Lock()   # one still reading at a time

    def current(self) -> str | None:
        """The jitted function this thread is calling now, if any."""
        return getattr(self.local, "name", None)

    def call(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self.active:
            return fn(*args, **kwargs)
        outer = getattr(self.local, "name", None)
        if outer is not None:   # a jitted function called while another traces: not a call
            return fn(*args, **kwargs)
        self.local.name = name
        with self.gate:
            while self.held:
                self.gate.wait()
            self.dispatching += 1
        try:
            out = fn(*args, **kwargs)
            with self.lock:
                n = self.calls[name] = self.calls.get(name, 0) + 1
        finally:
            self.local.name = None
            with self.gate:
                self.dispatching -= 1
                self.gate.notify_all()
        self.on_call(name, n, out)
        return out

    @contextlib.contextmanager
    def still(self) -> Iterator[dict[str, int]]:
        """No call in flight and none starting for the duration: the calls so far, exactly the
        arrays the device holds for them (a profile taken here is labelled with its step). Never
        from inside a call (an out-of-memory's reading is not)."""
        with self.reading:
            with self.gate:
                self.held = True
                while self.dispatching:
                    self.gate.wait()
            try:
                with self.lock:
                    calls = dict(self.calls)
                yield calls
            finally:
                with self.gate:
                    self.held = False
                    self.gate.notify_all()


class CountedJit:
    """A jitted function that tells a `CallCounter` of each call, and is otherwise the function
    `jax.jit` returned: attributes (`lower`, `trace`, `eval_shape`, ...) are its own."""

    __slots__ = ("_jitted", "_name", "_counter", "__weakref__")

    def __init__(self, jitted: Any, name: str, counter: CallCounter) -> None:
        object.__setattr__(self, "_jitted", jitted)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_counter", counter)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._counter.call(self._name, self._jitted, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # A jitted function stored on a class is a method, as jax.jit's own object is.
        return self if instance is None else functools.partial(self, instance)

    def __repr__(self) -> str:
        return repr(self._jitted)


def function_name(fun: Any) -> str:
    """The name XLA gives a jitted function's program, less the "jit_" prefix."""
    inner = getattr(fun, "func", fun)  # functools.partial
    return str(getattr(inner, "__name__", None) or type(inner).__name__)


class Hooks:
    """The recorder's hooks into the user's JAX, installed together and removed together."""

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []

    def uninstall(self) -> None:
        while self.undo:
            self.undo.pop()()

    def backends(self, on_backend: Callable[[Any], None]) -> None:
        """Call `on_backend(client)` for each backend the user's JAX has started or will start."""
        from jax._src import xla_bridge  # no public hook for backend start

        xla_bridge.register_backend_initialization_hook(on_backend)

        def remove() -> None:
            try:
                xla_bridge._backend_initialization_hooks.remove(on_backend)
            except (AttributeError, ValueError):
                pass
        self.undo.append(remove)

    def compiles(self, on_compile: Callable[[str], None]) -> None:
        """Call `on_compile(name)` after each XLA compile (JAX's public monitoring events)."""
        import jax.monitoring as monitoring

        def listener(event: str, duration: float, **kwargs: Any) -> None:
            if event == COMPILE_EVENT:
                on_compile(str(kwargs.get("fun_name", "")))
        monitoring.register_event_duration_secs_listener(listener)
        unregister = getattr(monitoring, "unregister_event_duration_listener", None)
        if unregister is None:
            from jax._src import monitoring as private_monitoring
            unregister = private_monitoring.unregister_event_duration_listener
        self.undo.append(lambda: _quietly(unregister, listener))

    def jit(self, counter: CallCounter) -> None:
        """Wrap `jax.jit` so that every function jitted from now on is counted."""
        import jax

        original = jax.jit

        @functools.wraps(original)
        def counted_jit(fun: Any = None, *args: Any, **kwargs: Any) -> Any:
            if fun is None:  # jax.jit(static_argnums=...) as a decorator factory
                return functools.partial(counted_jit, *args, **kwargs)
            return CountedJit(original(fun, *args, **kwargs), function_name(fun), counter)
        jax.jit = counted_jit
        self.undo.append(lambda: setattr(jax, "jit", original))

    def errors(self, on_error: Callable[[str], None]) -> None:
        """Call `on_error(message)` whenever JAX makes a RESOURCE_EXHAUSTED error."""
        import jax

        cls = jax.errors.JaxRuntimeError
        original = cls.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if is_out_of_memory(self):
                on_error(str(self))
        cls.__init__ = init
        self.undo.append(lambda: setattr(cls, "__init__", original))
        self._excepthooks(on_error)

    def _excepthooks(self, on_error: Callable[[str], None]) -> None:
        # Some allocation failures reach Python as a ValueError (jax.device_put, an eager op on
        # a TPU v5e), which no class hook sees: those are seen when nothing catches them.
        original, original_thread = sys.excepthook, threading.excepthook

        def hook(kind: Any, value: Any, tb: Any) -> None:
            if is_out_of_memory(value):
                on_error(str(value))
            original(kind, value, tb)

        def thread_hook(args: Any) -> None:
            if is_out_of_memory(args.exc_value):
                on_error(str(args.exc_value))
            original_thread(args)
        sys.excepthook, threading.excepthook = hook, thread_hook

        def restore() -> None:
            sys.excepthook, threading.excepthook = original, original_thread
        self.undo.append(restore)

    def warnings(self, on_warning: Callable[[str], None]) -> None:
        """Call `on_warning(text)` for each warning shown, then show it as before."""
        original = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            try:
                on_warning(str(message))
            finally:
                original(message, category, filename, lineno, file, line)
        warnings.showwarning = show
        self.undo.append(lambda: setattr(warnings, "showwarning", original))


def is_out_of_memory(error: Any) -> bool:
    """Whether an exception is an out-of-memory from XLA or its runtime."""
    message = str(error)[:400] if isinstance(error, BaseException) else ""
    return "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except (KeyError, ValueError, AttributeError):
        pass


def live_executables(client: Any) -> list[Any]:
    """The executables a backend has loaded (jaxlib's `Client.live_executables`)."""
    try:
        return list(client.live_executables())
    except Exception:  # a backend without the method (some plugins)
        return []


def executable_figures(exe: Any) -> dict[str, Any] | None:
    """A loaded executable's name, `memory_analysis()` figures in bytes, and the donated
    parameters no output took (XLA's `buffer_donor` set, left after aliasing)."""
    try:
        module = exe.hlo_modules()[0]
        name = module.name
        stats = exe.get_compiled_memory_stats()
    except Exception:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes")
    figures: dict[str, Any] = {"name": name, **{k: int(getattr(stats, k, 0) or 0) for k in keys}}
    try:
        header = module.to_string().split("\n", 1)[0]
    except Exception:
        header = ""
    figures["donated_unaliased"] = unaliased_donors(header)
    return figures


def unaliased_donors(header: str) -> list[dict[str, Any]]:
    """The parameters an HLO module's header names as buffer donors (donated, but aliased to no
    output), with their shapes from its entry layout.

    >>> unaliased_donors("HloModule jit_f, buffer_donor={ (1, {}) }, entry_computation_layout={(f32[64]{0}, s32[64]{0})->f16[64]{0}}")
    [{'parameter': 1, 'shape': 's32[64]'}]
    """
    import re

    donors = re.search(r"buffer_donor=\{([^}]*(?:\{\}[^}]*)*)\}", header)
    if not donors:
        return []
    params = sorted({int(n) for n in re.findall(r"\((\d+),", donors.group(1))})
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", header)
    shapes = re.findall(r"[a-z0-9]+\[[0-9,]*\]", layout.group(1)) if layout else []
    return [{"parameter": p, "shape": shapes[p] if p < len(shapes) else "?"} for p in params]


def executable_key(exe: Any) -> int:
    try:
        return int(exe.unsafe_executable_pointer())
    except Exception:
        return id(exe)


def is_jax_imported() -> bool:
    return "jax" in sys.modules


def read_stats(device: Any) -> dict[str, int] | None:
    """A device's `memory_stats()`, only the keys a recording keeps; None where it has none."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    return {k: int(stats[k]) for k in STAT_KEYS if k in stats}
