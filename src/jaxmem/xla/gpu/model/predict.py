"""A model of XLA:GPU's memory: its fusion decisions, its buffer assignment, its total.

XLA:GPU compiles a program in passes, and the model follows them, each in a module of its own
that states XLA's rules on jaxmem's program representation (`compiler.program`, through the one
front end `compiler.jaxpr_adapter`) and reuses the planner's schedulers and liveness:

- fusion (`fusion`): which values are never stored, a list of named rules
  (`FUSION_RULES`, `PRODUCER_RULES`; softmax, GEMM, concatenate and cost-model rules in
  `fusion_softmax`, `_gemm`, `_concat`, `_cost`, `_producers`); then the split-K rewrite
  (`splitk`) and bfloat16 stored as float32 where the device computes it so;
- scratch (`scratch`): cuBLAS workspaces, loop bodies modelled as programs; the
  copies cuDNN's convolutions read (`conv`);
- scheduling (`schedule`): the orders XLA's memory scheduler tries, merged dots;
- heap (`heap`): liveness to XLA's heap, with named adjustments, placed as XLA's heap
  simulator places it (`heap_simulator`); the least of the orders is the temp figure.

    >>> import jax, jax.numpy as jnp
    >>> def f(w, idx):   # gathered rows, scaled, exponentiated, summed: one reduction fusion on XLA:GPU
    ...     return jnp.exp(w[idx] * 2.0).sum(axis=1)
    >>> pred = predict(jax.make_jaxpr(f)(jnp.ones((8, 1024)), jnp.arange(256) % 8), device="h100-80gb")
    >>> pred.total_bytes, pred.temp_bytes   # argument + output + temp - alias; w[idx] never stored
    (34816, 0)

`gpu_fusion` is also the planner's fusion base on GPU targets (`plan_jaxpr(base_fusion=...)`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Sequence

from jaxmem.accelerators import ACCELERATORS
from jaxmem.compiler import planner
from jaxmem.compiler.aliasing import donation_aliases
from jaxmem.compiler.fusion import forced_fusion, fusion_of
from jaxmem.compiler.plan_types import Const, MemoryAnalysisTotal
from jaxmem.compiler.program import Program
from jaxmem.compiler.stages import Analysis, Roles, Span
from jaxmem.xla.gpu.model.conv import conv_calls, conv_operand_scratch, conv_plan
from jaxmem.xla.gpu.model.fusion import (FUSION_RULES, PRODUCER_RULES, bf16_gemm_copies, gpu_fusion,
                                         gpu_plan_fusion, gpu_plan_output_epilogues, prediction_fusion,
                                         stored_in_f32)
from jaxmem.xla.gpu.model.fusion_concat import concat_copy_scratch
from jaxmem.xla.gpu.model.fusion_gemm import gemm_output_epilogues
from jaxmem.xla.gpu.model.fusion_producers import updates_read_inside
from jaxmem.xla.gpu.model.fusion_softmax import softmax_outputs, widened_softmax_roots
from jaxmem.xla.gpu.model.heap import assign_temps, best_heap, heap_after_reuse, place
from jaxmem.xla.gpu.model.ops import MOVEMENT, dot_kind, merged_dots, no_inplace, read_by_gemm, strength_reduced
from jaxmem.xla.gpu.model.scratch import float8_fallback_scratch, loop_scratch, op_scratch
from jaxmem.xla.gpu.model.splitk import with_splitk_partials

__all__ = ["CUBLAS_WORKSPACE", "DEVICE_SM", "FUSION_RULES", "MOVEMENT", "PRODUCER_RULES", "Prediction",
           "assign_temps", "dot_kind", "float8_fallback_scratch", "gemm_output_epilogues", "gpu_fusion",
           "gpu_plan_fusion", "gpu_plan_output_epilogues", "heap_after_reuse", "merged_dots", "op_scratch",
           "output_aliases", "plan_on_gpu", "predict", "predict_plan", "prediction_fusion", "read_by_gemm",
           "softmax_outputs", "stored_in_f32", "strength_reduced", "updates_read_inside", "widened_softmax_roots"]

# cuBLAS's workspace (gemm_rewriter.cc: kHopperWorkspace / kDefaultWorkspace), a temporary
# beside each GEMM. Per compute capability major version.
CUBLAS_WORKSPACE = {9: 0, 8: 0, 7: 0}
DEVICE_SM = {a.name: a.compute_capability for a in ACCELERATORS.values() if a.compute_capability}


# -- the prediction ------------------------------------------------------------------------------

@dataclass
class Prediction(MemoryAnalysisTotal):
    """XLA:GPU's figures as the model predicts them (the `memory_analysis()` fields)."""

    device: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    seconds: float
    scheduler: str = ""
    fused_values: int = 0
    arguments: list = None    # per flat leaf, as `XlaGpuReference.arguments` (the pool's input)
    outputs: list = None      # per flat output, as `XlaGpuReference.outputs`

    def summary(self) -> dict[str, Any]:
        """The JSON `predicted_xla` object."""
        return {"device": self.device, "argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
                "temp_bytes": self.temp_bytes, "alias_bytes": self.alias_bytes,
                "total_bytes": self.total_bytes, "seconds": round(self.seconds, 3),
                "scheduler": self.scheduler}


def output_aliases(g: Program, donated: Sequence[bool]) -> dict[int, int]:
    """Output position -> flat argument position whose buffer it takes (`compiler.aliasing`)."""
    return donation_aliases(g, donated).outputs


def predict(closed_jaxpr: Any, *, donated: Sequence[bool] = (), device: str = "h100-80gb",
            store_reread_producers: bool = False) -> Prediction:
    """Predict XLA:GPU's `memory_analysis()` for a ClosedJaxpr on a GPU preset.

    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):   # one SGD step
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> predict(jax.make_jaxpr(step)(jnp.ones((64, 64)), jnp.ones((8, 64))), device="a100-40gb").total_bytes
    36864

    **Arguments:** `closed_jaxpr`; `donated`, one flag per flat input; `device`, a GPU preset;
    `store_reread_producers`: the fusion rule `reread_by_its_readers` on (off by default: see
    `gpu_fusion`).

    **Returns:** a `Prediction` (argument, output, temp, alias bytes; total as XLA's).
    """
    start = time.perf_counter()
    with planner.gc_paused():
        g = planner.inlined(closed_jaxpr)  # shared with the plans of the same jaxpr
        flags = list(donated) + [False] * max(0, len(g.invars) - len(donated))
        aliases = output_aliases(g, flags)
        workspace = CUBLAS_WORKSPACE.get(DEVICE_SM.get(device, 9), 4 * 2 ** 20)
        temp_bytes, best_name, fused_values = _device_temps(closed_jaxpr, g, aliases, workspace, device,
                                                               store_reread_producers)
        argument_bytes = sum(g.nbytes[v] for v in g.invars)
        output_bytes = sum(g.outvar_bytes)
        alias_bytes = sum(g.outvar_bytes[j] for j in aliases)
        shape = lambda v: f"{g.dtypes[v]}{list(g.shapes[v])}"
        arguments = [{"bytes": g.nbytes[v], "donated": bool(flags[k]), "shape": shape(v)}
                     for k, v in enumerate(g.invars)]
        outputs = [{"bytes": g.outvar_bytes[j], "aliases": aliases.get(j),
                    "shape": g.outvar_bytes[j] if isinstance(v, Const) else shape(v)} for j, v in enumerate(g.outvars)]
    return Prediction(device, argument_bytes, output_bytes, temp_bytes, alias_bytes,
                      time.perf_counter() - start, best_name, fused_values, arguments, outputs)


# The temp figures last predicted, by jaxpr identity, output aliases, GEMM workspace, device
# (priority fusion's cost model is the device's: `performance`) and the optional rule, so a jaxpr
# predicted again for the same device is modelled once. The entry holds the jaxpr, so its id
# is not reused while kept.
PREDICTIONS_KEPT = 4
_device_temps_kept: dict[tuple, tuple[Any, tuple[int, str, int]]] = {}


def _device_temps(closed_jaxpr: Any, g: Program, aliases: dict[int, int], workspace: int,
                  device: str, store_reread_producers: bool = False) -> tuple[int, str, int]:
    """(temp bytes, the memory scheduler's order kept, fused values) for `g`, the inlined
    `closed_jaxpr`, with `aliases` (output -> donated argument) and a GEMM `workspace`, on `device`."""
    key = (id(closed_jaxpr), tuple(sorted(aliases.items())), workspace, device, store_reread_producers)
    hit = _device_temps_kept.get(key)
    if hit is not None and hit[0] is closed_jaxpr:
        return hit[1]
    heap, best_name, fused = _temp_heap(g, aliases, workspace, device, None, store_reread_producers)
    result = int(place(heap) or 0), best_name, fused
    _device_temps_kept[key] = (closed_jaxpr, result)
    while len(_device_temps_kept) > PREDICTIONS_KEPT:
        del _device_temps_kept[next(iter(_device_temps_kept))]
    return result


def _temp_heap(g: Program, aliases: dict[int, int], workspace: int, device: str, roles: Roles | None = None,
               store_reread_producers: bool = False) -> tuple[list[Span], str, int]:
    """(the heap's spans, the scheduler kept, fused values) of XLA:GPU's passes on `g`: fusion,
    split-K, scratch, scheduling and heap (see the module's text). `roles`: a loop body's
    (`scratch.loop_scratch`), None for the program itself."""
    # XLA holds every argument and output in its own allocation: none of them is in the temp
    # block, so the liveness below treats them all as external.
    if roles is None:
        roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    fused = prediction_fusion(g, roles, forced_fusion(g, roles), device=device,
                              store_reread_producers=store_reread_producers)
    triton, row_loops = softmax_outputs(g, internal=True, triton_only=True)
    g = strength_reduced(g)
    calls = conv_calls(g, roles, fused)   # a fused convolution's call writes a fresh buffer
    g = no_inplace(g, list(triton) + [g.ops[oi].outputs[0] for oi in calls.values()])
    # Triton split-K: a split GEMM's partial results, stored in its result's place or beside it
    # (the dot merger runs before the split: it groups GEMMs by their unsplit sizes)
    unsplit = g
    g, partials, fused = with_splitk_partials(g, fused, device)
    # after the split, which may store more values (`_stored_readers`): each is sized as stored
    copies = bf16_gemm_copies(g, roles, fused, device)
    g = stored_in_f32(g, roles, fused, device)
    scratch, pieces = _scratch(g, workspace, device, partials, store_reread_producers, calls)
    analysis = Analysis(roles, fusion_of(g, fused), scratch)
    heap, best_name = best_heap(g, unsplit, analysis, fused, row_loops, aliases, pieces, device, copies, calls)
    return heap, best_name, sum(fused)


def _scratch(g: Program, workspace: int, device: str, partials: dict[int, int],
             store_reread_producers: bool, calls: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """(per-op scratch, per-loop largest body value) of `g`: loop bodies modelled as programs,
    the split GEMMs' partials kept beside their results, each op's own temporaries (a
    convolution's: `conv`, at the op its call runs at: `calls`)."""
    def body_heap(b: Program, roles: Roles) -> list[Span]:
        return _temp_heap(b, {}, workspace, device, roles, store_reread_producers)[0]

    nested_fusion = partial(prediction_fusion, device=device, store_reread_producers=store_reread_producers)
    scratch, pieces = loop_scratch(g, body_heap, place, nested_fusion)
    for oi, extra in partials.items():
        scratch[oi] = scratch.get(oi, 0) + extra
    convs = conv_plan(g, device, calls)
    for op in g.ops:
        extra = (op_scratch(g, op, workspace) + float8_fallback_scratch(g, op, device)
                 + concat_copy_scratch(g, op, device))
        for at, n in ((op.index, extra), (calls.get(op.index, op.index), conv_operand_scratch(g, op, convs))):
            if n:
                scratch[at] = scratch.get(at, 0) + n
    return scratch, pieces


# -- jaxmem's own plan on a GPU target -----------------------------------------------------------

def plan_on_gpu(cpu_plan: Any) -> Any:
    """jaxmem's plan for a GPU target: the program planned again with XLA:GPU's fusion rules as
    the fusion base (`gpu_fusion`: gathers, broadcasts, elementwise prologues computed inside
    their consumers), the lower of that and `cpu_plan` kept. Both are checked plans that run on
    the host: a fused value is computed as a transient right before each consumer.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.planner import plan
    >>> def step(w, x):   # one SGD step
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> p = plan_on_gpu(plan(step, jnp.ones((64, 64)), jnp.ones((8, 64)), xla=False))
    >>> p.peak_bytes, p.valid
    (36864, True)

    **Arguments:** `cpu_plan`, the plan `compiler.planner.plan` made (its jaxpr and donation
    are reused: nothing is traced again).

    **Returns:** the plan with the lower peak (its `plan_seconds` counts both).
    """
    donated = [k in set(cpu_plan.donated) for k in range(len(cpu_plan.invars))]
    gpu = planner.plan_jaxpr(cpu_plan.closed_jaxpr, donated=donated, base_fusion=gpu_plan_fusion)
    seconds = cpu_plan.plan_seconds + gpu.plan_seconds
    if _takes_output_epilogues(cpu_plan.closed_jaxpr, donated):
        epi = planner.plan_jaxpr(cpu_plan.closed_jaxpr, donated=donated, base_fusion=gpu_plan_output_epilogues)
        seconds += epi.plan_seconds
        if epi.valid and epi.peak_bytes < gpu.peak_bytes:
            gpu = epi
    if gpu.peak_bytes < cpu_plan.peak_bytes and gpu.valid:
        return replace(gpu, plan_seconds=seconds, trace_seconds=cpu_plan.trace_seconds, xla=cpu_plan.xla,
                       scheduler=gpu.scheduler + "+gpu-fusion")
    return replace(cpu_plan, plan_seconds=seconds)


def _takes_output_epilogues(closed_jaxpr: Any, donated: Sequence[bool]) -> bool:
    """Whether a GEMM of the program has an epilogue chain that `gpu_plan_output_epilogues`
    would write from the GEMM and that ends in a program output (an SGD update of a weight):
    where the second GPU plan can hold less. Other chains (a bias and activation read by the
    next GEMM) are left to the first plan, which computes them inside their readers; making the
    second plan for them too costs planning time for nothing."""
    g = planner.inlined(closed_jaxpr)
    roles = planner.value_roles(g, list(donated) + [False] * max(0, len(g.invars) - len(donated)), (), ())
    base = gpu_plan_fusion(g, roles, forced_fusion(g, roles))
    epi = gemm_output_epilogues(strength_reduced(g), roles, base, None)
    for op in g.ops:
        v = op.outputs[0] if op.primitive == "dot_general" and op.outputs else None
        if v is None or base[v] or not epi[v]:
            continue
        while epi[v] and len(g.users[v]) == 1:   # along the chain the GEMM now writes
            v = g.ops[g.users[v][0]].outputs[0]
        if v is not None and roles.outputs[v]:
            return True
    return False


def predict_plan(plan: Any, device: str) -> Prediction:
    """`predict` for the program a `Plan` was made from (its jaxpr and donation)."""
    donated = [k in set(plan.donated) for k in range(len(plan.invars))]
    return predict(plan.closed_jaxpr, donated=donated, device=device)
