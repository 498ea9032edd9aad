"""`jaxmem.maxbatch`: the largest value of one integer argument (a batch size, a sequence length)
whose program fits a GPU or TPU, judged by XLA's deviceless compile and the runtime over N steps.

    result = jaxmem.maxbatch(lambda batch_size: make_step(batch_size), arg="batch_size", device="tpu-v5e-16gb")
    result.value, result.compiles, [t.decided_by for t in result.trials]

`make(**{arg: value})` returns `(fn, args)` as a `jaxmem analyze` factory does; it runs under
`jax.eval_shape` where it can (no batch is allocated). A first guess comes from jaxmem's model
of XLA:GPU (a GPU) or its planner (a TPU); the search (`xla.maxbatch.search`) ends with `value`
fitting and `value + 1` not, both judged. `jaxmem maxbatch TARGET --arg NAME` calls this.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from jaxmem.api.maxbatch_result import MaxbatchResult, Trial
from jaxmem.api.pipeline import Options, pool_device
from jaxmem.api.program import Program, prepare
from jaxmem.errors import PlanError

__all__ = ["maxbatch", "MaxbatchResult", "Trial", "search_largest"]


def maxbatch(make: Callable[..., Any], arg: str, device: str = "h100-80gb", lo: int | None = None,
             hi: int | None = None, donate: int | Sequence[int] | None = None, quiet: bool = False,
             steps: int = 3) -> MaxbatchResult:
    """The largest `arg` in [lo, hi] whose program fits `device`.

    >>> import jaxmem
    >>> from jaxmem.examples.gpt import batch_example
    >>> result = jaxmem.maxbatch(batch_example, arg="batch_size", device="tpu-v5e-16gb")  # doctest: +SKIP
    >>> result.value, result.compiles  # doctest: +SKIP
    (..., 3)

    **Arguments:** `make`, called as `make(**{arg: value})`, returns `(fn, args)`; `device`, a
    GPU or TPU preset whose XLA compiles deviceless here; `lo`, `hi`, the range searched
    (default 1 to 2^24); `donate`, positional arguments to donate (a jitted `fn`'s own by
    default); `quiet`, no progress display; `steps`, the steps the runtime runs.

    **Returns:** a `MaxbatchResult` (`.value`, `.trials` with what decided each, `.compiles`).

    **Raises:** `JaxmemError`, one line: a device that is no GPU or TPU preset, or whose compiler
    is missing here; `make` failing; `lo` itself not fitting.
    """
    from jaxmem.api.progress import busy_for

    if not callable(make):
        raise PlanError(f"maxbatch takes a callable make(**{{arg: value}}) -> (fn, args), not a {type(make).__name__}")
    if not isinstance(arg, str) or not arg.isidentifier():
        raise PlanError(f"arg must be the name of make's keyword argument, got {arg!r}")
    options = Options(device=device, steps=steps, quiet=quiet)
    return search_largest(make, arg, options, lo or 1, hi or 1 << 24, donate, busy_for(quiet))


def resolve_device(text: str) -> Any:
    """A device as an `Accelerator` whose XLA compiles deviceless here; else one line."""
    from jaxmem.accelerators import find, gpu_presets, tpu_presets

    accelerator = find(text) if isinstance(text, str) else None
    if accelerator is None:
        raise PlanError(f"device must be a GPU or TPU preset ({', '.join(gpu_presets() + tpu_presets())}), "
                        f"got {text!r}")
    if accelerator.is_tpu:
        from jaxmem.xla.tpu.compile import TpuUnavailable, unavailable_reason as tpu_reason

        reason = tpu_reason()
        if reason:
            raise TpuUnavailable(f"maxbatch needs XLA:TPU for {accelerator.name}, which is not available here: {reason}")
    else:
        from jaxmem.xla.gpu.compile import GpuUnavailable, unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise GpuUnavailable(f"maxbatch needs XLA:GPU, which is not available here: {reason}")
    return accelerator


def program_at(make: Callable[..., Any], arg: str, value: int, donate: Any) -> Program:
    """`make(arg=value)`'s program, its arguments abstract where `make` can run so."""
    from jaxmem.api.maxbatch_mesh import factory_at

    fn, args = factory_at(make, arg, value)
    return prepare(fn, args, None, donate)


def sharded_mesh(make: Callable[..., Any], arg: str, lo: int) -> tuple[dict[str, int], list[Any]] | None:
    """The mesh the factory's arguments are sharded over (axis -> size) with each argument
    leaf's sharding, or None: read from a real call of `make` at `lo`, or where `make` cannot
    build that value (a batch of 1 laid out over 8 devices), at 8, 64 or 512."""
    from jaxmem.api.maxbatch_mesh import mesh_of

    values = [lo] + [v for v in (8, 64, 512) if v > lo]
    for value in values[:-1]:
        try:
            return mesh_of(make, arg, value)
        except PlanError:
            continue
    return mesh_of(make, arg, values[-1])   # the last value's failure is the one line the user sees


def search_largest(make: Callable[..., Any], arg: str, options: Any, lo: int, hi: int, donate: Any,
                   busy: Callable[[str], Any]) -> MaxbatchResult:
    """The one implementation of the search (`jaxmem maxbatch` hands its flags as `options`)."""
    from jaxmem.xla.maxbatch import search

    accelerator = resolve_device(options.device)
    if accelerator.is_tpu:
        from jaxmem.runtime.tpu_pool import check_tpu_flags

        check_tpu_flags(options.mem_fraction, options.preallocate, options.allocator, options.steps)
        limit = accelerator.capacity_bytes
    else:
        limit = pool_device(options, accelerator.capacity_bytes).allocator.limit
    found = sharded_mesh(make, arg, lo)
    if found is not None:
        from jaxmem.api.maxbatch_mesh import search_on_mesh

        return search_on_mesh(make, arg, options, lo, hi, donate, busy, accelerator, found, limit)
    started = time.perf_counter()
    with busy(f"guessing {arg} from {lo}, {2 * lo}"):
        guess, guess_seconds, predictions, guess_from = first_guess(make, arg, lo, hi, limit, donate, accelerator)
    counts = {"compiles": 0, "cached": 0}
    trials: list[Trial] = []
    judge = judge_for(make, arg, options, accelerator, donate, counts, trials, busy)
    result = search(judge, limit_bytes=limit, guess=guess, minimum=lo, maximum=hi)
    return MaxbatchResult(arg, result.value, accelerator.name, limit, options.steps, result.total_bytes,
                          result.next_total_bytes, result.at_maximum, trials, counts["compiles"], counts["cached"],
                          guess, guess_from, guess_seconds, predictions, time.perf_counter() - started,
                          accelerator.xla_name, accelerator.is_tpu)


def first_guess(make: Callable[..., Any], arg: str, lo: int, hi: int, limit: int, donate: Any,
                accelerator: Any) -> tuple[int | None, float, int, str]:
    """(guess, seconds, predictions, where from): jaxmem's model of XLA:GPU on a GPU, else (or
    where it cannot say) its planner."""
    guess, seconds, predictions = None, 0.0, 0
    if accelerator.is_gpu:
        guess, seconds, predictions = predicted_guess(make, arg, lo, hi, limit, donate, accelerator.name)
        if guess is not None:
            return guess, seconds, predictions, "predicted_xla"
    guess, more = planner_guess(make, arg, lo, limit, donate)
    return guess, seconds + more, predictions, "planner"


def planner_guess(make: Callable[..., Any], arg: str, lo: int, limit: int, donate: Any) -> tuple[int | None, float]:
    """jaxmem's planner's peak at `lo` and `2 * lo` and where the line through them reaches
    `limit`; (None, seconds) when the planner cannot say."""
    from jaxmem.compiler.planner import plan_jaxpr
    from jaxmem.xla.maxbatch import line_guess

    started = time.perf_counter()
    points = []
    try:
        for value in (lo, 2 * lo):
            program = program_at(make, arg, value, donate)
            points.append((value, plan_jaxpr(program.closed_jaxpr, donated=program.donated).peak_bytes))
    except Exception:  # the guess is only a guess: XLA judges every value anyway
        return None, time.perf_counter() - started
    return line_guess(points, limit, lo), time.perf_counter() - started


def predicted_guess(make: Callable[..., Any], arg: str, lo: int, hi: int, limit: int, donate: Any,
                    device: str) -> tuple[int | None, float, int]:
    """jaxmem's model of XLA:GPU (no compile): a line through the predictions at `lo` and
    `2 * lo`, then one secant step through a prediction at that value."""
    from jaxmem.xla.gpu.model.predict import predict
    from jaxmem.xla.maxbatch import line_guess

    started = time.perf_counter()
    count = [0]

    def total(value: int) -> int:
        program = program_at(make, arg, value, donate)
        count[0] += 1
        return predict(program.closed_jaxpr, donated=program.donated, device=device).total_bytes

    try:
        points = [(lo, total(lo)), (2 * lo, total(2 * lo))]
        guess = line_guess(points, limit, lo)
        if guess is not None and guess > 2 * lo:
            value = min(guess, hi)
            points.append((value, total(value)))
            guess = line_guess(points, limit, lo) or guess
        return (None if guess is None else min(guess, hi)), time.perf_counter() - started, count[0]
    except Exception:  # the guess is only a guess: XLA judges every value anyway
        return None, time.perf_counter() - started, count[0]


def judge_for(make: Callable[..., Any], arg: str, options: Any, accelerator: Any, donate: Any,
              counts: dict[str, int], trials: list[Trial], busy: Callable[[str], Any]) -> Callable[[int], Any]:
    """The judge of one value: XLA's deviceless compile of the program lowered here and the
    runtime's verdict over the steps (the GPU client's pool; the TPU runtime's rules)."""
    from jaxmem.xla.lowered import from_lowered, lowered_reference
    from jaxmem.xla.maxbatch import Judgement

    platform = "tpu" if accelerator.is_tpu else "cuda"
    bracket: dict[str, int] = {}

    def judge(value: int) -> Judgement:
        known = ", ".join(f"{k} {v}" for k, v in (("fits at", bracket.get("lo")), ("not at", bracket.get("hi")))
                          if v is not None)
        label = (f"{accelerator.xla_name} compile {counts['compiles'] + counts['cached'] + 1}: {arg}={value}"
                 + (f" ({known})" if known else ""))
        with busy(label):
            program = program_at(make, arg, value, donate)
            ref = lowered_reference(from_lowered(program.lower_for(platform), platform), accelerator, top=0)
        verdict = _verdict(ref, accelerator, options)
        counts["cached" if ref.cached else "compiles"] += 1
        bracket["lo" if verdict.fits else "hi"] = (max if verdict.fits else min)(value, bracket.get(
            "lo" if verdict.fits else "hi", value))
        trials.append(Trial(value, bool(verdict.fits), ref.total_bytes, ref.cached, _decided_by(ref, verdict)))
        return Judgement(value, verdict.fits, ref.total_bytes, ref.cached)

    return judge


def _verdict(ref: Any, accelerator: Any, options: Any) -> Any:
    """The runtime's verdict on XLA's figures: the TPU runtime's rules (or XLA:TPU's refusal),
    or the GPU client's pool."""
    from jaxmem.runtime.steps import program_from_reference, simulate_steps

    if accelerator.is_tpu:
        from jaxmem.runtime.tpu_pool import compile_refused, simulate_tpu_steps

        if ref.oom:
            return compile_refused(ref, accelerator, options.steps)
        return simulate_tpu_steps(program_from_reference(ref), accelerator.capacity_bytes, options.steps,
                                  code_bytes=ref.generated_code_bytes, reserved_bytes=ref.reserved_bytes)
    return simulate_steps(program_from_reference(ref), pool_device(options, accelerator.capacity_bytes),
                          options.steps)


def _decided_by(ref: Any, verdict: Any) -> str:
    """What decided one trial, in a line: XLA:TPU's refusal, or the runtime's pool over the steps."""
    if getattr(ref, "oom", ""):
        return f"XLA:TPU's compile refused it: {ref.oom[:160]}"
    line = verdict.line() if hasattr(verdict, "line") else ""
    return line or ("the pool holds it" if verdict.fits else "the pool cannot hold it")
