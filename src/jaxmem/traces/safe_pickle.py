"""Load a pickle that may only hold plain data: every global (class, function) is refused.

PyTorch memory snapshots are pickles of dicts, lists, strings and numbers. A pickle can name any
importable callable (os.system, builtins.eval) and have the loader call it; an Unpickler whose
`find_class` refuses every global turns that into an error before anything runs.

    data = load_plain_pickle("snapshot.pickle")   # dict, or TraceError on anything else

Plain data can still cost more than its size: a pickle's memo lets one list be referenced many
times, so 1.2 KB of nested `[a, a]` stands for 2**60 elements to anything that walks it as a
tree (`repr`, `str`, `json.dumps`, a loop over every segment's blocks). Loading itself is
linear; the readers then touch only values of the type they expect, visit a shared list once
(`torch_snapshot`), and quote values in messages with `errors.quote`, which is bounded.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from jaxmem.errors import TraceError


class _PlainUnpickler(pickle.Unpickler):
    """Builds only the built-in containers and scalars the pickle opcodes make directly."""

    def find_class(self, module: str, name: str) -> Any:
        raise TraceError(f"refuses to load global {module}.{name}: the file is not plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise TraceError("refuses a persistent reference: the file is not plain data")


def loads_plain(data: bytes, source: str = "<bytes>") -> Any:
    """Unpickle bytes that hold only plain data; TraceError naming `source` otherwise.

    >>> loads_plain(pickle.dumps({"a": [1, 2.5, "x"]}))
    {'a': [1, 2.5, 'x']}
    """
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except TraceError as err:
        raise TraceError(f"{source}: {err}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, OverflowError, MemoryError, UnicodeDecodeError) as err:
        kind = "truncated" if isinstance(err, EOFError) else "corrupt"
        raise TraceError(f"{source}: {kind} pickle ({type(err).__name__}: {str(err)[:100]})") from None


def load_plain_pickle(path: str | Path) -> Any:
    """Read and unpickle a file of plain data (see `loads_plain`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TraceError(f"{path}: cannot read ({err.strerror or err})") from None
    return loads_plain(data, str(path))
