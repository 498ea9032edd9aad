"""Which outputs take a donated argument's buffer: JAX's pairing, read from the program.

`jax.jit(..., donate_argnums=...)` pairs, when it lowers, each output in order with the first
donated argument still unpaired that has the same shape and dtype (`_set_up_aliases` in
jax/_src/interpreters/mlir.py, `tf.aliasing_output` in the module); a donated argument left
unpaired is a buffer donor XLA may give any output (`jax.buffer_donor`). Arguments the
program never reads are dropped from the module first (jit's `kept_var_idx`), so they are never
paired. The GPU model, the lower bound and the reports all read this one analysis; XLA's own
choice, read back from a compiled module, is `xla.gpu.compile.output_aliases`.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.jaxpr_adapter import inline
    >>> f = lambda w, x, unused: (w * 2, x.astype(jnp.float16))
    >>> g = inline(jax.make_jaxpr(f)(jnp.ones(4), jnp.ones(4), jnp.ones(4)))
    >>> donation_aliases(g, [True, True, True])   # x: no float32[4] output left, but 4 elements
    DonationAliases(outputs={0: 0}, donors=frozenset({1}))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from jaxmem.compiler.plan_types import Const
from jaxmem.compiler.program import Program


@dataclass(frozen=True)
class DonationAliases:
    """`outputs`: output position -> flat argument position whose buffer it is written into;
    `donors`: donated arguments no output is paired with that JAX still hands to XLA."""

    outputs: dict[int, int]
    donors: frozenset[int]


def donation_aliases(g: Program, donated: Sequence[bool], *, constant_outputs: bool = False) -> DonationAliases:
    """JAX's pairing of `g`'s outputs with its donated flat arguments (`donated`, one flag per
    argument; missing: not donated). `constant_outputs=False` leaves outputs that are constants
    unpaired, as the GPU model counts them (XLA:GPU emits them as its own constant buffers)."""
    returned = {v for v in g.outvars if not isinstance(v, Const)}
    free: dict[tuple, list[int]] = {}
    for k, v in enumerate(g.invars):
        if k < len(donated) and donated[k] and (g.users[v] or v in returned):
            free.setdefault((g.shapes[v], g.dtypes[v]), []).append(k)
    outputs: dict[int, int] = {}
    for j, v in enumerate(g.outvars):
        if isinstance(v, Const) and not constant_outputs:
            continue
        key = (tuple(v.aval.shape), str(v.aval.dtype)) if isinstance(v, Const) else (g.shapes[v], g.dtypes[v])
        slot = free.get(key)
        if slot:
            outputs[j] = slot.pop(0)
    left: dict[int, list[int]] = {}
    for j, v in enumerate(g.outvars):
        if j not in outputs:
            shape = tuple(v.aval.shape) if isinstance(v, Const) else g.shapes[v]
            left.setdefault(math.prod(shape), []).append(j)
    paired = set(outputs.values())
    donors = []
    for k in sorted(k for slots in free.values() for k in slots if k not in paired):
        matches = left.get(math.prod(g.shapes[g.invars[k]]))
        if matches:
            matches.pop(0)
            donors.append(k)
    return DonationAliases(outputs, frozenset(donors))
