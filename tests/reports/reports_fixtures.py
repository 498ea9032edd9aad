"""Helpers for the report tests: a small, obviously-correct plan built from a jaxpr here, so the
report tests do not depend on the planner's choices (they are also run on the planner's plans).

The plan: program order, call-like equations inlined, every output value its own buffer, live
from its producer to its last use (outputs to the end), placed first-fit in address order.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxmem.compiler.plan_types import Plan, PlannedBuffer, SourceLine, Step, ValueInfo, Const

_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint")


def _inline(jaxpr, env, counter, steps_out, const_values):
    for eqn in jaxpr.eqns:
        ins = []
        for a in eqn.invars:
            if hasattr(a, "val") and not hasattr(a, "count"):
                ins.append(Const(a.val))
            elif type(a).__name__ == "Literal":
                ins.append(Const(a.val))
            else:
                ins.append(env[a])
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        if eqn.primitive.name in _CALLS and inner is not None:
            closed = inner if hasattr(inner, "jaxpr") else None
            body = closed.jaxpr if closed is not None else inner
            sub = {}
            for v, c in zip(body.constvars, closed.consts if closed is not None else ()):
                counter[0] += 1
                sub[v] = counter[0]
                const_values[counter[0]] = v
            for v, x in zip(body.invars, ins):
                if isinstance(x, Const):
                    counter[0] += 1
                    sub[v] = counter[0]
                    const_values[counter[0]] = v
                else:
                    sub[v] = x
            _inline(body, sub, counter, steps_out, const_values)
            for o, io in zip(eqn.outvars, body.outvars):
                if type(o).__name__ == "DropVar":
                    continue
                if type(io).__name__ == "Literal":
                    counter[0] += 1
                    env[o] = counter[0]
                    const_values[counter[0]] = io
                else:
                    env[o] = sub[io]
            continue
        outs = []
        for o in eqn.outvars:
            if type(o).__name__ == "DropVar":
                outs.append(None)
                continue
            counter[0] += 1
            env[o] = counter[0]
            outs.append((counter[0], o))
        steps_out.append((eqn, ins, outs))


def _src(eqn):
    for frame in eqn.source_info.traceback.frames if eqn.source_info.traceback else ():
        if "/jax/" in frame.file_name or "/jaxlib/" in frame.file_name or "/jaxmem/" in frame.file_name:
            continue
        return SourceLine(frame.file_name, frame.line_num, frame.function_name)
    return None


def naive_plan(fn, *args, donate=()) -> Plan:
    closed = jax.make_jaxpr(fn)(*args)
    env, counter, raw, consts = {}, [0], [], {}
    values: dict[int, ValueInfo] = {}

    def info(v, vid, producer, source=None):
        aval = v.aval
        nbytes = int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
        values[vid] = ValueInfo(vid, tuple(aval.shape), str(aval.dtype), nbytes, producer, None, source)

    invars = []
    for v in closed.jaxpr.invars:
        counter[0] += 1
        env[v] = counter[0]
        invars.append(counter[0])
        info(v, counter[0], None)
    for v in closed.jaxpr.constvars:
        counter[0] += 1
        env[v] = counter[0]
        info(v, counter[0], None)
    _inline(closed.jaxpr, env, counter, raw, consts)
    for vid, v in consts.items():
        info(v, vid, None)
    steps = []
    for i, (eqn, ins, outs) in enumerate(raw):
        src = _src(eqn)
        for o in outs:
            if o is not None:
                info(o[1], o[0], i, src)
        steps.append(Step(i, eqn, eqn.primitive.name, ins, [o[0] if o else None for o in outs], source=src))
    outvars = [env[o] if type(o).__name__ != "Literal" else None for o in closed.jaxpr.outvars]
    n = len(steps)
    last = {}
    for s in steps:
        for v in s.inputs:
            last[v] = s.index
    for v in outvars:
        if v is not None:
            last[v] = n
    # buffers: every produced value, donated args, and constants
    intervals = []
    for vid, vi in values.items():
        if vid in invars and invars.index(vid) not in donate:
            continue
        start = -1 if vi.producer is None else vi.producer
        end = last.get(vid, start)
        size = max(256, -(-vi.nbytes // 256) * 256)
        kind = "argument" if vid in invars else ("constant" if vi.producer is None else ("output" if vid in outvars else "temp"))
        intervals.append((start, end, size, vid, kind))
    intervals.sort(key=lambda t: (t[0], -t[2]))
    placed, buffers = [], []
    for start, end, size, vid, kind in intervals:
        busy = sorted((o, s) for (o, s, e0, e1) in placed if not (e1 < start or e0 > end))
        off = 0
        for o, s in busy:
            if off + size <= o:
                break
            off = max(off, o + s)
        placed.append((off, size, start, end))
        bid = len(buffers)
        vi = values[vid]
        buffers.append(PlannedBuffer(bid, off, size, start, end, [vid], kind, shape=vi.shape, dtype=vi.dtype,
                                     source=vi.source, label=steps[vi.producer].primitive if vi.producer is not None else kind))
        vi.buffer = bid
    arena = max((o + s for o, s, _, _ in placed), default=0)
    caller = sum(values[v].nbytes for v in invars if values[v].buffer is None)
    return Plan(peak_bytes=caller + arena, arena_bytes=arena, argument_bytes=sum(values[v].nbytes for v in invars),
                output_bytes=sum(values[v].nbytes for v in outvars if v is not None), lower_bound_bytes=0,
                program_order_lower_bound_bytes=0, schedule=steps, buffers=buffers, values=values, invars=invars,
                outvars=outvars, donated=tuple(donate), valid=True, closed_jaxpr=closed)


def train_step_example(width=64, depth=3, batch=16):
    """A small MLP training step with an Adam-like update, in plain JAX, and its arguments."""
    import jax.numpy as jnp

    def loss(params, x, y):
        h = x
        for w in params[:-1]:
            h = jnp.tanh(h @ w)
        return jnp.mean((h @ params[-1] - y) ** 2)

    def step(params, mu, nu, x, y):
        l, grads = jax.value_and_grad(loss)(params, x, y)
        mu = [0.9 * m + 0.1 * g for m, g in zip(mu, grads)]
        nu = [0.999 * v + 0.001 * g * g for v, g in zip(nu, grads)]
        params = [p - 1e-3 * m / (jnp.sqrt(v) + 1e-8) for p, m, v in zip(params, mu, nu)]
        return params, mu, nu, l

    key = jax.random.PRNGKey(0)
    shapes = [(width, width)] * depth + [(width, 4)]
    params = [jax.random.normal(jax.random.fold_in(key, i), s) * 0.1 for i, s in enumerate(shapes)]
    zeros = [jnp.zeros(s) for s in shapes]
    x = jnp.ones((batch, width))
    y = jnp.zeros((batch, 4))
    return step, (params, zeros, [jnp.zeros(s) for s in shapes], x, y)


def synthetic_plan(n_buffers=100_000, n_steps=50_000, seed=0) -> Plan:
    """A plan-shaped object with many buffers (no jaxpr): sizes log-uniform from 256 B to 64 MiB,
    random live ranges, offsets stacked first-fit per size class; for scale tests of the reports."""
    rng = np.random.default_rng(seed)
    sizes = (np.exp(rng.uniform(np.log(256), np.log(64 << 20), n_buffers)).astype(np.int64) // 256 + 1) * 256
    starts = rng.integers(-1, n_steps, n_buffers)
    lengths = np.minimum(rng.geometric(1 / 50, n_buffers), n_steps - starts)
    ends = starts + lengths
    offsets = rng.integers(0, 8 << 30, n_buffers) // 256 * 256
    steps = [Step(i, None, ["dot_general", "add", "mul", "reduce_sum"][i % 4], [], []) for i in range(n_steps)]
    values, buffers = {}, []
    kinds = ["temp", "output", "argument", "scratch"]
    for i in range(n_buffers):
        producer = int(starts[i]) if starts[i] >= 0 else None
        values[i] = ValueInfo(i, (int(sizes[i]) // 4,), "float32", int(sizes[i]), producer, i,
                              SourceLine(f"/models/layer_{i % 97}.py", 10 + i % 500, f"block_{i % 13}"))
        if producer is not None:
            steps[producer].outputs.append(i)
        buffers.append(PlannedBuffer(i, int(offsets[i]), int(sizes[i]), int(starts[i]), int(ends[i]), [i],
                                     kinds[i % 4] if producer is not None else "argument",
                                     shape=(int(sizes[i]) // 4,), dtype="float32", label="op"))
    arena = int((offsets + sizes).max())
    return Plan(peak_bytes=arena, arena_bytes=arena, argument_bytes=0, output_bytes=0, lower_bound_bytes=0,
                program_order_lower_bound_bytes=0, schedule=steps, buffers=buffers, values=values,
                invars=[], outvars=[], valid=False)
