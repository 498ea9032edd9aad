"""Sort a plan's values into report categories from the program's structure.

The seven categories, in stacking order: parameters, optimizer_state, inputs, residuals,
gradients, temporaries, outputs. They are derived, not declared, so any traced function gets them:

1. The backward part. JAX's autodiff builds the backward pass by transposing the linearized
   forward pass, and every equation it emits carries `transpose(...)` in its name stack
   (`eqn.source_info.name_stack`, e.g. `transpose(jvp(loss))`). Steps whose name stack says
   so are backward steps, and so is `add_any`, which JAX emits only to sum cotangents; a
   step between two backward steps in the data flow is one too (see `backward_steps`). The
   others are forward or update steps. A program without any (an inference function, or a
   hand-written backward) has no backward part, and then it has no residuals and no
   gradients: everything it makes is a temporary or an output.
2. Arguments, from what the function does with them. Optimizer state: an argument that does
   not flow into the backward part (the differentiated function never reads it) but meets a
   gradient in some update step (Adam's moments and step count, momentum buffers); a pytree
   path that names optimizer state (`opt_state`, `mu`, `nu`, `momentum`, ...), when the caller
   gives paths, marks one too. Parameters: an argument whose updated value the function
   returns (a result of its shape and dtype computed from it outside the backward part). In a
   program with a backward part, any other argument is only read: an input (the batch, the
   labels, a random key). A program without one cannot tell its weights from its batch by data
   flow, so its read-only arguments stay parameters. `argument_reasons` says which rule decided
   each. Closed-over constants count as parameters (weights the function closed over).
3. Residuals: values made outside the backward part and read by it (what the forward pass
   saves for the backward pass). A value the fusion model keeps out of memory is computed by
   its readers from its own inputs, so reading it counts as reading those inputs.
4. Gradients: values made by the backward part and read outside it, or returned (the final
   cotangents of the parameters). Cotangents read only inside the backward part are
   temporaries.
5. Outputs: the function's other results. Everything else is a temporary; so are loop scratch
   buffers.

    cats = value_categories(plan)          # {value id: "residuals", ...}

Each pass is linear in the number of operands, so a 100,000-step plan is categorised at once.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from jaxmem.compiler.plan_types import Plan, Step, ValueId

CATEGORIES: tuple[str, ...] = (
    "parameters", "optimizer_state", "inputs", "residuals", "gradients", "temporaries", "outputs",
)

# Pytree keys that optimizer libraries (optax, flax.optim, hand-written Adam) use for state.
_OPTIMIZER_PATH = re.compile(
    r"opt_?state|optimi[sz]er|(^|[^a-z])(mu|nu|momentum|moments?|velocity|exp_avg(_sq)?|adam|count|step_count)([^a-z]|$)",
    re.IGNORECASE,
)


def is_backward(step: Step) -> bool:
    """True when JAX's transpose (the backward pass of autodiff) emitted this step.

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> [(s.primitive, is_backward(s)) for s in plan.schedule[2:5]]   # the backward part starts at 3
    [('sub', False), ('broadcast_in_dim', True), ('mul', True)]
    """
    if step.primitive == "add_any":
        return True  # JAX emits add_any only to sum cotangents, whatever the name stack says
    from jaxmem.compiler.jaxpr_adapter import eqn_name_stack   # imports JAX: not at module level (replay has none)

    name_stack = eqn_name_stack(step.eqn)
    return name_stack is not None and "transpose(" in name_stack


_READ_FORWARD, _READ_BACKWARD, _RETURNED = 1, 2, 4


def backward_steps(plan: Plan) -> set[int]:
    """Indices of the steps of the backward part.

    The name stack marks most of them, but a few transpose rules emit equations without it
    (the scatter-add that transposes a gather, for one). So the marked set is closed over the
    data flow: a step that reads something the backward part made and feeds something the
    backward part reads lies inside the backward part too. The update steps after it (an
    optimizer's) read gradients but feed no backward step, so they stay out.

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> sorted(backward_steps(plan))
    [3, 4, 5, 6, 7, 8]
    """
    marked = {s.index for s in plan.schedule if is_backward(s)}
    if not marked:
        return marked
    derived: set[ValueId] = set()
    for step in plan.schedule:
        if step.index in marked or any(v in derived for v in step.inputs):
            derived.update(v for v in step.outputs if v is not None)
    needed: set[ValueId] = set()
    closed = set(marked)
    for step in reversed(plan.schedule):
        feeds = step.index in marked or any(v in needed for v in step.outputs if v is not None)
        if not feeds:
            continue
        needed.update(step.inputs)
        if step.index not in marked and any(v in derived for v in step.inputs):
            closed.add(step.index)
    return closed


def _reads(plan: Plan, backward: set[int]) -> dict[ValueId, int]:
    """Who really reads each value, as bit flags: a step outside the backward part, one inside
    it, the caller (a top-level output). A fused step keeps its outputs out of memory and its
    consumers compute it from its inputs, so reading a fused value reads that step's inputs:
    the flags flow back through fused steps (one reverse sweep)."""
    flags: dict[ValueId, int] = {v: _RETURNED for v in plan.outvars if v is not None}
    values = plan.values
    for step in reversed(plan.schedule):
        outs = [v for v in step.outputs if v is not None]
        transient = bool(outs) and all(values[v].buffer is None for v in outs if v in values)
        if transient:
            mine = 0
            for v in outs:
                mine |= flags.get(v, 0)
        else:
            mine = _READ_BACKWARD if step.index in backward else _READ_FORWARD
        if not mine:
            continue
        for v in step.inputs:
            flags[v] = flags.get(v, 0) | mine
    return flags


def _ancestors(plan: Plan, seeds: Sequence[Step]) -> set[ValueId]:
    """Values from which some input of a seed step is computed (a reverse sweep; the schedule
    is in dependence order, so one pass suffices)."""
    marked: set[ValueId] = set()
    seed_ids = {s.index for s in seeds}
    for step in reversed(plan.schedule):
        if step.index in seed_ids or any(v in marked for v in step.outputs if v is not None):
            marked.update(step.inputs)
    return marked


def _arguments_reaching(plan: Plan, backward: set[int]) -> dict[ValueId, int]:
    """For each value, a bit mask of the top-level arguments it is computed from outside the
    backward part (bit i: `plan.invars[i]`); one forward sweep over the schedule."""
    masks: dict[ValueId, int] = {v: 1 << i for i, v in enumerate(plan.invars)}
    for step in plan.schedule:
        if step.index in backward:
            continue
        mask = 0
        for v in step.inputs:
            mask |= masks.get(v, 0)
        if mask:
            for v in step.outputs:
                if v is not None:
                    masks[v] = masks.get(v, 0) | mask
    return masks


def _returned_updated(plan: Plan, backward: set[int]) -> set[ValueId]:
    """Arguments whose updated value the function returns: some result of the same shape and
    dtype is computed from the argument outside the backward part (`p - lr * g`, `m * b + g`, a
    cache written with `dynamic_update_slice`)."""
    masks = _arguments_reaching(plan, backward)
    values, found = plan.values, set()
    for out in plan.outvars:
        if out is None or out not in values:
            continue
        mask, shape, dtype = masks.get(out, 0), values[out].shape, values[out].dtype
        for i, v in enumerate(plan.invars):
            if mask >> i & 1 and v in values and values[v].shape == shape and values[v].dtype == dtype:
                found.add(v)
    return found


def argument_roles(plan: Plan, backward: set[int], gradients: set[ValueId],
                   arg_paths: Sequence[str] | None = None) -> dict[ValueId, tuple[str, str]]:
    """The category of each top-level argument and the rule that decided it (module docstring).

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> backward = backward_steps(plan)
    >>> gradients = _gradients(plan, backward, _reads(plan, backward))   # as argument_reasons does
    >>> argument_roles(plan, backward, gradients)[plan.invars[-1]]
    ('inputs', 'only read: the step returns no updated value of it')
    """
    roles: dict[ValueId, tuple[str, str]] = {}
    if arg_paths is not None:
        for v, path in zip(plan.invars, arg_paths):
            if path and _OPTIMIZER_PATH.search(str(path)):
                roles[v] = ("optimizer_state", f"its pytree path {path} names optimizer state")
    if backward:
        feeds_backward = _ancestors(plan, [s for s in plan.schedule if s.index in backward])
        # Update steps: outside the backward part, reading something computed from a gradient.
        derived = set(gradients)
        updates = []
        for step in plan.schedule:
            if step.index in backward:
                continue
            if any(v in derived for v in step.inputs):
                updates.append(step)
                derived.update(v for v in step.outputs if v is not None)
        meets_gradient = _ancestors(plan, updates)
        for v in plan.invars:
            if v not in roles and v in meets_gradient and v not in feeds_backward:
                roles[v] = ("optimizer_state", "meets a gradient in the update and is not differentiated")
    updated = _returned_updated(plan, backward)
    for v in plan.invars:
        if v in roles:
            continue
        if v in updated:
            roles[v] = ("parameters", "its updated value is returned")
        elif backward:
            roles[v] = ("inputs", "only read: the step returns no updated value of it")
        else:
            roles[v] = ("parameters", "read-only in a program without a backward pass (taken for a weight)")
    return roles


def value_categories(plan: Plan, arg_paths: Sequence[str] | None = None) -> dict[ValueId, str]:
    """The report category of every value of a plan.

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> value_categories(plan)[plan.invars[0]], value_categories(plan)[plan.invars[1]]
    ('parameters', 'inputs')

    Args:
        plan: a `Plan` (schedule, values, invars, outvars).
        arg_paths: optional pytree path of each flat argument, e.g. "opt_state.mu['w']";
            without them, arguments are told apart by structure only.

    Returns:
        {value id: category}, one of `CATEGORIES` for every value in `plan.values`.
    """
    backward = backward_steps(plan)
    reads = _reads(plan, backward)

    gradients: set[ValueId] = set()
    cats: dict[ValueId, str] = {}
    for step in plan.schedule:
        in_backward = step.index in backward
        for v in step.outputs:
            if v is None:
                continue
            r = reads.get(v, 0)
            if in_backward:
                if r & (_RETURNED | _READ_FORWARD):
                    gradients.add(v)
                    cats[v] = "gradients"
                else:
                    cats[v] = "temporaries"
            elif r & _RETURNED:
                cats[v] = "outputs"
            elif r & _READ_BACKWARD:
                cats[v] = "residuals"
            else:
                cats[v] = "temporaries"

    roles = argument_roles(plan, backward, gradients, arg_paths)
    for v, info in plan.values.items():
        if v in cats:
            continue
        if v in roles:
            cats[v] = roles[v][0]
        elif info.producer is None:
            cats[v] = "parameters"  # a closed-over constant
        else:
            cats[v] = "temporaries"
    return cats


def argument_reasons(plan: Plan, arg_paths: Sequence[str] | None = None) -> dict[ValueId, str]:
    """How each top-level argument's category was decided, in words, for reports.

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> argument_reasons(plan)[plan.invars[0]]
    'its updated value is returned'
    """
    backward = backward_steps(plan)
    gradients = _gradients(plan, backward, _reads(plan, backward))
    return {v: why for v, (_, why) in argument_roles(plan, backward, gradients, arg_paths).items()}


def _gradients(plan: Plan, backward: set[int], reads: dict[ValueId, int]) -> set[ValueId]:
    """Values the backward part makes that are read outside it or returned."""
    return {v for step in plan.schedule if step.index in backward for v in step.outputs
            if v is not None and reads.get(v, 0) & (_RETURNED | _READ_FORWARD)}


def buffer_category(kind: str, first_value_category: str | None) -> str:
    """The category of a buffer holding no value the plan names (scratch) or of its first value.

    >>> buffer_category("scratch", None)
    'temporaries'
    """
    if kind == "scratch" or first_value_category is None:
        return "parameters" if kind == "constant" else "temporaries"
    return first_value_category


def categories_in_use(cats: dict[Any, str]) -> list[str]:
    """The categories that occur, in stacking order."""
    present = set(cats.values())
    return [c for c in CATEGORIES if c in present]
