"""Settings of PyTorch's CUDA caching allocator: parsed from PYTORCH_CUDA_ALLOC_CONF or a snapshot.

The meanings follow c10's AllocatorConfig (PyTorch 2.x): sizes are rounded up to 512 bytes, or
to a power-of-two division when `roundup_power2_divisions` asks for it; blocks of at least
`max_split_size` are never split; `garbage_collection_threshold` frees old cached blocks when the
reserved total passes that fraction of the allowed memory.

    >>> cfg = parse_alloc_conf("max_split_size_mb:128,roundup_power2_divisions:4")
    >>> cfg.max_split_size == 128 << 20, round_size(1200 << 10, cfg) == 1280 << 10
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxmem.errors import ConfigError

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512             # every size is rounded to a multiple of this
K_SMALL_SIZE = 1 * MiB             # largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB           # small-pool segments, and small expandable pages
K_LARGE_BUFFER = 20 * MiB          # segments for requests in (1 MiB, 10 MiB); large pages
K_MIN_LARGE_ALLOC = 10 * MiB       # from here on a segment is the request rounded to 2 MiB
K_ROUND_LARGE = 2 * MiB
NO_LIMIT = (1 << 64) - 1           # SIZE_MAX: "max_split_size not set"
N_INTERVALS = 16                   # roundup_power2_divisions intervals: 1 MiB .. 32 GiB and up


@dataclass
class CachingConfig:
    """The caching allocator's knobs (defaults = PyTorch's defaults)."""

    max_split_size: int = NO_LIMIT
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: list[int] = field(default_factory=lambda: [0] * N_INTERVALS)
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False

    def describe(self) -> str:
        """One line for reports, in PYTORCH_CUDA_ALLOC_CONF spelling."""
        parts = []
        if self.max_split_size != NO_LIMIT:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if any(self.roundup_power2_divisions):
            parts.append("roundup_power2_divisions:[" + ",".join(
                f"{1 << i}:{d}" for i, d in enumerate(self.roundup_power2_divisions)) + "]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts) or "(defaults)"


def _divisions_index(size: int) -> int:
    # interval i holds sizes in [2^i MiB, 2^(i+1) MiB); smaller sizes share interval 0
    return min(max(size.bit_length() - 1 - 20, 0), N_INTERVALS - 1)


def round_size(size: int, cfg: CachingConfig) -> int:
    """The block size the caching allocator reserves for a request of `size` bytes.

    >>> round_size(1, CachingConfig()), round_size(513, CachingConfig())
    (512, 1024)
    """
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = cfg.roundup_power2_divisions[_divisions_index(size)]
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """Bytes of the segment cudaMalloc'd for a rounded request that found no cached block."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _lex(text: str) -> list[str]:
    tokens: list[str] = []
    buf = ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append(buf)
                buf = ""
            tokens.append(ch)
        elif ch != " ":
            buf += ch
    if buf:
        tokens.append(buf)
    return tokens


def _int(token: str, key: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a whole number, got {token!r}") from None


def parse_alloc_conf(text: str, base: CachingConfig | None = None) -> CachingConfig:
    """Settings from a PYTORCH_CUDA_ALLOC_CONF string (unknown keys are a ConfigError).

    >>> parse_alloc_conf("expandable_segments:True").expandable_segments
    True

    Args:
        text: e.g. "max_split_size_mb:256,garbage_collection_threshold:0.6".
        base: settings to start from (default: PyTorch's defaults).
    Returns:
        A new CachingConfig.
    """
    cfg = CachingConfig() if base is None else CachingConfig(
        base.max_split_size, base.max_non_split_rounding_size, list(base.roundup_power2_divisions),
        base.garbage_collection_threshold, base.expandable_segments)
    tok = _lex(text or "")
    i = 0

    def value(j: int, key: str) -> str:
        if j + 1 >= len(tok) or tok[j] != ":":
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: expected '{key}:<value>' in {text!r}")
        return tok[j + 1]

    while i < len(tok):
        key = tok[i]
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = _int(value(i + 1, key), key)
            if mb < K_LARGE_BUFFER // MiB:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be >= 20, got {mb}")
            if key == "max_split_size_mb":
                cfg.max_split_size = mb * MiB
            else:
                cfg.max_non_split_rounding_size = mb * MiB
            i += 3
        elif key == "garbage_collection_threshold":
            raw = value(i + 1, key)
            try:
                t = float(raw)
            except ValueError:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a number, got {raw!r}") from None
            if not 0.0 < t < 1.0:
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must lie in (0, 1), got {t}")
            cfg.garbage_collection_threshold = t
            i += 3
        elif key == "expandable_segments":
            raw = value(i + 1, key)
            if raw not in ("True", "False"):
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be True or False, got {raw!r}")
            cfg.expandable_segments = raw == "True"
            i += 3
        elif key == "roundup_power2_divisions":
            i = _parse_divisions(tok, i, cfg, text)
        elif key in ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                     "pinned_num_register_threads", "pinned_use_background_threads",
                     "pinned_reserve_segment_size_mb", "graph_capture_record_stream_reuse"):
            raw = value(i + 1, key)  # accepted: they do not change where blocks go
            if key == "backend" and raw not in ("native",):
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: only backend:native is modelled, got {raw!r}")
            i += 3
        else:
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: unrecognized option {key!r}")
        if i < len(tok):
            if tok[i] != ",":
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: expected ',' after {key} in {text!r}")
            i += 1
    return cfg


def _parse_divisions(tok: list[str], i: int, cfg: CachingConfig, text: str) -> int:
    key = "roundup_power2_divisions"
    if i + 2 >= len(tok) or tok[i + 1] != ":":
        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: expected '{key}:<value>' in {text!r}")
    i += 2
    if tok[i] != "[":
        n = _int(tok[i], key)
        if not _is_pow2(n):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a power of two, got {n}")
        cfg.roundup_power2_divisions = [n] * N_INTERVALS
        return i + 1
    i += 1
    first, last_index = True, 0
    while i < len(tok) and tok[i] != "]":
        interval = tok[i]
        if i + 2 >= len(tok) or tok[i + 1] != ":":
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: bad {key} list in {text!r}")
        div = _int(tok[i + 2], key)
        if div != 0 and not _is_pow2(div):
            raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} divisions must be a power of two or 0, got {div}")
        if interval == ">":
            for j in range(last_index, N_INTERVALS):
                cfg.roundup_power2_divisions[j] = div
        else:
            mb = _int(interval, key)
            if not _is_pow2(mb):
                raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: {key} intervals must be powers of two (MB), got {mb}")
            index = min(mb.bit_length() - 1, N_INTERVALS - 1)
            if first:
                for j in range(index):
                    cfg.roundup_power2_divisions[j] = div
                first = False
            cfg.roundup_power2_divisions[index] = div
            last_index = index
        i += 3
        if i < len(tok) and tok[i] == ",":
            i += 1
    if i >= len(tok):
        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF: unterminated {key} list in {text!r}")
    return i + 1


def config_from_settings(settings: dict[str, Any]) -> CachingConfig:
    """Settings as a memory snapshot records them (`allocator_settings`), or {} for defaults.

    The snapshot's resolved fields win over its PYTORCH_CUDA_ALLOC_CONF string, since the
    allocator may have been reconfigured at run time (`_set_allocator_settings`).
    """
    cfg = CachingConfig()
    conf = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(conf, str) and conf:
        cfg = parse_alloc_conf(conf)
    mss = settings.get("max_split_size")
    if isinstance(mss, int) and not isinstance(mss, bool):
        cfg.max_split_size = NO_LIMIT if mss < 0 or mss >= NO_LIMIT else mss
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and not isinstance(gc, bool):
        cfg.garbage_collection_threshold = float(gc)
    exp = settings.get("expandable_segments")
    if isinstance(exp, bool):
        cfg.expandable_segments = exp
    div = settings.get("roundup_power2_divisions")
    if isinstance(div, dict) and div:
        table = list(cfg.roundup_power2_divisions)
        for k, v in div.items():
            try:
                mb = int(k)
            except (TypeError, ValueError):
                continue
            if _is_pow2(mb) and isinstance(v, int):
                table[min(mb.bit_length() - 1, N_INTERVALS - 1)] = v
        cfg.roundup_power2_divisions = table
    elif isinstance(div, int) and not isinstance(div, bool) and div > 0:
        cfg.roundup_power2_divisions = [div] * N_INTERVALS
    return cfg
