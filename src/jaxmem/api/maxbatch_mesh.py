"""`jaxmem.maxbatch` of a factory whose arguments are sharded over a mesh (a concrete `Mesh` or an
`AbstractMesh`): the largest global value of the argument whose per-device program fits every
device, judged by XLA's per-device compile for the mesh's topology (compile-only GPUs or TPU
chips, deviceless, in a child) and the runtime's verdict per device over the steps.

The value moves in steps of what the mesh needs: where the searched argument sizes a dimension
sharded over mesh axes (a batch over `data`), only multiples of those axes' product lay out
evenly, so the search runs over `k` with the value `multiple * k` (`batch_multiple`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from jaxmem.errors import PlanError, ShardingError


def factory_at(make: Callable[..., Any], arg: str, value: int) -> tuple[Any, Any]:
    """`make(arg=value)`'s `(fn, args)`, its arguments abstract where `make` can run so."""
    from jaxmem.compiler.target import call_user, check_fn_args
    from jaxmem.xla.gpu.compile import abstract_fn_args

    what = f"make({arg}={value})"
    concrete = lambda: check_fn_args(call_user(lambda: make(**{arg: value}), f"{what} raised "), what)  # noqa: E731
    return abstract_fn_args(lambda: make(**{arg: value}), what, concrete)


def mesh_of(make: Callable[..., Any], arg: str, value: int) -> tuple[dict[str, int], list[Any]] | None:
    """The mesh `make(arg=value)`'s arguments are sharded over (axis name -> size) and each
    argument leaf's sharding, from a real call of `make` (an abstract one drops the shardings);
    None where no argument is sharded over more than one device."""
    import jax

    from jaxmem.compiler.target import call_user, check_fn_args
    from jaxmem.xla.sharding import find_mesh

    what = f"make({arg}={value})"
    _, args = check_fn_args(call_user(lambda: make(**{arg: value}), f"{what} raised "), what)
    found = find_mesh(args)
    if found is None:
        return None
    return dict(zip(found[1], found[0])), [getattr(leaf, "sharding", None) for leaf in jax.tree.leaves(args)]


def on_mesh_at(make: Callable[..., Any], arg: str, value: int, shardings: list[Any]) -> tuple[Any, Any]:
    """`make(arg=value)`'s `(fn, args)`, abstract where `make` can run so, each argument leaf
    with the sharding it had in `mesh_of`'s call (a sharding does not change with the value)."""
    import jax

    fn, args = factory_at(make, arg, value)
    leaves, tree = jax.tree.flatten(args)
    if len(leaves) != len(shardings):
        raise PlanError(f"make({arg}={value}) returns {len(leaves)} argument arrays where it returned "
                        f"{len(shardings)}: maxbatch on a mesh needs the same arguments at every value")
    placed = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding or getattr(leaf, "sharding", None))
              if hasattr(leaf, "shape") else leaf for leaf, sharding in zip(leaves, shardings)]
    return fn, jax.tree.unflatten(tree, placed)


def batch_multiple(make: Callable[..., Any], arg: str, sizes: dict[str, int], shardings: list[Any]) -> int:
    """The step of the value that keeps every sharded dimension it sizes divisible: the
    arguments at two values (the mesh's device count and twice it) show which dimensions grow
    with the value, and the mesh axes each is sharded over; the least common multiple of what
    each needs. 1 where nothing the value sizes is sharded.

    Raises:
        PlanError: `make` fails at the mesh's device count or twice it.
    """
    import jax

    from jaxmem.xla.sharding import _axes, _spec_of

    first = math.prod(sizes.values())
    _, small = on_mesh_at(make, arg, first, shardings)
    _, large = on_mesh_at(make, arg, 2 * first, shardings)
    multiple = 1
    for a, b in zip(jax.tree.leaves(small), jax.tree.leaves(large)):
        spec = tuple(_spec_of(a)) + (None,) * len(getattr(a, "shape", ()))
        for dim, (da, db) in enumerate(zip(getattr(a, "shape", ()), getattr(b, "shape", ()))):
            if da == db:
                continue
            parts = math.prod(sizes.get(axis, 1) for axis in _axes(spec[dim]))
            per_value = da // first if da % first == 0 else 1   # elements of this dim per unit of the value
            multiple = math.lcm(multiple, parts // math.gcd(parts, per_value))
    return multiple


def search_on_mesh(make: Callable[..., Any], arg: str, options: Any, lo: int, hi: int, donate: Any,
                   busy: Callable[[str], Any], accelerator: Any, found: tuple[dict[str, int], list[Any]],
                   limit: int) -> Any:
    """The search of `api.maxbatch.search_largest` over a mesh: values in steps of
    `batch_multiple`, each judged per device by `judge_on_mesh`; `limit`, a device's (the
    pool's on a GPU), is what the search aims XLA's per-device totals at."""
    from jaxmem.api.maxbatch_result import MaxbatchResult, Trial
    from jaxmem.xla.maxbatch import search

    sizes, shardings = found
    started = time.perf_counter()
    with busy(f"finding the step of {arg} the mesh {_mesh_text(sizes)} needs"):
        multiple = batch_multiple(make, arg, sizes, shardings)
    counts = {"compiles": 0, "cached": 0}
    trials: list[Trial] = []
    judge = judge_on_mesh(make, arg, options, accelerator, donate, found, multiple, counts, trials, busy)
    low, high = -(-lo // multiple), max(1, hi // multiple)
    if high < low:
        raise PlanError(f"no multiple of {multiple} (what the mesh {_mesh_text(sizes)} needs of {arg}) "
                        f"lies in {lo}..{hi}")
    try:
        result = search(judge, limit_bytes=limit, guess=None, minimum=low, maximum=high)
    except PlanError as err:
        if not str(err).startswith("even "):
            raise
        first = trials[0] if trials else None
        raise PlanError(f"even {arg}={low * multiple} (the least in steps of {multiple}, what the mesh "
                        f"{_mesh_text(sizes)} needs) does not fit: XLA's total per device there is "
                        f"{first.total_bytes if first else '?'} bytes; `jaxmem fit` says what to change") from None
    return MaxbatchResult(arg, result.value * multiple, accelerator.name, limit, options.steps, result.total_bytes,
                          result.next_total_bytes, result.at_maximum, trials, counts["compiles"], counts["cached"],
                          None, "none", 0.0, 0, time.perf_counter() - started, accelerator.xla_name,
                          accelerator.is_tpu, multiple=multiple, devices=math.prod(sizes.values()), mesh=sizes)


def judge_on_mesh(make: Callable[..., Any], arg: str, options: Any, accelerator: Any, donate: Any,
                  found: tuple[dict[str, int], list[Any]], multiple: int, counts: dict[str, int], trials: list[Any],
                  busy: Callable[[str], Any]) -> Callable[[int], Any]:
    """The judge of `k` (the value `multiple * k`): XLA's per-device compile of the program traced
    over an `AbstractMesh` of the arguments' axes, and the runtime's verdict per device (the TPU
    runtime's per chip, the GPU client's pool per GPU). A per-chip program XLA:TPU refuses does
    not fit, its size the bytes XLA:TPU's message asks for."""
    from jaxmem.api.maxbatch_result import Trial
    from jaxmem.xla.maxbatch import Judgement

    sizes, shardings = found
    bracket: dict[str, int] = {}

    def judge(k: int) -> Judgement:
        value = multiple * k
        known = ", ".join(f"{name} {v}" for name, v in (("fits at", bracket.get("lo")), ("not at", bracket.get("hi")))
                          if v is not None)
        label = (f"{accelerator.xla_name} per-device compile {counts['compiles'] + counts['cached'] + 1} on "
                 f"{math.prod(sizes.values())} devices: {arg}={value}" + (f" ({known})" if known else ""))
        with busy(label):
            fits, total, cached, why = _judged(on_mesh_at(make, arg, value, shardings), options, accelerator, donate)
        counts["cached" if cached else "compiles"] += 1
        key = "lo" if fits else "hi"
        bracket[key] = (max if fits else min)(value, bracket.get(key, value))
        trials.append(Trial(value, fits, total, cached, why))
        return Judgement(k, fits, total, cached)

    return judge


def _judged(fn_args: tuple[Any, Any], options: Any, accelerator: Any, donate: Any) -> tuple[bool, int, bool, str]:
    """(fits, XLA's per-device total, from the cache, what decided it) for a factory's sharded
    `(fn, args)`."""
    from jaxmem.api.program import prepare
    from jaxmem.api.sharded import _dynamic_call, _pool, reference_of_traced, refuse_framework_on_mesh, trace_on_mesh
    from jaxmem.xla.tpu.compile import required_bytes

    fn, args = fn_args
    call, dynamic = _dynamic_call(fn, tuple(args), {})
    program = prepare(fn, args, None, donate)
    refuse_framework_on_mesh(program)
    traced = trace_on_mesh(call, dynamic, donate_argnums=program.donated_positions)
    kind = "tpu" if accelerator.is_tpu else "gpu"
    try:
        ref = reference_of_traced(traced, xla=kind, device=accelerator.name, top=0)
    except ShardingError as err:
        if "does not fit" not in str(err):
            raise
        needed = required_bytes(str(err)) or 2 * accelerator.capacity_bytes
        return False, needed, bool(getattr(err, "cached", False)), f"XLA:TPU's per-chip compile refused it: {str(err)[:160]}"
    pool, note = _pool(ref, options, accelerator.capacity_bytes)
    if pool is None:
        raise PlanError(note or "the pool per device could not be simulated")
    line = pool.line() if hasattr(pool, "line") else ""
    return bool(pool.fits), int(ref["xla"]["total_bytes"]), bool(ref.get("cached")), f"per device: {line}"


def _mesh_text(sizes: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in sizes.items())
