"""Sharded programs: memory per device on a mesh of GPUs (or of this host's CPU devices).

A factory's arguments may carry a `NamedSharding` over a `jax.sharding.AbstractMesh` (or over a
mesh of this host's devices). jaxmem maps that mesh onto as many compile-only GPUs of the target
(`topology="1x1xN"`, deviceless) or onto N host devices
(`--xla_force_host_platform_device_count`), compiles the partitioned program in a subprocess, and
reads XLA's per-device `memory_analysis()`. Next to it, jaxmem plans the per-device program
itself, each value at the per-device shape XLA's sharding propagation gave it and each collective
XLA inserted as a buffer (see `plan_from_hlo`), and lists what is replicated.

    ref = sharded_reference("my_model.py:make_step", device="h100-80gb")
    ref["devices"], ref["xla"]["total_bytes"], ref["peak_bytes"], ref["replicated_bytes"]

Run as a module, it prints one JSON object (the subprocess side):

    JAX_PLATFORMS=cpu python -m jaxmem.xla.sharding my_model.py:make_step --device h100-80gb
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from jaxmem.errors import JaxmemError, PlanError, ShardingError

# A GPU node holds this many GPUs (an HGX/DGX board: 8 GPUs joined by NVLink); a mesh beyond one
# node is compiled as whole nodes of it (`gpu_topology`), as JAX's CUDA plugin lays out hosts.
MAX_GPU_DEVICES = 8
MAX_CPU_DEVICES = 64
REPLICATED_MIN_BYTES = 1 << 20
# The passes whose output jaxmem's per-device plan reads (after sharding propagation and SPMD
# partitioning, Shardy's or GSPMD's).
PARTITIONING_PASSES = "shardy-xla|sharding-propagation|spmd-partitioning"
LAYOUTS = ("dp", "fsdp", "fsdp_tp")
LAYOUT_NAMES = {"dp": "replicated data parallel", "fsdp": "FSDP over data", "fsdp_tp": "FSDP + tensor parallel"}


# -- meshes and layouts ------------------------------------------------------------------------

def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`--mesh 8` or `--mesh 4x2` as axis sizes and names ("data", then "model").

    >>> parse_mesh("4x2")
    ((4, 2), ('data', 'model'))
    """
    try:
        sizes = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ShardingError(f"--mesh takes axis sizes such as 8 or 4x2, got {text!r}") from None
    if not 1 <= len(sizes) <= 2 or any(n < 1 for n in sizes):
        raise ShardingError(f"--mesh takes one or two positive axis sizes such as 8 or 4x2, got {text!r}")
    return sizes, ("data", "model")[: len(sizes)]


def _leaves_with_paths(args: Sequence[Any]) -> list[tuple[str, Any]]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tuple(args))
    return [(f"args{jax.tree_util.keystr(path)}", leaf) for path, leaf in flat]


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def find_mesh(args: Sequence[Any]) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """The (axis sizes, axis names) of the mesh the arguments' `NamedSharding`s are over, or None
    when no argument has one over more than one device.

    Raises:
        ShardingError: arguments sharded over two different meshes.
    """
    found = None
    for path, leaf in _leaves_with_paths(args):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is None or not hasattr(mesh, "axis_names"):
            continue
        sizes = tuple(int(n) for n in mesh.axis_sizes)
        if math.prod(sizes) <= 1:
            continue
        here = (sizes, tuple(str(a) for a in mesh.axis_names))
        if found is not None and here != found:
            raise ShardingError(f"{path} is sharded over mesh {dict(zip(here[1], here[0]))}, "
                                f"other arguments over {dict(zip(found[1], found[0]))}: use one mesh")
        found = here
    return found


def _spec_of(leaf: Any) -> tuple[Any, ...]:
    spec = getattr(getattr(leaf, "sharding", None), "spec", None)
    return tuple(spec) if spec is not None else ()


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def local_shape(shape: Sequence[int], spec: Sequence[Any], sizes: dict[str, int]) -> tuple[int, ...]:
    """The per-device shape of an array of `shape` sharded as `spec` over axes of `sizes`.

    >>> local_shape((16, 6), ("data", None), {"data": 8})
    (2, 6)
    """
    out = list(shape)
    for dim, entry in enumerate(spec[: len(out)]):
        out[dim] //= math.prod(sizes[a] for a in _axes(entry))
    return tuple(out)


def check_shardings(args: Sequence[Any], sizes: dict[str, int]) -> None:
    """Raise a one-line `ShardingError` for a sharding that names an axis the mesh lacks or does
    not divide its array's shape."""
    for path, leaf in _leaves_with_paths(args):
        if not _is_array(leaf):
            continue
        spec = _spec_of(leaf)
        if len(spec) > len(leaf.shape):
            raise ShardingError(f"{path}: sharding {spec} has more entries than the shape {tuple(leaf.shape)} has dims")
        for dim, entry in enumerate(spec):
            for axis in _axes(entry):
                if axis not in sizes:
                    raise ShardingError(f"{path}: mesh axis {axis!r} is not in the mesh ({', '.join(sizes)})")
            parts = math.prod(sizes[a] for a in _axes(entry))
            if leaf.shape[dim] % parts:
                raise ShardingError(f"{path}: dim {dim} of shape {tuple(leaf.shape)} is {leaf.shape[dim]}, "
                                    f"not divisible by {parts} (mesh axes {'x'.join(_axes(entry))})")


def _largest_divisible_dim(shape: Sequence[int], parts: int, skip: int | None = None) -> int | None:
    dims = [d for d in range(len(shape)) if d != skip and shape[d] % parts == 0 and shape[d] >= parts]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


def layout_specs(args: Sequence[Any], layout: str, sizes: dict[str, int]) -> list[tuple[Any, ...]]:
    """Per flat leaf, the PartitionSpec entries of a standard layout. The last positional argument
    is the batch (`step(params, opt_state, batch)`): sharded on its leading dim over "data". The
    other arguments are the state: replicated ("dp"); each leaf sharded over "data" on its largest
    divisible dim ("fsdp"); and further over "model" on its next largest ("fsdp_tp").

    >>> import jax.numpy as jnp
    >>> layout_specs(({"w": jnp.zeros((8, 4))}, jnp.zeros((16, 8))), "fsdp", {"data": 8})
    [('data', None), ('data', None)]
    """
    import jax

    if layout not in LAYOUTS:
        raise ShardingError(f"unknown layout {layout!r}; jaxmem knows {', '.join(LAYOUTS)}")
    if layout == "fsdp_tp" and "model" not in sizes:
        raise ShardingError("the fsdp_tp layout needs a two-axis mesh such as --mesh 4x2")
    out: list[tuple[Any, ...]] = []
    n_state = sum(len(jax.tree.leaves(a)) for a in args[:-1])
    for i, leaf in enumerate(jax.tree.leaves(tuple(args))):
        spec: list[Any] = [None] * len(getattr(leaf, "shape", ()))
        if i >= n_state:
            data = sizes.get("data", 1)
            if spec and leaf.shape[0] % data == 0:
                spec[0] = "data"
        elif layout != "dp" and spec:
            d = _largest_divisible_dim(leaf.shape, sizes["data"])
            if d is not None:
                spec[d] = "data"
            if layout == "fsdp_tp":
                m = _largest_divisible_dim(leaf.shape, sizes["model"], skip=d)
                if m is not None:
                    spec[m] = "model"
        out.append(tuple(spec))
    return out


def with_specs(args: Sequence[Any], specs: Sequence[tuple[Any, ...]], mesh: Any) -> tuple[Any, ...]:
    """The arguments as `ShapeDtypeStruct`s with `NamedSharding(mesh, spec)`, one spec per leaf."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    flat, tree = jax.tree.flatten(tuple(args))
    out = []
    for leaf, spec in zip(flat, specs):
        if _is_array(leaf):
            leaf = jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))
        out.append(leaf)
    return tuple(jax.tree.unflatten(tree, out))


# -- what is replicated --------------------------------------------------------------------------

def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    import types

    from jaxmem.compiler.jaxpr_adapter import aval_bytes

    return aval_bytes(types.SimpleNamespace(shape=tuple(shape), dtype=dtype))


def replicated(args: Sequence[Any], sizes: dict[str, int], min_bytes: int = REPLICATED_MIN_BYTES) -> list[dict[str, Any]]:
    """Arguments holding more than `min_bytes` per device that are replicated over a mesh axis
    of size > 1: `{path, bytes, axis, saved_bytes}`, `saved_bytes` being what sharding the leaf
    over that axis too would save per device (0 when no dim divides). Largest first.

    >>> import jax.numpy as jnp
    >>> replicated((jnp.zeros((1024, 1024)),), {"data": 8})
    [{'path': 'args[0]', 'bytes': 4194304, 'axis': 'data', 'saved_bytes': 3670016}]
    """
    rows = []
    for path, leaf in _leaves_with_paths(args):
        if not _is_array(leaf):
            continue
        spec = _spec_of(leaf)
        shape = local_shape(leaf.shape, spec, sizes)
        size = _nbytes(shape, leaf.dtype)
        if size <= min_bytes:
            continue
        used = {a for entry in spec for a in _axes(entry)}
        for axis, n in sizes.items():
            if n > 1 and axis not in used:
                divisible = any(d % n == 0 for d in shape)
                rows.append({"path": path, "bytes": size, "axis": axis,
                             "saved_bytes": size - size // n if divisible else 0})
    rows.sort(key=lambda r: (-r["bytes"], r["path"], r["axis"]))
    return rows


# -- jaxmem's own per-device program ---------------------------------------------------------------

def per_device_jaxpr(fn: Callable[..., Any], args: Sequence[Any], out_specs: Sequence[tuple[Any, ...]] | None,
                     sizes: dict[str, int]) -> tuple[Any, str]:
    """jaxmem's own model of the per-device program, as a ClosedJaxpr with per-device shapes, and
    the method used. For a function that is one `shard_map`, and where XLA's partitioning dumps
    are missing (otherwise `plan_from_hlo` reads the per-device program off XLA's partitioning):

    - "shard_map": the function is one `shard_map`; its body is the per-device program.
    - "shard-local": the function traced on each device's shards (`jax.make_jaxpr` with the mesh
      axes bound). The last positional argument (the batch) stays local; every other sharded
      argument (FSDP-sharded state) is all-gathered (`all_gather` buffers, as XLA's SPMD
      partitioner inserts them), and each output XLA shards (`out_specs`) is reduce-scattered
      from the full value (`psum_scatter` inputs). Replicated outputs computed from local data
      (data-parallel gradients) are all-reduced in XLA; their buffers have the same shape and
      are not modeled separately.

    Raises:
        ShardingError: the function names a mesh axis the mesh lacks.
        PlanError: the function cannot be traced per device.
    """
    import jax

    from jaxmem.compiler import jaxpr_adapter as ja

    leaves, tree = jax.tree.flatten(tuple(args))
    try:
        closed = ja.make_closed_jaxpr(fn, *args)
    except Exception as err:
        raise _trace_error(err, sizes) from None
    body = ja.single_shard_map_body(closed)
    if body is not None:
        return body, "shard_map"
    n_batch = len(jax.tree.leaves(args[-1])) if args else 0
    specs = [_spec_of(leaf) for leaf in leaves]
    local = [jax.ShapeDtypeStruct(local_shape(leaf.shape, spec, sizes), leaf.dtype) if _is_array(leaf) else leaf
             for leaf, spec in zip(leaves, specs)]

    def per_device(*shards: Any) -> list[Any]:
        full = []
        for i, (x, spec) in enumerate(zip(shards, specs)):
            if i < len(shards) - n_batch:
                for dim, entry in enumerate(spec):
                    for axis in reversed(_axes(entry)):
                        x = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
            full.append(x)
        outs = jax.tree.leaves(fn(*jax.tree.unflatten(tree, full)))
        result = []
        for j, y in enumerate(outs):
            spec = out_specs[j] if out_specs is not None and j < len(out_specs) else ()
            for dim, entry in enumerate(spec):
                for axis in _axes(entry):
                    y = jax.lax.psum_scatter(y, axis, scatter_dimension=dim, tiled=True)
            result.append(y)
        return result

    from unittest import mock

    # Shapes here are already per device: a sharding constraint has nothing left to constrain
    # (and would re-split a local shape), so it is the identity while tracing.
    try:
        with mock.patch.object(jax.lax, "with_sharding_constraint", lambda x, shardings: x):
            return ja.make_closed_jaxpr(per_device, *local, axis_env=list(sizes.items())), "shard-local"
    except Exception as err:
        raise _trace_error(err, sizes, per_device=True) from None


def _unknown_axis(err: BaseException, sizes: dict[str, int]) -> str | None:
    """The mesh axis name a failed trace used that the mesh lacks, or None. JAX's collectives
    raise a bare AssertionError for an unbound axis name, so the name is read from the
    `axis_name`/`axes` locals of the frames the error passed through."""
    import re

    text = " ".join(str(err).split())
    m = re.search(r"unbound axis name:? '?(\w+)'?", text) or re.search(r"[Rr]esource axis:? '?(\w+)'?", text)
    if m and m.group(1) not in sizes:
        return m.group(1)
    chain: BaseException | None = err
    while chain is not None:
        tb = chain.__traceback__
        while tb is not None:
            value = tb.tb_frame.f_locals.get("axis_name")
            names = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
            for name in names:
                if isinstance(name, str) and name not in sizes:
                    return name
            tb = tb.tb_next
        chain = chain.__cause__ or chain.__context__
    return None


def _trace_error(err: BaseException, sizes: dict[str, int] | None = None, per_device: bool = False) -> JaxmemError:
    """One line for a function that failed to trace or lower on the mesh."""
    if isinstance(err, JaxmemError):
        return err
    if sizes is not None:
        axis = _unknown_axis(err, sizes)
        if axis is not None:
            return ShardingError(f"the function uses mesh axis {axis!r}, which the mesh "
                                 f"({', '.join(f'{k}={v}' for k, v in sizes.items())}) does not have")
    text = " ".join(str(err).split())
    what = "trace the function per device" if per_device else "trace the function"
    return PlanError(f"cannot {what}: {type(err).__name__}: {text[:300]}")


def plan_per_device(fn: Callable[..., Any], args: Sequence[Any], out_specs: Sequence[tuple[Any, ...]] | None,
                    sizes: dict[str, int], donate_argnums: Sequence[int] = ()) -> dict[str, Any]:
    """jaxmem's checked plan of the per-device program: `{peak_bytes, lower_bound_bytes, valid,
    method, plan_seconds, top}` (`top`: the largest buffers live at the plan's peak)."""
    import jax

    from jaxmem.compiler.planner import plan_jaxpr

    started = time.perf_counter()
    closed, method = per_device_jaxpr(fn, args, out_specs, sizes)
    donated: list[bool] = []
    if method == "shard-local":
        for position, arg in enumerate(args):
            donated += [position in set(donate_argnums)] * len(jax.tree.leaves(arg))
    plan = plan_jaxpr(closed, donated=donated)
    return {"peak_bytes": int(plan.peak_bytes), "lower_bound_bytes": int(plan.lower_bound_bytes),
            "valid": bool(plan.valid), "method": method, "plan_seconds": time.perf_counter() - started,
            "top": _plan_top(plan, 10)}


def _plan_top(plan: Any, top: int) -> list[dict[str, Any]]:
    """The largest buffers live at the plan's peak step: bytes, shape, kind, label, source line
    (the all-gather results and reduce-scatter inputs among them)."""
    from jaxmem.compiler.stages import live_profile

    profile = live_profile(((b.start, b.end, b.size) for b in plan.buffers), len(plan.schedule))
    peak_step = int(profile.argmax()) - 1  # the first position at the peak (index p+1)
    live = sorted((b for b in plan.buffers if b.start <= peak_step <= b.end), key=lambda b: -b.size)
    return [{"size_bytes": int(b.size), "shape": list(b.shape), "dtype": str(b.dtype), "kind": str(b.kind),
             "label": str(b.label), "source": str(b.source) if b.source is not None else ""} for b in live[:top]]


# -- XLA's own shardings: jaxmem's per-device program from the partitioned HLO ----------------------

# Each equation of the flat program is bound under this name scope, so every HLO instruction it
# lowers to carries `jaxmem_eqn<i>/` in its op_name, through sharding propagation and the SPMD
# partitioner (which name the collectives they insert after the instruction they serve).
SCOPE = "jaxmem_eqn"
_TAG_RE = re.compile(SCOPE + r"(\d+)/")
_LINE_RE = re.compile(r"^\s*(?:ROOT )?%(\S+) = ([a-z]\w*)\[([\d,]*)\]\S* ([\w-]+)\(%?([^,)\s]*)")
# HLO collective -> the JAX primitive jaxmem plans its buffer as.
COLLECTIVES = {"all-gather": "all_gather", "all-reduce": "psum", "reduce-scatter": "reduce_scatter",
               "all-to-all": "all_to_all", "collective-permute": "ppermute"}
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
              "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def tagged_program(flat: Any) -> Callable[..., list[Any]]:
    """A function of the flat arguments that runs a flat ClosedJaxpr (`inline_calls`) with
    equation i bound under `jax.named_scope("jaxmem_eqn<i>")`: the same program for XLA (names
    are metadata), with every HLO instruction traceable to its equation."""
    from jaxmem.compiler import jaxpr_adapter as ja

    run = ja.run_with_scopes(flat, SCOPE)
    run.__name__ = "jaxmem_per_device"
    return run


def _hlo_sharding(line: str) -> str | None:
    """The text inside `sharding={...}` on an HLO line (braces balanced), or None."""
    at = line.find("sharding={")
    if at < 0:
        return None
    start, depth = at + len("sharding="), 0
    for k in range(start, len(line)):
        depth += {"{": 1, "}": -1}.get(line[k], 0)
        if depth == 0:
            return line[start + 1:k]
    return None


def tiles(sharding: str | None, rank: int) -> tuple[int, ...] | None:
    """How many ways each of `rank` dims is split under an HLO sharding; None when it says
    nothing usable (a tuple, manual).

    >>> tiles("devices=[4,1,2]<=[8]", 3), tiles("devices=[2,1,4]<=[8] last_tile_dim_replicate", 2)
    ((4, 1, 2), (2, 1))
    >>> tiles("replicated", 2), tiles("{replicated}, {manual}", 1)
    ((1, 1), None)
    """
    if sharding is None or sharding.startswith("{") or "manual" in sharding:
        return None
    if sharding.startswith(("replicated", "maximal")):
        return (1,) * rank
    m = re.search(r"devices=\[([\d,]+)\]", sharding)
    if m is None:
        return None
    counts = [int(t) for t in m.group(1).split(",")][:rank]
    return tuple(counts + [1] * (rank - len(counts)))


def _entry_lines(text: str) -> list[str]:
    """The lines of an HLO module's ENTRY computation."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            lines.append(line)
    return lines


def hlo_shardings(text: str) -> dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Per equation tag, in program order, `(dims, tiles)` of each ENTRY instruction it lowered
    to that has a usable sharding, from a module after sharding propagation."""
    out: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for line in _entry_lines(text):
        m, tag = _LINE_RE.match(line), _TAG_RE.search(line)
        if m is None or tag is None:
            continue
        dims = tuple(int(d) for d in m.group(3).split(",") if d)
        split = tiles(_hlo_sharding(line), len(dims))
        if split is not None:
            out.setdefault(int(tag.group(1)), []).append((dims, split))
    return out


def hlo_collectives(text: str) -> dict[int, list[tuple[str, int]]]:
    """Per equation tag, the collectives the SPMD partitioner inserted for it, as `(primitive,
    bytes)` in a partitioned module: the buffer each needs, the result of an all-gather, the
    (larger) operand of a reduce-scatter."""
    sizes: dict[str, int] = {}
    out: dict[int, list[tuple[str, int]]] = {}
    for line in _entry_lines(text):
        m = _LINE_RE.match(line)
        if m is None:
            continue
        name, dtype, dims, opcode, first = m.groups()
        nbytes = math.prod(int(d) for d in dims.split(",") if d) * _HLO_BYTES.get(dtype, 4)
        sizes[name] = nbytes
        tag = _TAG_RE.search(line)
        if opcode in COLLECTIVES and tag is not None:
            if opcode == "reduce-scatter":
                nbytes = max(nbytes, sizes.get(first, 0))
            out.setdefault(int(tag.group(1)), []).append((COLLECTIVES[opcode], nbytes))
    return out


def _split_shape(dims: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """`dims` with `parts` divided out, from the first dim on (a shape of the per-device size
    when only the number of parts is known).

    >>> _split_shape((16, 128, 1), 8), _split_shape((6, 4), 4)
    ((2, 128, 1), (3, 2))
    """
    out = []
    for d in dims:
        g = math.gcd(d, parts)
        out.append(d // g)
        parts //= g
    return tuple(out)


def per_device_shapes(flat: Any, local_inputs: Sequence[tuple[int, ...]],
                      found: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> tuple[dict[Any, tuple[int, ...]], int]:
    """Each value of a flat program at its per-device shape: inputs as given; an equation's
    output split as XLA's propagation sharded the last instruction of that equation with the
    output's shape (or, XLA having simplified it, its number of elements). A value XLA folded
    away takes the split of an operand, else of a consumer's output, of as many elements
    (elementwise ops, reshapes, broadcasts folded into their users); one with neither stays
    whole. Returns the shapes and how many outputs stayed whole.
    """
    from jaxmem.compiler import jaxpr_adapter as ja

    invars, eqns, full = ja.flat_structure(flat)
    shapes: dict[Any, tuple[int, ...]] = dict(zip(invars, (tuple(s) for s in local_inputs)))
    parts: dict[Any, int] = {v: max(1, math.prod(full[v]) // max(1, math.prod(s)))
                             for v, s in zip(invars, shapes.values())}
    pending: list[tuple[int, Any]] = []
    for i, (_, outputs) in enumerate(eqns):
        rows = found.get(i, [])
        for var in outputs:
            dims = full[var]
            split = next((t for d, t in reversed(rows) if d == dims), None)
            if split is not None:
                shapes[var] = tuple(-(-d // n) for d, n in zip(dims, split))
                parts[var] = math.prod(split)
                continue
            size = math.prod(dims)
            split = next((t for d, t in reversed(rows) if math.prod(d) == size and size > 1), None)
            if split is not None:
                parts[var] = math.prod(split)
            else:
                pending.append((i, var))
    readers: dict[Any, list[int]] = {}
    for i, (operands, _) in enumerate(eqns):
        for a in operands:
            readers.setdefault(a, []).append(i)
    changed = True
    while changed and pending:
        changed, left = False, []
        for i, var in pending:
            size = math.prod(full[var])
            near = [a for a in eqns[i][0] if a in parts and math.prod(full[a]) == size]
            near += [o for r in readers.get(var, ()) for o in eqns[r][1]
                     if o in parts and math.prod(full[o]) == size]
            if near and size > 1:
                parts[var] = max(parts[a] for a in near)
                changed = True
            else:
                left.append((i, var))
        pending = left
    for _, outputs in eqns:
        for var in outputs:
            if var not in shapes:
                shapes[var] = _split_shape(full[var], parts.get(var, 1))
    return shapes, sum(1 for _, var in pending if full[var])


def plan_from_hlo(flat: Any, local_inputs: Sequence[tuple[int, ...]], propagated: str, partitioned: str,
                  donated: Sequence[bool]) -> dict[str, Any]:
    """jaxmem's checked plan of the per-device program read off XLA's partitioning: every value
    at the per-device shape XLA's sharding propagation gave it, and each collective the SPMD
    partitioner inserted as a buffer read by the equation it serves (all-gathered weights,
    reduce-scatter inputs, all-reduced partial sums)."""
    from jaxmem.compiler import jaxpr_adapter as ja
    from jaxmem.compiler.planner import plan_jaxpr

    started = time.perf_counter()
    shapes, unmatched = per_device_shapes(flat, local_inputs, hlo_shardings(propagated))
    collectives = hlo_collectives(partitioned)
    plan = plan_jaxpr(ja.with_avals(flat, shapes, collectives), donated=list(donated))
    return {"peak_bytes": int(plan.peak_bytes), "lower_bound_bytes": int(plan.lower_bound_bytes),
            "valid": bool(plan.valid), "method": "xla-shardings", "plan_seconds": time.perf_counter() - started,
            "unsharded_values": unmatched, "collectives": sum(len(v) for v in collectives.values()),
            "top": _plan_top(plan, 10)}


def partitioning_dumps(dump_dir: str | None) -> tuple[str, str] | None:
    """(HLO after sharding propagation, HLO after SPMD partitioning) of jaxmem's tagged program
    in an XLA dump directory, or None when either is missing."""
    if not dump_dir or not os.path.isdir(dump_dir):
        return None
    names = sorted(n for n in os.listdir(dump_dir) if "jaxmem_per_device" in n)
    propagated = [n for n in names if "after_shardy-xla." in n or "after_sharding-propagation." in n]
    partitioned = ([n for n in names if "after_spmd-partitioning." in n]
                   or [n for n in names if n.endswith("after_spmd_partitioner.txt")])
    if not propagated or not partitioned:
        return None
    texts = []
    for name in (propagated[-1], partitioned[-1]):
        with open(os.path.join(dump_dir, name), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts[0], texts[1]


# -- the child side: compile on N devices --------------------------------------------------------

def _compile_mesh(sizes: tuple[int, ...], names: tuple[str, ...], xla: str, device: str,
                  topology: str | None = None) -> tuple[Any, str]:
    """The mesh to compile on (compile-only GPUs of `device`, compile-only chips of a TPU
    topology, or host devices) and the target's description (XLA's GpuTargetConfig text with the
    preset's memory, the TPU topology, or "cpu")."""
    import jax

    n = math.prod(sizes)
    if xla == "tpu":
        return _tpu_mesh(sizes, names, device, topology)
    if xla == "gpu":
        from jax.experimental import topologies

        from jaxmem.xla.gpu.compile import GpuUnavailable, cuda_topology, spec_for, target_config, with_memory
        from jaxmem.units import PRESETS

        if n > MAX_GPU_DEVICES and n % MAX_GPU_DEVICES:
            raise ShardingError(f"the mesh has {n} devices; beyond one node of {MAX_GPU_DEVICES} GPUs, a mesh of "
                                f"{device} is whole nodes of {MAX_GPU_DEVICES}")
        spec = spec_for(device)
        if spec is None:
            raise ShardingError(f"{device} is not a GPU preset")
        text = with_memory(target_config(spec), PRESETS[device]) if device in PRESETS else target_config(spec)
        try:
            topo, text = cuda_topology(text, gpu_topology(n))
        except Exception as err:
            raise GpuUnavailable(f"the CUDA plugin could not make {n} compile-only {device}: "
                                 f"{type(err).__name__}: {' '.join(str(err).split())[:200]}") from None
        return topologies.make_mesh(topo, sizes, names), text
    devices = jax.devices("cpu")
    if n > len(devices):
        raise ShardingError(f"the mesh has {n} devices and this process {len(devices)} host devices")
    from jax.sharding import AxisType

    # jax.make_mesh's axes are Explicit by default; the factory's program is written for Auto
    # axes (XLA's sharding propagation), as the GPU topology's mesh has them.
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes), devices=devices[:n]), "cpu"


def gpu_topology(devices: int) -> str:
    """The CUDA plugin's compile-only topology for `devices` GPUs: one node of up to 8, else
    nodes of 8 (hosts x 1 x GPUs per host), as a multi-node job lays them out.

    >>> gpu_topology(4), gpu_topology(64)
    ('1x1x4', '8x1x8')
    """
    if devices <= MAX_GPU_DEVICES:
        return f"1x1x{devices}"
    return f"{devices // MAX_GPU_DEVICES}x1x{MAX_GPU_DEVICES}"


def tpu_topology_for(device: str, chips: int) -> str:
    """The smallest standard slice of `device`'s chip that holds `chips` chips: `v5e:2x4` for 8
    v5e chips, `v5p:2x2x2` for 8 v5p chips.

    >>> tpu_topology_for("tpu-v5e-16gb", 8), tpu_topology_for("tpu-v5p-95gb", 8), tpu_topology_for("tpu-v6e-32gb", 1)
    ('v5e:2x4', 'v5p:2x2x2', 'v6e:1x1')
    """
    from jaxmem.accelerators import resolve
    from jaxmem.xla.tpu.compile import parse_topology

    chip, dims = parse_topology(resolve(device).topology or "")
    shape = [1] * len(dims)
    axis = 0
    while math.prod(shape) < chips:
        shape[axis] *= 2   # slices grow by doubling one axis at a time, the shortest first
        axis = min(range(len(shape)), key=lambda i: (shape[i], i))
    if len(shape) == 2:
        shape.sort()
    return f"{chip}:{'x'.join(str(d) for d in shape)}"


def _tpu_mesh(sizes: tuple[int, ...], names: tuple[str, ...], device: str, topology: str | None) -> tuple[Any, str]:
    """A mesh of `sizes` over the compile-only chips of a TPU topology (`topology`, else the
    smallest slice of the preset's chip that holds it)."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from jaxmem.accelerators import resolve
    from jaxmem.xla.tpu.compile import parse_topology, topology_devices

    n = math.prod(sizes)
    acc = resolve(device)
    topology = topology or tpu_topology_for(acc.name, n)
    chip, _ = parse_topology(topology)
    if chip != acc.tpu_version:
        raise ShardingError(f"topology {topology} is of {chip} chips, and {acc.name} is a {acc.tpu_version}")
    devices = topology_devices(topology)
    if n > len(devices):
        raise ShardingError(f"the mesh has {n} devices and topology {topology} {len(devices)}")
    mesh = Mesh(np.array(devices[:n]).reshape(sizes), names, axis_types=(AxisType.Auto,) * len(sizes))
    return mesh, f"tpu {topology} {acc.capacity_bytes}"


def compile_sharded(fn: Callable[..., Any], args: Sequence[Any], *, xla: str, device: str,
                    donate_argnums: Sequence[int] = (), top: int = 10, dump_dir: str | None = None,
                    mesh_text: str | None = None, layout: str | None = None, use_cache: bool = True,
                    topology: str | None = None) -> dict[str, Any]:
    """Compile `fn(*args)` partitioned over the arguments' mesh and plan its per-device program;
    the JSON object the child prints (see `sharded_reference`)."""
    import jax

    target: dict[str, str] = {}

    def compile_mesh(sizes_t: tuple[int, ...], names_t: tuple[str, ...]) -> Any:
        mesh, target["text"] = _compile_mesh(sizes_t, names_t, xla, device, topology)
        return mesh

    traced = trace_sharded(fn, args, compile_mesh, donate_argnums=donate_argnums, mesh_text=mesh_text, layout=layout)
    sizes, target_text = traced.sizes, target["text"]
    flat = jax.tree.leaves(traced.structs)
    started = time.perf_counter()
    try:
        lowered = lower_traced(traced)
        key = sharded_cache_key(lowered.as_text(debug_info=True), f"{device} {layout}\n{target_text}", sizes, top)
        if use_cache:
            hit = sharded_cache_read(key)
            if hit is not None:
                return hit
        compiled = _compile_partitioned(lowered, xla, dump_dir)
    except JaxmemError:
        raise
    except Exception as err:
        raise _compile_error(err, xla, device, sizes) from None
    per = _per_device_figures(compiled.memory_analysis(), xla, device, target_text, time.perf_counter() - started)
    out_specs = [tuple(getattr(s, "spec", ()) or ()) for s in jax.tree.leaves(
        compiled.output_shardings, is_leaf=lambda x: hasattr(x, "spec"))]
    from jaxmem.xla.gpu.compile import _kept_arguments, output_aliases

    kept = _kept_arguments(lowered, len(flat))
    aliases = {o: kept[p] for o, p in output_aliases(compiled.as_text() or "").items() if p < len(kept)}
    peak, live = peak_from_dump(dump_dir, xla, top)
    data = finish_sharded(traced, xla=xla, per=per, outs=jax.tree.leaves(lowered.out_info), out_specs=out_specs,
                          aliases=aliases, peak=peak, live=live, dumps=partitioning_dumps(dump_dir), key=key)
    if use_cache:
        from jaxmem.xla.gpu.compile import cache_dir, cache_write

        cache_write(cache_dir(), key, data)
    return data


@dataclass
class Traced:
    """A sharded program as jaxmem traced it: the user's function and its arguments as
    `ShapeDtypeStruct`s with their `NamedSharding`s (`structs`), its ClosedJaxpr and the flat
    copy whose equations are tagged (`flat_closed`), per flat input whether it is donated, the
    donated positions, the mesh's axis sizes and the layout it was laid out under."""

    fn: Callable[..., Any]
    structs: tuple[Any, ...]
    closed: Any
    flat_closed: Any
    donated: list[bool]
    donate_argnums: tuple[int, ...]
    sizes: dict[str, int]
    layout: str | None
    mesh: Any


def in_mesh(mesh: Any, sizes: dict[str, int], step: Callable[[], Any]) -> Any:
    """`step()` (a trace or a lowering of the user's function); where it fails, again with
    `mesh` set as JAX's context mesh. A function that names its own `AbstractMesh`
    (`shard_map(mesh=...)`) traces without one; one that relies on the context (`shard_map`
    without a mesh, constraints with bare `PartitionSpec`s) needs it."""
    import jax

    try:
        return step()
    except JaxmemError:
        raise
    except Exception as first:
        try:
            with jax.set_mesh(mesh):
                return step()
        except Exception:
            raise _trace_error(first, sizes) from None


def trace_sharded(fn: Callable[..., Any], args: Sequence[Any], mesh_for: Callable[[tuple[int, ...], tuple[str, ...]], Any],
                  *, donate_argnums: Sequence[int] = (), mesh_text: str | None = None,
                  layout: str | None = None) -> Traced:
    """`fn(*args)` traced with each argument on `mesh_for(axis sizes, axis names)` (the compile
    mesh of a device, or an `AbstractMesh`) under its own `PartitionSpec` (laid out under
    `layout` on `mesh_text`'s mesh where both are given), and its flat, tagged copy.

    Raises:
        ShardingError: a sharding names an axis the mesh lacks or does not divide its array.
        JaxmemError: the function cannot be traced (one line).
    """
    import jax

    from jaxmem.compiler import jaxpr_adapter as ja

    args, (sizes_t, names_t) = _laid_out_mesh(args, mesh_text, layout)
    sizes = dict(zip(names_t, sizes_t))
    check_shardings(args, sizes)
    mesh = mesh_for(sizes_t, names_t)
    structs = with_specs(args, [_spec_of(leaf) for leaf in jax.tree.leaves(tuple(args))], mesh)
    donated: list[bool] = []
    for position, arg in enumerate(structs):
        donated += [position in set(donate_argnums)] * len(jax.tree.leaves(arg))
    # jaxmem compiles its flat copy of the program with each equation under a name scope (the
    # same HLO but for metadata), so XLA's shardings and collectives can be read per equation.
    closed = in_mesh(mesh, sizes, lambda: ja.make_closed_jaxpr(fn, *structs))
    return Traced(fn, structs, closed, ja.inline_calls(closed), donated, tuple(donate_argnums), sizes, layout, mesh)


def lower_traced(traced: Traced, platform: str | None = None) -> Any:
    """The tagged copy of `traced` lowered by `jax.jit` with its donation, for `platform`
    ("cuda", "tpu", "cpu"; default: the mesh's devices')."""
    import jax

    jitted = jax.jit(tagged_program(traced.flat_closed),
                     donate_argnums=tuple(i for i, d in enumerate(traced.donated) if d))
    flat = jax.tree.leaves(traced.structs)
    options = {"lowering_platforms": (platform,)} if platform else {}
    return in_mesh(traced.mesh, traced.sizes, lambda: jitted.trace(*flat).lower(**options))


def finish_sharded(traced: Traced, *, xla: str, per: dict[str, Any], outs: Sequence[Any],
                   out_specs: Sequence[tuple[Any, ...]], aliases: dict[int, int], peak: list[dict[str, Any]],
                   live: int, dumps: tuple[str, str] | None, key: str) -> dict[str, Any]:
    """The sharded reference from XLA's per-device compile of `traced` (its figures `per`, the
    output leaves and their specs, XLA's output aliases, the buffers at its peak as the dumps
    name them, its partitioning dumps): per-device argument and output bytes, jaxmem's
    per-device plan (read off XLA's partitioning, else traced per device, else absent with the
    reason) and what is replicated. Both the TARGET's child and `jaxmem.analyze` end here."""
    import jax

    from jaxmem.compiler import jaxpr_adapter as ja

    sizes = traced.sizes
    flat = jax.tree.leaves(traced.structs)
    arguments, outputs = _argument_and_output_leaves(flat, traced.donated, outs, out_specs, aliases, sizes)
    peak = _named_peak(peak, traced.flat_closed, getattr(traced.fn, "__name__", "fn"))
    plan = None
    if ja.single_shard_map_body(traced.closed) is None and dumps is not None:
        try:
            plan = plan_from_hlo(traced.flat_closed, [local_shape(leaf.shape, _spec_of(leaf), sizes) for leaf in flat],
                                 dumps[0], dumps[1], traced.donated)
        except PlanError:
            # XLA's propagation left a value whose per-device shape jaxmem cannot read off (on
            # XLA:TPU, a reshape it folded away): the per-device trace below plans it instead.
            plan = None
    if plan is None:
        plan = _plan_or_note(lambda: plan_per_device(traced.fn, traced.structs, out_specs, sizes,
                                                     traced.donate_argnums))
    rows = replicated(traced.structs, sizes)
    return {
        "key": key, "cached": False,
        "devices": math.prod(sizes.values()), "mesh": sizes, "layout": traced.layout, "xla_kind": xla,
        "xla": per, "arguments": arguments, "outputs": outputs, "peak_buffers": peak, "peak_live_bytes": live,
        "peak_bytes": plan["peak_bytes"], "plan": plan,
        "replicated_bytes": sum(r["bytes"] for r in {r["path"]: r for r in rows}.values()),
        "replicated": rows,
        "in_specs": [[_entry_text(e) for e in _spec_of(leaf)] for leaf in flat],
    }


def _plan_or_note(make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """jaxmem's per-device plan, or, where the function cannot be traced per device, no plan and
    the reason: XLA's per-device figures and the pool verdict stand without it."""
    try:
        return make()
    except PlanError as err:
        return {"peak_bytes": None, "lower_bound_bytes": None, "valid": True, "method": "none",
                "plan_seconds": 0.0, "top": [], "note": str(err)}


def _laid_out_mesh(args: Sequence[Any], mesh_text: str | None,
                   layout: str | None) -> tuple[Sequence[Any], tuple[tuple[int, ...], tuple[str, ...]]]:
    """The arguments (laid out under `layout` on `mesh_text`'s mesh, where both are given) and
    the mesh they are sharded over: the arguments' own, else `mesh_text`'s."""
    from jax.sharding import AbstractMesh

    if mesh_text:
        sizes_t, names_t = parse_mesh(mesh_text)
        if layout:
            mesh = AbstractMesh(sizes_t, names_t)
            args = with_specs(args, layout_specs(args, layout, dict(zip(names_t, sizes_t))), mesh)
        return args, find_mesh(args) or (sizes_t, names_t)
    found = find_mesh(args)
    if found is None:
        raise ShardingError("no argument carries a NamedSharding over more than one device; give --mesh")
    return args, found


def _compile_partitioned(lowered: Any, xla: str, dump_dir: str | None) -> Any:
    """XLA's compile of the lowered per-device program."""
    # libtpu reads no XLA_FLAGS: XLA:TPU's dumps are asked for in the compile's options.
    options = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True,
               "xla_dump_hlo_pass_re": PARTITIONING_PASSES} if xla == "tpu" and dump_dir else None
    return lowered.compile(compiler_options=options) if options else lowered.compile()


def _compile_error(err: BaseException, xla: str, device: str, sizes: dict[str, int]) -> JaxmemError:
    """A failed lowering or compile as one error: XLA:TPU's out-of-memory refusal as such."""
    message = " ".join(str(err).split())
    if xla == "tpu" and "RESOURCE_EXHAUSTED" in message:
        return ShardingError(f"XLA:TPU: the per-chip program does not fit {device}: "
                             f"{message[message.index('RESOURCE_EXHAUSTED'):][:300]}")
    return _trace_error(err, sizes)


def _per_device_figures(stats: Any, xla: str, device: str, target_text: str, seconds: float) -> dict[str, Any]:
    """XLA's `memory_analysis()` of the per-device program, as the JSON's `xla` object."""
    per = {"target": device if xla in ("gpu", "tpu") else "cpu", "argument_bytes": int(stats.argument_size_in_bytes),
           "output_bytes": int(stats.output_size_in_bytes), "temp_bytes": int(stats.temp_size_in_bytes),
           "alias_bytes": int(stats.alias_size_in_bytes), "compile_seconds": round(seconds, 3)}
    if xla == "tpu":
        per["generated_code_bytes"] = int(stats.generated_code_size_in_bytes)
        per["topology"] = target_text.split()[1]
    per["total_bytes"] = per["argument_bytes"] + per["output_bytes"] + per["temp_bytes"] - per["alias_bytes"]
    return per


def _argument_and_output_leaves(flat: Sequence[Any], donated: Sequence[bool], outs: Sequence[Any],
                                out_specs: Sequence[tuple[Any, ...]], aliases: dict[int, int],
                                sizes: dict[str, int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-device bytes of each argument and output leaf (the pool's view of a step), outputs
    with the argument XLA aliases them to (`aliases`: output -> flat argument)."""

    def leaf_bytes(leaf: Any, spec: Sequence[Any]) -> int:
        return _nbytes(local_shape(leaf.shape, spec, sizes), leaf.dtype)

    arguments = [{"bytes": leaf_bytes(leaf, _spec_of(leaf)), "donated": donated[i] if i < len(donated) else False,
                  "shape": f"{leaf.dtype}{list(local_shape(leaf.shape, _spec_of(leaf), sizes))}"}
                 for i, leaf in enumerate(flat)]
    outputs = []
    for j, leaf in enumerate(outs):
        spec = out_specs[j] if j < len(out_specs) else ()
        outputs.append({"bytes": leaf_bytes(leaf, spec), "aliases": aliases.get(j),
                        "shape": f"{leaf.dtype}{list(local_shape(leaf.shape, spec, sizes))}"})
    return arguments, outputs


def peak_from_dump(dump_dir: str | None, xla: str, top: int) -> tuple[list[dict[str, Any]], int]:
    """The buffers XLA:GPU or XLA:TPU holds at its peak, from its dumps (none for XLA:CPU), and
    the bytes live there; op names as XLA wrote them (`_named_peak` names them for the user)."""
    from jaxmem.xla.gpu.compile import peak_buffers_from_dump

    if dump_dir and xla == "gpu":
        return peak_buffers_from_dump(dump_dir, top)
    if dump_dir and xla == "tpu":
        return peak_buffers_from_dump(dump_dir, top, live_range="after_optimizations-live-range.txt")
    return [], 0


def _named_peak(peak: list[dict[str, Any]], flat_closed: Any, fn_name: str) -> list[dict[str, Any]]:
    """The peak buffers with each op named by the user's function and name stack in place of
    jaxmem's per-equation scope."""
    from jaxmem.compiler import jaxpr_adapter as ja

    eqns = ja.jaxpr_eqns(flat_closed)
    names = [f"{ja.eqn_name_stack(e) or ''}" for e in eqns]
    own = f"jit({fn_name})"
    for row in peak:
        op = row.get("op_name", "")
        tag = _TAG_RE.search(op)
        text = _TAG_RE.sub(lambda m: (names[int(m.group(1))] + "/") if int(m.group(1)) < len(names)
                           and names[int(m.group(1))] else "", op)
        row["op_name"] = text.replace("jit(jaxmem_per_device)", own)
        if tag is not None and int(tag.group(1)) < len(eqns):
            # XLA's metadata names the frame that bound jaxmem's tagged copy; the user's line is
            # the equation's own.
            line = ja.source_line(eqns[int(tag.group(1))])
            row["source"] = str(line) if line is not None else ""
    return peak


# The per-device plan is cached with XLA's figures: a new model of it is a new version.
SHARDED_CACHE_VERSION = 2


def sharded_cache_key(lowered_text: str, target_text: str, mesh: dict[str, int], top: int) -> str:
    """The cache key of a sharded compile, with `xla.gpu.compile`'s discipline: the lowered program (its
    shardings, donation and jaxmem's per-equation names in it), the target (with the mesh), JAX's
    versions and XLA_FLAGS (less the dump and host-device flags jaxmem sets itself).

    >>> sharded_cache_key("m", "cpu", {"data": 8}, 10) != sharded_cache_key("m", "cpu", {"data": 4, "model": 2}, 10)
    True
    """
    import jax
    import jaxlib

    from jaxmem.xla.gpu.compile import cache_key

    from jaxmem.xla import compilers

    versions = (f"jax {jax.__version__} jaxlib {getattr(jaxlib, '__version__', '')} sharded v{SHARDED_CACHE_VERSION} "
                f"{compilers.versions('gpu')} {compilers.versions('tpu')}")
    flags = " ".join(t for t in os.environ.get("XLA_FLAGS", "").split()
                     if not t.startswith(("--xla_dump", "--xla_force_host_platform_device_count=")))
    target = f"{target_text}\nmesh {sorted(mesh.items())} top {int(top)}"
    return cache_key(lowered_text, target, versions, flags)


def sharded_cache_read(key: str) -> dict[str, Any] | None:
    """A cached sharded result for `key` (marked `cached`), or None when absent, unreadable or
    not a whole result (a corrupt entry is ignored and compiled again)."""
    from jaxmem.xla.gpu.compile import cache_dir

    try:
        with open(os.path.join(cache_dir(), f"{key}.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    xla, plan = data.get("xla"), data.get("plan")
    numbers = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes")
    if not isinstance(xla, dict) or not all(isinstance(xla.get(k), int) and not isinstance(xla.get(k), bool)
                                            for k in numbers):
        return None
    if not isinstance(plan, dict) or not isinstance(data.get("peak_bytes"), int) or not all(
            k in data for k in ("devices", "mesh", "arguments", "outputs", "replicated", "replicated_bytes")):
        return None
    data["cached"] = True
    return data


def _entry_text(entry: Any) -> Any:
    axes = _axes(entry)
    return None if not axes else axes[0] if len(axes) == 1 else list(axes)


# -- the parent side -------------------------------------------------------------------------------

def child_env(xla: str, devices: int, dump_dir: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: CPU JAX's only platform, N host devices (a factory may build a
    mesh of this host's devices; XLA reads the flag once per process), XLA dumps in `dump_dir`.

    >>> child_env("gpu", 8, "/d", {"XLA_FLAGS": ""})["XLA_FLAGS"].split()[:2]
    ['--xla_force_host_platform_device_count=8', '--xla_dump_to=/d']
    """
    env = dict(os.environ if base is None else base)
    env["JAX_PLATFORMS"] = "cpu"
    # JAX's filtered tracebacks drop the frames that name an unknown mesh axis (see _unknown_axis).
    env["JAX_TRACEBACK_FILTERING"] = "off"
    flags = [t for t in env.get("XLA_FLAGS", "").split()
             if not t.startswith(("--xla_dump_to=", "--xla_dump_hlo_pass_re=", "--xla_force_host_platform_device_count="))]
    flags.append(f"--xla_force_host_platform_device_count={int(devices)}")
    # The module after sharding propagation (Shardy's or GSPMD's pass) for jaxmem's per-device
    # plan; the GPU compile's buffer dumps for what XLA holds at its peak.
    flags.append(f"--xla_dump_to={dump_dir}")
    flags.append(f"--xla_dump_hlo_pass_re={PARTITIONING_PASSES}")
    env["XLA_FLAGS"] = " ".join(flags)
    if xla == "tpu":
        from jaxmem.xla.tpu.compile import DEVICELESS_ENV

        for name, value in DEVICELESS_ENV.items():
            env.setdefault(name, value)
    if xla in ("gpu", "tpu"):
        from jaxmem.xla import compilers

        return compilers.child_env(env)
    return env


def check_available(xla: str) -> None:
    """The compiler of `xla` ("gpu", "tpu"; "cpu" always is), installed where jaxmem's
    children find it, or one line saying how to install it (`GpuUnavailable`)."""
    from jaxmem.xla.gpu.compile import GpuUnavailable, unavailable_reason

    if xla == "gpu":
        reason = unavailable_reason()
        if reason:
            raise GpuUnavailable(reason)
    if xla == "tpu":
        from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

        reason = tpu_reason()
        if reason:
            raise GpuUnavailable(f"XLA:TPU is not available here: {reason}")


def sharded_reference(target: str, *, device: str = "h100-80gb", xla: str = "gpu", mesh: str | None = None,
                      layout: str | None = None, donate_argnums: Sequence[int] = (), top: int = 10,
                      timeout: float = 1800.0, use_cache: bool = True, topology: str | None = None) -> dict[str, Any]:
    """Per-device figures of a sharded TARGET, from a fresh Python: XLA's (`xla`: "gpu" for a
    deviceless compile for the GPU preset `device`, "tpu" for the chips of a TPU topology,
    `topology` or the smallest slice holding the mesh, "cpu" for host devices), jaxmem's
    per-device plan, and what is replicated.

    >>> ref = sharded_reference("jaxmem.examples.sharded:dp_step", device="h100-80gb")  # doctest: +SKIP
    >>> ref["devices"], ref["xla"]["total_bytes"] >= ref["peak_bytes"]  # doctest: +SKIP
    (8, True)

    Args:
        target: a TARGET whose arguments carry `NamedSharding`s, or any training step with
            `mesh` and `layout` given.
        mesh: axis sizes such as "8" or "4x2" (axes "data", "model"), for `layout`.
        layout: "dp", "fsdp" or "fsdp_tp" (see `layout_specs`); None keeps the factory's shardings.
        use_cache: read and write the cache of `xla.gpu.compile.cache_dir` (keyed as `sharded_cache_key`);
            a hit is marked `cached` and skips XLA's compile and jaxmem's plan.

    Raises:
        GpuUnavailable: the CUDA plugin is not available here.
        ShardingError, PlanError: one line from the child.
    """
    from jaxmem.xla.gpu.compile import child_answer

    check_available(xla)
    devices = max(MAX_GPU_DEVICES, math.prod(parse_mesh(mesh)[0]) if mesh else 0)
    if devices > MAX_CPU_DEVICES:
        raise ShardingError(f"--mesh {mesh}: at most {MAX_CPU_DEVICES} devices")
    cmd = [sys.executable, "-m", "jaxmem.xla.sharding", target, "--device", device, "--xla", xla,
           "--top", str(int(top))]
    if mesh:
        cmd += ["--mesh", mesh]
    if layout:
        cmd += ["--layout", layout]
    if topology:
        cmd += ["--topology", topology]
    if donate_argnums:
        cmd += ["--donate", ",".join(str(int(i)) for i in donate_argnums)]
    if not use_cache:
        cmd.append("--no-cache")
    dump_dir = tempfile.mkdtemp(prefix="jaxmem-sharded-")
    try:
        try:
            proc = subprocess.run(cmd, env=child_env(xla, devices, dump_dir), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PlanError(f"the sharded compile of {target!r} took more than {timeout:.0f} s") from None
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    return child_answer(proc.returncode, proc.stdout, proc.stderr)


def main(argv: list[str] | None = None) -> int:
    """The subprocess side: print a sharded TARGET's per-device figures as one JSON object. Exit
    3 when the CUDA plugin is unavailable, 4 for a sharding error, 2 for any other user error."""
    from jaxmem.xla.start import quiet_jax_start
    from jaxmem.xla.cpu.compile import _parse_donate
    from jaxmem.xla.gpu.compile import child_reply, dump_dir_from_flags, load_with_kwargs

    parser = argparse.ArgumentParser(prog="python -m jaxmem.xla.sharding")
    parser.add_argument("target")
    parser.add_argument("--device", default="h100-80gb")
    parser.add_argument("--xla", choices=("gpu", "tpu", "cpu"), default="gpu")
    parser.add_argument("--topology", default=None)
    parser.add_argument("--mesh", default=None)
    parser.add_argument("--layout", default=None)
    parser.add_argument("--donate", default="")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    dump_dir = dump_dir_from_flags()

    def compile() -> dict[str, Any]:
        quiet_jax_start()
        fn, fn_args = load_with_kwargs(args.target, {})
        return compile_sharded(fn, fn_args, xla=args.xla, device=args.device, donate_argnums=_parse_donate(args.donate),
                               top=args.top, dump_dir=dump_dir, mesh_text=args.mesh, layout=args.layout,
                               use_cache=not args.no_cache, topology=args.topology)

    return child_reply(compile)


if __name__ == "__main__":
    sys.exit(main())
