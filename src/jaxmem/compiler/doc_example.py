"""The small program the compiler's docstring examples share: `sin(x) * 2` over f32[4].

    >>> program, roles, order = sin_program()
    >>> program.num_values, order   # values 0 (x), 1 (sin x), 2 (the output); x is external
    (3, [0, 1])
"""

from __future__ import annotations

from typing import Any

from jaxmem.compiler.fusion import choose_fusion, forced_fusion, fusion_of
from jaxmem.compiler.program import Program
from jaxmem.compiler.schedule import program_order
from jaxmem.compiler.stages import Analysis, Roles


def sin_program() -> tuple[Program, Roles, list[int]]:
    """`sin(x) * 2` over f32[4] as a `Program`, its roles (x external, the product the output)
    and its program order."""
    import jax.numpy as jnp

    from jaxmem.compiler.jaxpr_adapter import inline, make_closed_jaxpr

    program = inline(make_closed_jaxpr(lambda x: jnp.sin(x) * 2, jnp.ones(4)))
    n = program.num_values
    roles = Roles([v in program.invars for v in range(n)], [v in program.outvars for v in range(n)], [False] * n, {})
    return program, roles, program_order(program)


def sin_analysis() -> tuple[Program, list[int], Any]:
    """`sin_program()` with the fusion `choose_fusion` makes of it: the program, its program
    order and its `Analysis`."""
    program, roles, order = sin_program()
    fused = choose_fusion(program, order, roles, forced_fusion(program, roles))
    return program, order, Analysis(roles, fusion_of(program, fused), {})
