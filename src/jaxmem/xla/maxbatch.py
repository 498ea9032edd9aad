"""The largest integer value of a factory's keyword argument whose program fits a device.

The judge is expensive (an XLA:GPU compile and the pool run over N steps), so the search asks
it as few times as it can: a guess from a cheap model (jaxmem's planner at two small values,
a straight line through them), then secant steps on XLA's own totals, with bisection whenever
a step would not narrow the bracket. It ends with `fits(value)` and not `fits(value + 1)`, both
judged, so the answer is exact whenever fitting is monotone in the value (more batch, more
memory).

    result = search(judge, limit_bytes=60 << 30, guess=512)
    result.value, result.total_bytes, result.next_total_bytes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from jaxmem.errors import PlanError


@dataclass(frozen=True)
class Judgement:
    """One judged value: whether it fits and XLA's total bytes there."""

    value: int
    fits: bool
    total_bytes: int
    cached: bool = False


@dataclass
class SearchResult:
    """`value` fits, `value + 1` does not (or `value` is `maximum`: `at_maximum`)."""

    value: int
    total_bytes: int
    next_total_bytes: int | None
    judged: list[Judgement] = field(default_factory=list)
    at_maximum: bool = False


def line_guess(points: list[tuple[int, int]], limit: int, minimum: int = 1) -> int | None:
    """The value where a straight line through the last two (value, bytes) points reaches `limit`.

    >>> line_guess([(1, 110), (2, 120)], 200)
    10
    """
    if len(points) < 2:
        return None
    (v1, b1), (v2, b2) = points[-2], points[-1]
    if v1 == v2 or b2 <= b1:
        return None
    slope = (b2 - b1) / (v2 - v1)
    return max(minimum, int((limit - b1) // slope) + v1)


def search(judge: Callable[[int], Judgement], *, limit_bytes: int, guess: int | None = None,
           minimum: int = 1, maximum: int = 1 << 24, on_judged: Callable[[Judgement], None] | None = None) -> SearchResult:
    """Find the largest value in [minimum, maximum] that `judge` says fits.

    >>> judge = lambda v: Judgement(v, 1000 + 10 * v <= 5000, 1000 + 10 * v)
    >>> search(judge, limit_bytes=5000, guess=100).value
    400

    Args:
        judge: value -> `Judgement` (compiles; expensive).
        limit_bytes: the pool's limit, which the secant steps aim XLA's totals at.
        guess: a first value to try (from a cheap model); `minimum` when None.
        minimum, maximum: the range searched.
        on_judged: called after each judgement (a progress bar).

    Raises:
        PlanError: `minimum` itself does not fit.
    """
    if minimum < 1 or maximum < minimum:
        raise PlanError(f"the search range {minimum}..{maximum} is empty")
    seen: dict[int, Judgement] = {}

    def ask(value: int) -> Judgement:
        if value not in seen:
            seen[value] = judge(value)
            if on_judged is not None:
                on_judged(seen[value])
        return seen[value]

    lo: int | None = None      # largest value known to fit
    hi: int | None = None      # smallest value known not to fit
    candidate = min(max(guess if guess is not None else minimum, minimum), maximum)
    for _ in range(200):
        j = ask(candidate)
        if j.fits:
            lo = candidate if lo is None else max(lo, candidate)
        else:
            hi = candidate if hi is None else min(hi, candidate)
        if lo is None and hi is not None and hi <= minimum:
            raise PlanError(f"even {minimum} does not fit: XLA's total there is {seen[minimum].total_bytes} bytes")
        if lo is not None and lo >= maximum:
            return SearchResult(lo, seen[lo].total_bytes, None, list(seen.values()), at_maximum=True)
        if lo is not None and hi is not None and hi == lo + 1:
            return SearchResult(lo, seen[lo].total_bytes, seen[hi].total_bytes, list(seen.values()))
        candidate = _next(seen, lo, hi, limit_bytes, minimum, maximum)
    raise PlanError("the search did not settle in 200 judgements (is fitting monotone in the value?)")


def _next(seen: dict[int, Judgement], lo: int | None, hi: int | None, limit: int, minimum: int, maximum: int) -> int:
    """The next value to judge: the secant guess (through the two judged totals nearest the
    limit) and its neighbour when they fall inside the bracket, else a doubling or a bisection."""
    points = sorted((v, j.total_bytes) for v, j in seen.items())
    closest = sorted(sorted(points, key=lambda p: abs(p[1] - limit))[:2])
    guess = line_guess(closest, limit, minimum)
    low = minimum - 1 if lo is None else lo   # every value up to `low` fits (none when below minimum)
    if hi is None:
        if guess is not None and guess > low and guess not in seen:
            return min(maximum, guess)
        return min(maximum, max(low + 1, 2 * low))
    if guess is not None:
        for g in (guess, guess + 1):
            if low < g < hi and g not in seen:
                return g
    middle = (low + hi) // 2
    return middle if middle > low else low + 1
