"""Progress of work that takes seconds to minutes: a spinner on stderr in a terminal, a line
that updates itself in a notebook's output; nothing when quiet, and never on stdout (the
user's program's output is theirs).

    with busy("compiling for XLA:TPU (tpu-v5e-16gb)", quiet=False):
        ...
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

from jaxmem.reports.escape import plain


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (its output is a notebook's cell)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def busy_for(quiet: bool) -> Callable[[str], ContextManager[Any]]:
    """The progress display for one call: nothing (`quiet`), a notebook line, or the terminal's
    spinner on stderr (shown once the work has run a second)."""
    if quiet:
        return lambda label: nullcontext()
    if in_notebook():
        return notebook_busy
    from jaxmem.reports.terminal import busy

    return busy


@contextmanager
def notebook_busy(label: str, interval: float = 1.0) -> Iterator[None]:
    """A line in the notebook's output, `label` and the seconds so far, updated every
    `interval` seconds, and what it took once done."""
    import html

    from IPython.display import HTML, display

    text = html.escape(plain(label))
    started = time.perf_counter()
    handle = display(HTML(f"<small>jaxmem: {text}…</small>"), display_id=True)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(interval):
            handle.update(HTML(f"<small>jaxmem: {text}… {time.perf_counter() - started:.0f} s</small>"))

    ticker = threading.Thread(target=tick, name="jaxmem-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        handle.update(HTML(f"<small>jaxmem: {text}: {time.perf_counter() - started:.1f} s</small>"))
