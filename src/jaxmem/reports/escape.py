"""Text from files, labels, paths and frame names, made safe to print on someone's terminal.

    console.print(f"[bold]{markup(label)}[/]")     # rich: no markup, no control characters
    print(f"label: {plain(label)}")                 # plain text: no control characters

A label in the shared ledger is written by one user and printed on another's terminal, and a
frame name comes from whoever made the trace file: an escape sequence in either could move the
cursor, retitle the window or hide text, and `[/bold]` in rich markup raises an error. Control
characters (C0, DEL, C1, and the bidirectional overrides that reorder what is shown) become
visible `\\xNN` / `\\uNNNN` escapes; for rich, square brackets are escaped too.
"""

from __future__ import annotations

import re

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def plain(text: object) -> str:
    """`text` with every control character shown as an escape, on one line.

    >>> plain("ok\\x1b]0;pwned\\x07")
    'ok\\\\x1b]0;pwned\\\\x07'
    """
    return _CONTROL.sub(_visible, str(text))


def markup(text: object) -> str:
    """`plain(text)` with rich markup escaped, for `Console.print` and table cells."""
    # Imported here: the CLI's error line uses `plain` on every command, rich on few.
    from rich.markup import escape

    return escape(plain(text))
