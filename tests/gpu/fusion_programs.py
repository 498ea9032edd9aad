"""One small program per XLA:GPU fusion rule that `jaxmem.xla.gpu.model.predict` models, loadable as
`tests/gpu/fusion_programs.py:NAME`. In each, one intermediate (`BIG`, 16 MiB of float32) is
far larger than everything else, so XLA:GPU's temp figure says whether XLA stored it.

Each factory returns `(fn, args)`; `STORED[name]` is whether the rule stores the large value
(for the max-pool gradient: its 16 MiB of reduce_window outputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

N = 1024          # rows
D = 4096          # columns: N * D * 4 bytes = 16 MiB


def elementwise_chain():
    """Loop fusion: exp(x) * 2 + 1 summed over rows; no intermediate is stored."""
    def fn(x):
        return jnp.sum(jnp.exp(x) * 2.0 + 1.0, axis=1)
    return fn, (jnp.ones((N, D), jnp.float32),)


def broadcast_into_reduction():
    """A broadcast and an outer sum computed inside the reduction that reads them."""
    def fn(a, b):
        return jnp.sum(a[:, None] * b[None, :] + 1.0, axis=1)
    return fn, (jnp.ones((N,), jnp.float32), jnp.ones((D,), jnp.float32))


def gather_into_matvec():
    """MoE dispatch: each row gathers its expert's matrix (`w[idx]`, 16 MiB) and a batched
    matrix-vector product reads it; XLA:GPU never stores the gathered weights."""
    def fn(x, w, idx):
        return jnp.einsum("td,tdf->tf", x, w[idx])
    t, d, f, e = 256, 128, 128, 4
    return fn, (jnp.ones((t, d), jnp.float32), jnp.ones((e, d, f), jnp.float32), jnp.zeros((t,), jnp.int32))


def relu_into_gemm():
    """A GEMM prologue: relu(x) * 2 is read by the GEMM (a Triton fusion) and never stored."""
    def fn(x, w):
        return (jnp.maximum(x, 0.0) * 2.0) @ w
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((D, 8), jnp.float32))


def tanh_read_twice():
    """A transcendental chain read by a GEMM and by a transposed GEMM (as a layer's activation is
    in a training step) is stored once, not recomputed in each."""
    def fn(x, w2, w3):
        h = jnp.tanh(x) * 2.0
        return h @ w2, h.T @ w3
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((D, 8), jnp.float32), jnp.ones((N, 8), jnp.float32))


def log_softmax_rows():
    """A softmax-like row fusion: log_softmax's result is stored for the gather that reads it."""
    def fn(logits, targets):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, targets[:, None], axis=-1).sum()
    return fn, (jnp.ones((N, D), jnp.float32), jnp.zeros((N,), jnp.int32))


def outer_product_into_scatter():
    """Dot strength reduction: an outer product (no contraction) scattered into 4 slots is a
    multiply computed inside the scatter; the (N, 64, 64) product is never stored."""
    def fn(a, b, idx):
        outer = jnp.einsum("tf,td->tfd", a, b)
        return jnp.zeros((4, 64, 64), jnp.float32).at[idx].add(outer)
    return fn, (jnp.ones((N, 64), jnp.float32), jnp.ones((N, 64), jnp.float32), jnp.zeros((N,), jnp.int32))


def max_pool_gradient():
    """A max-pool gradient (select_and_scatter_add): XLA:GPU expands it into a variadic
    reduce_window (values and s32 indices) and a scatter into zeros."""
    def fn(x):
        def pool(x):
            return jnp.sum(jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2)
        return jax.grad(pool)(x)
    return fn, (jnp.ones((16, 64, 64, 64), jnp.float32),)


def relu_max_pool_gradient():
    """A relu before a max pool, both differentiated: the pool gradient's scatter writes into
    zeros that XLA's CSE shares with the relu's, so XLA stores the zeros and their copy (the
    scatter's in-place buffer) from the program's start: two 16 MiB buffers the lone max-pool
    gradient does not have."""
    def fn(x):
        def pool(x):
            y = jnp.maximum(x, 0.0)
            return jnp.sum(jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2)
        return jax.grad(pool)(x)
    return fn, (jnp.ones((16, 64, 64, 64), jnp.float32),)


def merged_dots():
    """Dot merger: four GEMMs reading the same input are one GEMM whose 16 MiB result lives until
    its last slice is read, though each tower alone needs 4 MiB."""
    def fn(x, ws):
        return sum(jnp.sum(jnp.tanh(x @ w), axis=1) for w in ws)
    return fn, (jnp.ones((N, 256), jnp.float32), [jnp.ones((256, D // 4), jnp.float32) for _ in range(4)])


def merged_dots_concatenated():
    """Dot merger past the GEMM's 4 parameters per operand: eight GEMMs reading the same input are
    one GEMM, and their eight weights are concatenated into a buffer of its own (16 MiB) that
    the merged GEMM (its result 32 MiB) reads; with four, the GEMM reads the weights directly."""
    def fn(x, ws):
        return sum(jnp.sum(jnp.tanh(x @ w), axis=1) for w in ws)
    return fn, (jnp.ones((N, 512), jnp.float32), [jnp.ones((512, N), jnp.float32) for _ in range(8)])


def bf16_convert_into_gemm():
    """Mixed precision: a float32 activation cast to bfloat16 for a bfloat16 GEMM is converted
    inside the GEMM's operand fusion; no bfloat16 copy (16 MiB) is stored."""
    def fn(x, w):
        return (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
    return fn, (jnp.ones((N, 2 * D), jnp.float32), jnp.ones((2 * D, 8), jnp.float32))


def bf16_weight_read_twice():
    """Mixed precision: a float32 weight cast to bfloat16 and read by two GEMMs (as a layer's
    weight is, forward and backward). The cast narrows its input and has two readers, so
    XLA's GEMM fusion does not take it into either GEMM: the bfloat16 copy (16 MiB) is stored."""
    def fn(w, x, dy):
        wb = w.astype(jnp.bfloat16)
        return jnp.sum((x @ wb).astype(jnp.float32)) + jnp.sum((dy @ wb.T).astype(jnp.float32))
    return fn, (jnp.ones((D // 2, D), jnp.float32), jnp.ones((8, D // 2), jnp.bfloat16),
                jnp.ones((16, D), jnp.bfloat16))


def scan_after_large_temporary():
    """A scan's stacked output (16 MiB) is held from the program's start: its zero-initialised
    loop buffer has no operands and XLA schedules it first, so it overlaps a sorted copy
    (16 MiB) that dies before the scan runs."""
    def fn(x, y):
        first = jnp.sum(jnp.sort(x, axis=1)[:, :8])
        _, ys = jax.lax.scan(lambda c, row: (c, jnp.sin(row) * c), first, y)
        return jnp.sum(ys * ys)
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((N, D), jnp.float32))


def scan_output_into_output():
    """A scan's stacked output (16 MiB, per-layer gradients) read by a norm and by the update
    that writes the program's output: XLA gives the loop's buffer the output's allocation (the
    update is elementwise, its operand dies there), and that allocation holds the stacked
    output from its zero initialisation, first in the schedule: a GEMM's result (32 MiB, too
    large for the output's allocation) that dies before the scan is the only large temporary."""
    def fn(w, a, b):
        first = jnp.sum(jnp.tanh(a @ b))
        _, ys = jax.lax.scan(lambda c, wi: (c, jnp.sin(wi) * c), first, w)
        return w - 0.1 * ys / jnp.sqrt(jnp.sum(ys * ys))
    return fn, (jnp.ones((16, N // 16, D), jnp.float32), jnp.ones((N, 64), jnp.float32),
                jnp.ones((64, 2 * D), jnp.float32))


BIG = N * D * 4
STORED = {
    "elementwise_chain": False,
    "broadcast_into_reduction": False,
    "gather_into_matvec": False,
    "relu_into_gemm": False,
    "tanh_read_twice": True,
    "log_softmax_rows": True,
    "outer_product_into_scatter": False,
    "max_pool_gradient": True,
    "relu_max_pool_gradient": True,
    "merged_dots": True,
    "merged_dots_concatenated": True,
    "bf16_convert_into_gemm": False,
    "bf16_weight_read_twice": True,
    "scan_after_large_temporary": True,
    "scan_output_into_output": True,
}


# --- pred2: moe, heap placement, split-K

def scatter_into_donated_output():
    """A gathered weight's gradient (a scatter-add into zeros, 16 MiB) applied to the donated
    weight: the update writes its output into the weight's own allocation, so the scatter's
    in-place buffer is a temporary of its own (16 MiB), live until the update reads it. Call
    with `donate_argnums=(0,)`."""
    def fn(w, idx, g):
        grad = jnp.zeros_like(w).at[idx].add(g)
        return w - 0.1 * grad
    return fn, (jnp.ones((N, D), jnp.float32), jnp.arange(256, dtype=jnp.int32) * 3,
                jnp.ones((256, D), jnp.float32))


STORED["scatter_into_donated_output"] = True


def relu_mask_read_by_gemms():
    """A relu's backward mask, `where(h > 0, g, 0)` (h and g 16 MiB each, arguments), read by a
    reduction and two GEMMs (bias, input and weight gradients): it reads two tensors and has
    several readers, so XLA's GEMM fusion does not take it in; it is stored (16 MiB)."""
    def fn(h, g, x, w):
        s = jnp.where(h > 0, g, 0.0)
        return s.sum(axis=0) + (x.T @ s).sum(axis=0) + jnp.sum(s @ w)
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((N, D), jnp.float32), jnp.ones((N, 8), jnp.float32),
                jnp.ones((D, 8), jnp.float32))


STORED["relu_mask_read_by_gemms"] = True


# --- pred1: cross-entropy gradient in place, gelu outputs per device

def cross_entropy_gradient_in_place():
    """Cross-entropy's value and gradient: log_softmax's result is stored for the loss's gather,
    so the gradient `g - exp(logp) * sum(g) / sum(exp(logp))` (a row value combined from two
    reductions) is a loop fusion after separate row reductions, written into a dying operand's
    buffer: two 16 MiB buffers (logp, the scatter then the gradient), not three."""
    def fn(w, h, targets):
        def loss(w):
            logp = jax.nn.log_softmax(h @ w, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=-1))
        return jax.value_and_grad(loss)(w)
    return fn, (jnp.ones((256, D), jnp.float32), jnp.ones((N, 256), jnp.float32), jnp.zeros((N,), jnp.int32))


STORED["cross_entropy_gradient_in_place"] = True


def _activation_step(activation, dtype, batch=1024, hidden=1024):
    """One two-layer MLP's gradient step (batch 1024, 256 -> 1024 -> 256): the activation's
    transcendental is read by the forward output's kernel and by the backward's."""
    def fn(w1, w2, x):
        def loss(w1, w2):
            return jnp.sum((activation(x @ w1) @ w2).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(w1, w2)
    return fn, (jnp.ones((256, hidden), dtype), jnp.ones((hidden, 256), dtype), jnp.ones((batch, 256), dtype))


def gelu_step():
    """tanh gelu in float32: XLA recomputes the tanh chain in both kernels on H100 (its cost
    model: the duplicated compute costs less than the 4 MiB written and read twice) and stores
    it beside the gelu output on A100 (a two-output `loop_multiply_tanh_fusion`)."""
    return _activation_step(lambda z: jax.nn.gelu(z, approximate=True), jnp.float32)


def gelu_step_wide():
    """tanh gelu in float32 over a 32 MiB hidden layer (batch 2048, 256 -> 4096 -> 256): the
    kernels' operands re-read (the GEMM output three times in the tanh chain) and their
    broadcast constants, read from cache, make the loop kernels slower unfused; recomputed
    on H100, stored on A100."""
    return _activation_step(lambda z: jax.nn.gelu(z, approximate=True), jnp.float32, batch=2048, hidden=4096)


def gelu_step_bf16():
    """tanh gelu in bfloat16: half the bytes saved for the same compute, so the tanh is stored
    on both devices."""
    return _activation_step(lambda z: jax.nn.gelu(z, approximate=True), jnp.bfloat16)


def silu_step():
    """silu (x * logistic(x), an exp): cheap enough to be recomputed on both devices."""
    return _activation_step(jax.nn.silu, jnp.float32)


# Whether XLA:GPU stores the activation's transcendental, per program and device.
TRANSCENDENTAL_STORED = {
    ("gelu_step", "h100-80gb"): False, ("gelu_step", "a100-40gb"): True,
    ("gelu_step_bf16", "h100-80gb"): True, ("gelu_step_bf16", "a100-40gb"): True,
    ("silu_step", "h100-80gb"): False, ("silu_step", "a100-40gb"): False,
    # A100: the tanh is the second output of `loop_multiply_tanh_fusion` (not live at the peak)
    ("gelu_step_wide", "h100-80gb"): False, ("gelu_step_wide", "a100-40gb"): True,
}


# --- moe: a cheap producer that its readers re-read (priority fusion's operand utilization)

def _reread_by_expert_matvec(d_out):
    """`h = x * 2 + 1` (16 MiB) read by an expert matvec (`einsum("tf,tfd->td", h, w[idx])`, a
    reduction that broadcasts h `d_out` times) and, in its gradient, by the scatter-add of the
    outer product of h and the output gradient (which broadcasts it as often)."""
    def fn(x, w, idx):
        def loss(w):
            h = x * 2.0 + 1.0
            return jnp.sum(jnp.einsum("tf,tfd->td", h, w[idx]) ** 2)
        return jax.value_and_grad(loss)(w)
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((4, D, d_out), jnp.float32),
                jnp.arange(N, dtype=jnp.int32) % 4)


def reread_cheap_producer_stored():
    """Re-read 64 times: computing h once per element read costs more than writing and reading
    it, so XLA stores it (16 MiB)."""
    return _reread_by_expert_matvec(64)


def reread_cheap_producer_fused():
    """Re-read 2 times: recomputing h is cheaper than storing it, so XLA computes it in both
    readers (no 16 MiB buffer)."""
    return _reread_by_expert_matvec(2)


STORED["reread_cheap_producer_stored"] = True
STORED["reread_cheap_producer_fused"] = False


# --- bf16: the softmax over widened logits, bfloat16 arithmetic per device

def bf16_log_softmax_grad():
    """Cross-entropy over bfloat16 logits widened to float32 (bf16_train's loss): XLA's Triton
    softmax fusion stores `f32(logits) - max` (16 MiB of float32), read by the sum's reduction,
    the loss's gather and the gradient; the 8 MiB bfloat16 GEMM result dies there."""
    def fn(w, h, targets):
        def loss(w):
            logits = (h @ w).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=-1))
        return jax.value_and_grad(loss)(w)
    return fn, (jnp.ones((256, D), jnp.bfloat16), jnp.ones((N, 256), jnp.bfloat16), jnp.zeros((N,), jnp.int32))


STORED["bf16_log_softmax_grad"] = True


def bf16_log_softmax_loss():
    """The same loss without its gradient: nothing past the softmax reads the shifted logits,
    so XLA makes one Triton softmax fusion writing the float32 log-probabilities (16 MiB, read
    by the gather) and never stores the shifted logits."""
    def fn(w, h, targets):
        logp = jax.nn.log_softmax((h @ w).astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=-1))
    return fn, (jnp.ones((256, D), jnp.bfloat16), jnp.ones((N, 256), jnp.bfloat16), jnp.zeros((N,), jnp.int32))


STORED["bf16_log_softmax_loss"] = True


def bf16_bias_gelu_grad():
    """The gradient of a bfloat16 bias GEMM and tanh gelu. The bias add is the GEMM fusion's
    epilogue, its result bf16[4096,2048] (16 MiB) on both devices. On A100 (bfloat16 arithmetic
    in float32) the activation gradient is stored in float32 (`loop_add_fusion` f32, 32 MiB)
    with a bfloat16 copy for the weight gradient's GEMM (`input_convert_reduce_fusion{1}`,
    beside the bias gradient's reduction): 48 MiB of temp there, 24 MiB on H100."""
    def fn(w, b, x):
        def loss(w, b):
            return jnp.sum(jax.nn.gelu(x @ w + b, approximate=True).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(w, b)
    bf = jnp.bfloat16
    return fn, (jnp.ones((256, 2048), bf), jnp.ones((2048,), bf), jnp.ones((4096, 256), bf))


def _bf16_layer_norm(x, scale, bias):
    """flax's LayerNorm at dtype bfloat16: float32 statistics, the normalized value cast back."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.maximum((xf * xf).mean(-1, keepdims=True) - mean * mean, 0.0)
    y = (xf - mean) * jax.lax.rsqrt(var + 1e-6)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(jnp.bfloat16)


def bf16_residual_mlp(blocks: int = 4, batch: int = 32, tokens: int = 256, dim: int = 256, hidden: int = 1024):
    """A bfloat16 pre-LayerNorm residual stack of bias-gelu MLPs (an MLP-Mixer's channel
    mixing), trained by SGD. XLA stores the residual stream's sums: on H100 in bfloat16
    (`input_add_reduce_fusion.N{2}` bf16[32,256,256]), on A100 in float32 (f32[32,256,256]:
    LayerNorm reads it in float32 and the simplifier drops the bfloat16 round trip); each MLP's
    bias GEMM result stays bfloat16 on both (`gemm_fusion_dot` bf16[8192,1024]), gelu's tanh is
    float32 on A100. Temp 232 MiB on H100, 304 MiB on A100."""
    bf = jnp.bfloat16

    def mlp(x, w1, b1, w2, b2):
        return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2 + b2

    def fn(params, x):
        def loss(params):
            y = x
            for (dense, scale, bias) in params:
                y = y + mlp(_bf16_layer_norm(y, scale, bias), *dense)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, q: p - 0.1 * q, params, grads)

    def linear(a, b):
        return (jnp.ones((a, b), bf) * 0.01, jnp.zeros((b,), bf))
    params = [(linear(dim, hidden) + linear(hidden, dim), jnp.ones((dim,), bf), jnp.zeros((dim,), bf))
              for _ in range(blocks)]
    return fn, (params, jnp.ones((batch, tokens, dim), bf))


def residual_relu(n: int = 4096, d: int = 1024):
    """A residual sum read by a relu and by its gradient's mask: `relu(x * w + z)` (a scaled
    branch plus a shortcut, both stored), the relu a result (stored, as a ResNet's relu is for
    the next convolution), trained for `w`. The sum has two readers, the `maximum` and the
    backward `compare`; priority fusion's first pricing finds it faster computed in both than
    stored (as in linen_resnet_bottleneck's dumps: each `bn + shortcut` sum, 80 us fused
    against 92 unfused on A100), and XLA stores no f32[4096,1024] sum."""
    def fn(w, x, z, m):
        def loss(w):
            y = jax.nn.relu(x * w + z)
            return jnp.sum(y * m), y
        return jax.grad(loss, has_aux=True)(w)
    x = jnp.ones((n, d), jnp.float32)
    return fn, (jnp.ones((d,), jnp.float32), x, x + 1, x + 2)


# --- Triton split-K (`jaxmem.xla.gpu.model.splitk`): (512 x 2048) @ (2048 x 512) splits 8 ways on
# H100 and 4 on A100, its float32 partials 8 and 4 MiB against a 1 MiB result.

def splitk_partials_held():
    """Two split GEMMs read by one concatenate-tanh: the split's reduce fuses into that loop
    fusion, so both GEMMs' partials live until it runs (H100: 2 x 8 MiB, A100: 2 x 4 MiB;
    the reduced 1 MiB results are never stored)."""
    def fn(x1, x2, w1, w2):
        return jnp.tanh(jnp.concatenate([x1 @ w1, x2 @ w2], axis=1))
    x, w = jnp.ones((512, 2048), jnp.float32), jnp.ones((2048, 512), jnp.float32)
    return fn, (x, x + 1, w, w + 1)


def splitk_reduced_for_gemm():
    """A split GEMM read by another GEMM: GEMM fusion takes no reduce into its operand, so the
    reduce is its own fusion; the partials live from the GEMM to it, beside the stored result."""
    def fn(x, w, v):
        return (x @ w) @ v
    return fn, (jnp.ones((512, 2048), jnp.float32), jnp.ones((2048, 512), jnp.float32),
                jnp.ones((512, 64), jnp.float32))


def splitk_merged_dots():
    """Two GEMMs sharing their lhs: the dot merger makes them one (512 x 1024) GEMM before the
    split, which splits it as one (H100: 4 ways, A100: 2), so the partials are 8 and 4 MiB in
    all, not each GEMM's own factor times its result (16 and 8 MiB)."""
    def fn(x, w1, w2):
        return jnp.concatenate([jnp.tanh(x @ w1), jnp.exp(x @ w2)], axis=1)
    w = jnp.ones((2048, 512), jnp.float32)
    return fn, (jnp.ones((512, 2048), jnp.float32), w, w + 1)


def splitk_column_sum():
    """A split GEMM summed over its rows (a column reduction): the reduce does not fuse into it,
    so the reduced result is stored beside the partials (H100: 8 + 1 MiB, A100: 4 + 1)."""
    def fn(x, w):
        return (x @ w).sum(axis=0)
    return fn, (jnp.ones((512, 2048), jnp.float32), jnp.ones((2048, 512), jnp.float32))


def splitk_residual_stored():
    """A split GEMM plus a residual, `h`, read early (by a GEMM through a tanh) and late (added
    to the last GEMM's result): priority fusion puts the split's reduce into the add, which it
    then stores rather than recompute in both readers, so the partials die at the add; read
    again late, they would sit beside the 8 MiB `tanh(h) @ v` (H100: 16 MiB of temp, not 24;
    A100: 12, not 16)."""
    def fn(x, w, r, v):
        h = x @ w + r
        a = jnp.tanh(h) @ v
        return jnp.tanh(a) @ v.T + h
    return fn, (jnp.ones((512, 2048), jnp.float32), jnp.ones((2048, 512), jnp.float32),
                jnp.ones((512, 512), jnp.float32), jnp.ones((512, 4096), jnp.float32))


def gemm_epilogue_into_donated():
    """An SGD step on a donated 16 MiB weight whose gradient is one GEMM: XLA:GPU's GEMM fusion
    takes `w - 0.1 * g` into the GEMM (an epilogue) and writes the new weight into the donated
    buffer, so the gradient is never stored (`xla.gpu.model.predict.gemm_output_epilogues`). Not split-K
    on either device (M, N, K = 1024, 4096, 512)."""
    def fn(w, x, d):
        return w - 0.1 * (x.T @ d)
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((512, N), jnp.float32), jnp.ones((512, D), jnp.float32))


def splitk_partials_die_at_prologue():
    """A split-K forward GEMM whose relu mask reaches the weight-gradient GEMM two fused steps
    later (`select(gt(x @ w, 0), 1, 0)`): XLA stores the select (a loop fusion; a GEMM fusion
    takes no reduce into its operands), so the partials die there and share the new weight's
    output allocation (`benchmarks/outside_models/drop_small.py:nodrop`)."""
    def fn(w, x):
        return w - 0.1 * jax.grad(lambda w: jax.nn.relu(x @ w).sum())(w)
    return fn, (jnp.ones((256, 512), jnp.float32) * 0.01, jnp.ones((64, 256), jnp.float32))


def dus_chain_into_donated():
    """A donated 16 MiB cache updated row block after row block, each update read before the
    next: XLA writes every update in place in the donated buffer (its alias analysis makes the
    argument, the updates and the output one buffer), no copy of the cache is stored."""
    def fn(c, u, i):
        s = 0.0
        for layer in range(4):
            c = jax.lax.dynamic_update_slice(c, u * layer, (layer, i, 0))
            s = s + jnp.sum(jnp.tanh(c[layer]))
        return c, s
    return fn, (jnp.zeros((4, N // 4, D), jnp.float32), jnp.ones((1, 1, D), jnp.float32), jnp.array(3, jnp.int32))


def gemm_result_also_returned():
    """The SGD step of `gemm_epilogue_into_donated` that also returns the gradient: the GEMM's
    result has two users, so XLA's GEMM fusion takes no epilogue (the update is a loop fusion)."""
    def fn(w, x, d):
        g = x.T @ d
        return w - 0.1 * g, g
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((512, N), jnp.float32), jnp.ones((512, D), jnp.float32))


def masked_select_into_gemm():
    """A GEMM reading `where(m > 0, d, 0)` (a relu or dropout mask applied to a gradient): the
    select reads a mask and a value, more bytes than it writes, so XLA's GEMM fusion does not
    take it into the GEMM's operand (IsInputWorthFusing) and the 16 MiB select is stored
    (`xla.gpu.model.fusion_producers.input_worth_fusing`)."""
    def fn(x, m, d):
        return x.T @ jnp.where(m > 0, d, 0.0)
    return fn, (jnp.ones((N, 512), jnp.float32), jnp.ones((N, D), jnp.float32), jnp.ones((N, D), jnp.float32))


def update_read_by_reduction():
    """`dynamic_update_slice` of an argument read only by a reduction: XLA computes the update
    inside the reduction (the DUS is a producer like a slice) and stores nothing (temp 0)."""
    def fn(p, u, i):
        y = jax.lax.dynamic_update_slice(p, u, (i, 0))
        return jnp.sum(y * y, 1)
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((8, D), jnp.float32), jnp.array(3, jnp.int32))


def update_of_exp_read_twice():
    """An update of `exp(p)` read by two reductions: XLA computes the update inside both, and
    stores the 16 MiB exponential once (a multi-output of the first) rather than computing it
    twice."""
    def fn(p, u, i):
        y = jax.lax.dynamic_update_slice(jnp.exp(p), u, (i, 0))
        return jnp.sum(y, 0), jnp.sum(y, 1)
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((8, D), jnp.float32), jnp.array(3, jnp.int32))


def update_returned_and_read():
    """An update of an argument that is also returned: stored (a copy of the argument updated
    in place), and read by the reduction from there."""
    def fn(p, u, i):
        y = jax.lax.dynamic_update_slice(p, u, (i, 0))
        return y, jnp.sum(y, 0)
    return fn, (jnp.ones((N, D), jnp.float32), jnp.ones((8, D), jnp.float32), jnp.array(3, jnp.int32))


def decode_stacked_cache():
    """A KV-cache decode step as often written: per layer, the new key and value (a split-K
    GEMM of a few tokens) written into that layer's cache slice, read by the attention's
    matrix-vector dots, and the layers' caches returned with `jnp.stack`. XLA computes each
    update inside the attention reductions and the stack's concatenate, from the GEMM's split
    partials, and stores no 8 MiB per-layer cache."""
    layers, batch, seq, heads, dh = 2, 16, 512, 8, 64
    d = heads * dh

    def fn(w, cache_k, cache_v, x, pos):
        ks, vs = [], []
        for layer in range(layers):
            q = (x @ w[layer, 0]).reshape(batch, heads, dh)
            kn = (x @ w[layer, 1]).reshape(batch, 1, heads, dh)
            vn = (x @ w[layer, 2]).reshape(batch, 1, heads, dh)
            kc = jax.lax.dynamic_update_slice(cache_k[layer], kn, (0, pos, 0, 0))
            vc = jax.lax.dynamic_update_slice(cache_v[layer], vn, (0, pos, 0, 0))
            s = jnp.einsum("bhd,bshd->bhs", q, kc).astype(jnp.float32)
            a = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
            x = x + jnp.einsum("bhs,bshd->bhd", a, vc).reshape(batch, d)
            ks.append(kc)
            vs.append(vc)
        return x, jnp.stack(ks), jnp.stack(vs)
    cache = jnp.zeros((layers, batch, seq, heads, dh), jnp.bfloat16)
    return fn, (jnp.ones((layers, 3, d, d), jnp.bfloat16) * 0.01, cache, cache,
                jnp.ones((batch, d), jnp.bfloat16), jnp.array(5, jnp.int32))


def loop_carry_updated_twice():
    """A donated 16 MiB cache carried by a `fori_loop` and written twice per iteration, each
    update read before the next (a decode loop's key and value): XLA keeps every update in the
    loop state's buffer, in place, and holds no copy of the cache."""
    def fn(c, u):
        def body(i, carry):
            c, s = carry
            c = jax.lax.dynamic_update_slice(c, u * i, (0, i, 0))
            s = s + jnp.sum(jnp.tanh(c[0]))
            c = jax.lax.dynamic_update_slice(c, u * i, (1, i, 0))
            return c, s + jnp.sum(jnp.tanh(c[1]))
        return jax.lax.fori_loop(0, 8, body, (c, 0.0))
    return fn, (jnp.zeros((4, N // 4, D), jnp.float32), jnp.ones((1, 1, D), jnp.float32))


def sgd_ensemble():
    """Eight MLPs trained at once, `jax.vmap` over the whole SGD step: each weight's update
    `w - 0.1 * (x.T @ d)` is a batched GEMM's epilogue in XLA:GPU, which writes the new 8 MiB
    weight stack into the donated one and never stores its gradient."""
    def one(p, x, y):
        def loss(p):
            logits = jnp.tanh(x @ p["w1"]) @ p["w2"]
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l
    p = {"w1": jnp.ones((8, 256, 1024), jnp.float32) * 0.01, "w2": jnp.ones((8, 1024, 10), jnp.float32) * 0.01}
    return jax.vmap(one), (p, jnp.ones((8, 128, 256), jnp.float32), jnp.zeros((8, 128), jnp.int32))


def splitk_int8_gemm():
    """An int8 GEMM with an s32 result (M, N, K = 512, 512, 4096): XLA's split-K rewriter skips
    only s32 operands, so it splits this one (8 ways on H100, 4 on A100) with s32 partials
    (the default accumulator of s8 x s8 -> s32); the dequantize and the sign mask read the
    partials, the reduce fused into each (`xla.gpu.model.splitk.dot_split`)."""
    def fn(x, w, scale):
        acc = jax.lax.dot(x, w, preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * scale, acc > 0
    return fn, (jnp.ones((512, 4096), jnp.int8), jnp.ones((4096, 512), jnp.int8), jnp.ones((512,), jnp.float32))


def splitk_fp8_gemm():
    """A float8 GEMM with a float32 result (M, N, K = 256, 512, 2048), its lhs quantized in the
    step: on H100 (native float8) a Triton GEMM split 8 ways, f32 partials (4 MiB) read by
    the bfloat16 cast."""
    def fn(x, w):
        h = x.astype(jnp.float8_e4m3fn)
        return jax.lax.dot(h, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return fn, (jnp.ones((256, 2048), jnp.bfloat16), jnp.ones((2048, 512), jnp.float8_e4m3fn))


def splitk_in_while_body():
    """A GEMM (M, N, K = 64, 512, 512) in a data-dependent while loop's body: XLA's split-K
    rewriter visits loop bodies too, so the body holds f32[8,64,512] partials on H100
    (f32[4,64,512] on A100) until the tanh that reads them."""
    def fn(h, a, n):
        def body(s):
            h, i = s
            return jnp.tanh(h @ a), i + 1
        return jax.lax.while_loop(lambda s: s[1] < n, body, (h, 0))[0]
    return fn, (jnp.ones((64, 512), jnp.float32), jnp.ones((512, 512), jnp.float32), jnp.array(5, jnp.int32))


def splitk_in_scan_body():
    """The GEMM of `splitk_in_while_body` in a `lax.scan` body, a row of the scanned input added
    to it: the scan's body is a while body too, split alike."""
    def fn(h, a, xs):
        def body(h, x):
            h = jnp.tanh(h @ a + x)
            return h, h.sum(1)
        return jax.lax.scan(body, h, xs)
    return fn, (jnp.ones((64, 512), jnp.float32), jnp.ones((512, 512), jnp.float32), jnp.ones((16, 64, 512), jnp.float32))


def gemm_operand_through_transpose():
    """A GEMM reading `(a - m).T`, `m` a masked diagonal: the algebraic simplifier folds the
    transpose into the dot, so the subtract is the GEMM's operand, and reading two 1 MiB values
    to write one it is not taken into the GEMM (IsInputWorthFusing): XLA stores it
    (`loop_subtract_fusion`, f32[512,512]; `xla.gpu.model.predict.read_by_gemm`)."""
    def fn(a, d, x):
        return x @ (a - jnp.diag(d)).T
    return fn, (jnp.ones((512, 512), jnp.float32), jnp.ones((512,), jnp.float32), jnp.ones((2048, 512), jnp.float32))


def tile_fused():
    """`jnp.tile` (newer JAX's `tile` primitive, a broadcast and reshape in HLO) read by a
    multiply and a row sum: one reduction fusion on XLA:GPU, the 8 MiB tiled value never stored."""
    def fn(x, y):
        return (jnp.tile(x, (4, 1)) * y).sum(1)
    return fn, (jnp.ones((N // 4, D // 2), jnp.float32), jnp.ones((N, D // 2), jnp.float32))


def stack_fused():
    """`jnp.stack` (the `stack` primitive, a concatenate of reshapes) of three elementwise
    values, reduced over rows: the stack and its operands are computed inside the reduction."""
    def fn(x, y):
        return jnp.stack([x * 2, y + 1, x * y]).max(axis=2)
    return fn, (jnp.ones((N, D // 2), jnp.float32), jnp.ones((N, D // 2), jnp.float32))


def split_unstack_fused():
    """`jnp.split` and `jnp.unstack` (the multi-output `split` and `unstack` primitives, one slice
    per output in HLO), their outputs combined elementwise: each slice is computed inside the
    loop fusion that reads it; nothing is stored but the outputs."""
    def fn(x, z):
        a, b, c, d = jnp.split(x * 2, 4)
        e, f = jnp.unstack(z + 1)
        return jnp.tanh(a) + b * c - d, e * f
    return fn, (jnp.ones((N, D // 2), jnp.float32), jnp.ones((2, N // 4, D // 2), jnp.float32))


def splitk_padded_contraction():
    """A [128, 1000] x [1000, 1000] GEMM (a 1000-class head's gradient): split-K splits its
    contraction 8 ways on H100, 4 on A100, and pads it to a multiple of 16 bytes per chunk
    (1024, 1008): XLA stores both zero-padded operands beside the partials."""
    return (lambda a, b: a @ b.T), (jnp.ones((128, 1000), jnp.float32), jnp.ones((1000, 1000), jnp.float32))


def splitk_padded_contraction_bf16():
    """`splitk_padded_contraction` in bfloat16: the step is 8 elements a chunk (1024 on both)."""
    return (lambda a, b: a @ b.T), (jnp.ones((128, 1000), jnp.bfloat16), jnp.ones((1000, 1000), jnp.bfloat16))


def _concat_edge_mlp(width, edges=8192):
    """An edge MLP on `concat([e, h[s], tanh(e)])` (pieces `width` wide, `edges` rows), trained
    one SGD step: the forward GEMM contracts over the concatenated dimension, the weight
    gradient's GEMM reads the concatenation along its non-contracting one."""
    nodes = 2048
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    w1 = jax.random.normal(k[0], (3 * width, 128))
    w2 = jax.random.normal(k[1], (128, 128))
    h = jax.random.normal(k[2], (nodes, width))
    e = jax.random.normal(k[3], (edges, width))
    s = jnp.arange(edges, dtype=jnp.int32) % nodes

    def loss(p, h, e, s):
        w1, w2 = p
        x = jnp.concatenate([e, h[s], jnp.tanh(e)], -1)
        y = jax.nn.silu(x @ w1)
        z = jax.nn.silu(y @ w2)
        return jnp.sum(jax.nn.silu(z @ w2) * e[:, :1])

    def step(p, h, e, s):
        g = jax.grad(loss)(p, h, e, s)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ((w1, w2), h, e, s)


def concat_read_by_weight_gradient():
    """`_concat_edge_mlp` with 128-wide pieces: XLA's GEMM fusion computes the concatenation
    inside the weight gradient's GEMM (one `gemm_fusion_dot` holds the concatenate, reading
    `e`, the gathered rows and the stored tanh), so the f32[8192, 384] concatenation is not
    held from the forward pass to the backward; the forward GEMM reads an
    `input_concatenate_fusion` made right before it."""
    return _concat_edge_mlp(128)


def concat_not_tiled_by_gemm():
    """`_concat_edge_mlp` with 96-wide pieces (not a multiple of 64): no GEMM fusion takes the
    concatenation, which is stored and held until the weight gradient."""
    return _concat_edge_mlp(96)


def concat_read_by_padded_split_gemm():
    """`_concat_edge_mlp` over 20000 rows: the split-K rewriter splits the weight gradient's
    contraction and pads it (20000 is no multiple of the split's step), and the GEMM reads a
    stored, padded copy of the concatenation (`loop_pad_fusion` of the
    `input_concatenate_fusion`), not the pieces."""
    return _concat_edge_mlp(128, 20000)


def _message_passing(rounds, edges=16384, nodes=2048, width=128):
    """`rounds` rounds of an edge MLP on `concat([e, h[s], h[r]])` (128-wide pieces) with a
    residual node update from the edge messages summed per receiver, trained one SGD step.
    Each round's weight gradient reads its concatenation along the non-contracting dimension
    (cloned into the GEMM), so its two gathers are recomputed in the backward pass."""
    k = jax.random.split(jax.random.PRNGKey(0), 2 * rounds + 3)
    ws = [jax.random.normal(k[i], (3 * width, width)) * 0.05 for i in range(rounds)]
    vs = [jax.random.normal(k[rounds + i], (width, width)) * 0.05 for i in range(rounds)]
    h = jax.random.normal(k[-3], (nodes, width))
    e = jax.random.normal(k[-2], (edges, width))
    s = jax.random.randint(k[-1], (edges,), 0, nodes)
    r = (s * 7 + 3) % nodes

    def loss(p, h, e, s, r):
        for w, v in zip(*p):
            m = jax.nn.silu(jnp.concatenate([e, h[s], h[r]], -1) @ w)
            e = e + m
            h = h + jax.ops.segment_sum(m, r, num_segments=nodes) @ v
        return jnp.sum(h ** 2) + jnp.sum(e ** 2)

    def step(p, h, e, s, r):
        g = jax.grad(loss)(p, h, e, s, r)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ((ws, vs), h, e, s, r)


def sibling_gathers_of_cloned_concats():
    """`_message_passing` over three rounds: XLA computes the backward's six gathers (every
    round's `h[s]` and `h[r]`, read by the weight gradients' GEMMs that hold the cloned
    concatenations) in one sibling multi-output fusion, they share the index operands, so all
    six are live from the last round's weight gradient on."""
    return _message_passing(3)


def sibling_gathers_of_residual_edge_layers():
    """Three residual edge layers `e += silu(concat([e, h_k[s], h_k[r]]) @ w_k)` on fixed node
    features `h_k = h * (k + 1)` (no gradient flows into the gathers), weights trained one SGD
    step: XLA computes the backward's six gathers in one sibling multi-output fusion (they
    share `h`, `s` and `r`) before the last layer's weight gradient, all six live from there."""
    edges, nodes, width = 16384, 2048, 128
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    ws = [jax.random.normal(k[i], (3 * width, width)) * 0.05 for i in range(3)]
    h = jax.random.normal(k[3], (nodes, width))
    e = jax.random.normal(k[4], (edges, width))
    s = jax.random.randint(k[5], (edges,), 0, nodes)
    r = (s * 7 + 3) % nodes

    def loss(ws, h, e, s, r):
        for i, w in enumerate(ws):
            hk = h * (i + 1.0)
            e = e + jax.nn.silu(jnp.concatenate([e, hk[s], hk[r]], -1) @ w)
        return jnp.sum(e ** 2)

    def step(ws, h, e, s, r):
        g = jax.grad(loss)(ws, h, e, s, r)
        return [a - 0.1 * b for a, b in zip(ws, g)]
    return step, (ws, h, e, s, r)


def gathers_of_one_cloned_concat():
    """`_message_passing` over one round: the weight gradient's two gathers, one multi-output
    fusion run right before it."""
    return _message_passing(1)


def max_pool_gradient_not_added():
    """Three conv / tanh / max-pool layers and a linear head, one SGD step. Each pool
    gradient is a scatter into zeros that nothing adds to: XLA's list scheduler runs the three
    zero broadcasts (`loop_broadcast_fusion`, no operands) first, before the forward
    convolutions, and keeps that order."""
    channels = [3, 32, 64, 128]
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    ws = [jax.random.normal(k, (3, 3, a, b)) * 0.1 for k, a, b in zip(ks, channels[:-1], channels[1:])]
    head = jax.random.normal(ks[3], (128, 10)) * 0.1

    def loss(p, x):
        ws, head = p
        for w in ws:
            x = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jax.lax.reduce_window(jnp.tanh(x), -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.sum((x.mean(axis=(1, 2)) @ head) ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ((ws, head), jnp.ones((64, 32, 32, 3), jnp.float32))


def max_pool_gradient_added(act=jnp.tanh):
    """A max pool whose input is also a skip connection (a U-Net's): the pooled activation's
    gradient is the pool gradient plus the skip's, which the backward convolution computes, and
    XLA's algebraic simplifier makes that gradient the scatter's operand (`scatter(A, i, u)`:
    the dump's `input_scatter_fusion` reads a `wrapped_slice`), so no zero broadcast is left."""
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    w1 = jax.random.normal(ks[0], (3, 3, 3, 32)) * 0.1
    w2 = jax.random.normal(ks[1], (3, 3, 32, 64)) * 0.1
    w3 = jax.random.normal(ks[2], (3, 3, 96, 8)) * 0.1
    dims = ("NHWC", "HWIO", "NHWC")

    def loss(p, x):
        w1, w2, w3 = p
        h = act(jax.lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dims))
        d = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        d = act(jax.lax.conv_general_dilated(d, w2, (1, 1), "SAME", dimension_numbers=dims))
        up = jnp.repeat(jnp.repeat(d, 2, axis=1), 2, axis=2)
        u = jax.lax.conv_general_dilated(jnp.concatenate([up, h], -1), w3, (1, 1), "SAME", dimension_numbers=dims)
        return jnp.sum(u ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ((w1, w2, w3), jnp.ones((64, 32, 32, 3), jnp.float32))


# --- convolutions: cuDNN's operands (xla.gpu.model.conv)

def _conv_loss(conv):
    """A weight step and the input's gradient through `conv(x, w)`."""
    def fn(w, x):
        gw, gx = jax.grad(lambda w, x: jnp.sum(jnp.tanh(conv(x, w))), argnums=(0, 1))(w, x)
        return w - 0.1 * gw, gx
    return fn


def strided_conv_grad():
    """A 4x4 stride-2 SAME convolution's gradients: forward, backward-filter and backward-input
    cuDNN calls, symmetric padding, nothing stored besides its values (NHWC on H100; NCHW on
    A100, where the input is copied to NCHW and the input's gradient copied back)."""
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return _conv_loss(conv), (jnp.full((4, 4, 32, 64), 0.1), jnp.ones((32, 64, 64, 32)))


def transposed_conv_grad():
    """A 4x4 stride-2 transposed convolution's gradients: its base dilation becomes an explicit
    pad of the input (f32[32,35,35,64]); its weight gradient has its operands swapped (the
    kernel is larger than the input), both transposed for cuDNN."""
    conv = lambda x, w: jax.lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return _conv_loss(conv), (jnp.full((4, 4, 64, 32), 0.1), jnp.ones((32, 16, 16, 64)))


def transposed_conv_of_activation():
    """The transposed convolution of a leaky relu: the activation is never stored, the pad and
    the weight gradient's transpose each compute it from the input."""
    def conv(x, w):
        h = jnp.where(x > 0, x, 0.01 * x)
        return jax.lax.conv_transpose(h, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return _conv_loss(conv), (jnp.full((4, 4, 64, 32), 0.1), jnp.ones((32, 16, 16, 64)))


def _conv_side_input(dims, x_shape, w_shape):
    def fn(x, w1, w2, w3, b):
        conv = lambda w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)
        p, q = conv(w1), conv(w2)
        bias = b[None, None, None, :] if dims[0] == "NHWC" else b[None, :, None, None]
        y = conv(w3) + bias + p * q
        return jnp.sum(y * p * q)
    w = jnp.full(w_shape, 0.01)
    return fn, (jnp.ones(x_shape), w, w, w, jnp.ones((64,)))


def conv_side_input():
    """`conv(x, w3) + b + p * q`, with `p` and `q` (two convolutions) read again after it: cuDNN
    adds the bias and `p * q` inside the third call (cudnn_fused_conv_rewriter.cc,
    FuseBiasOrSideInput), so `p * q` is stored (the call's side input) and the call writes the
    sum to a buffer of its own: four tensors live at once, where the sum computed in a loop
    fusion would take the convolution's buffer (three)."""
    return _conv_side_input(("NHWC", "HWIO", "NHWC"), (32, 32, 32, 64), (3, 3, 64, 64))


def conv_side_input_nchw():
    """`conv_side_input` in NCHW, the layout cuDNN reads float32 in on A100 (no copies)."""
    return _conv_side_input(("NCHW", "OIHW", "NCHW"), (32, 64, 32, 32), (64, 64, 3, 3))


def conv1x1_input_gradient():
    """The input's gradient through `tanh(conv1x1(x, w)) * tanh(x)`: the 1x1 convolution's
    transpose reverses a 1x1 kernel, which the algebraic simplifier drops, so it is a forward
    cuDNN call, and the gradient's other term is added inside it as its side input."""
    dims = ("NHWC", "HWIO", "NHWC")

    def fn(w, x):
        f = lambda x: jnp.sum(jnp.tanh(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims))
                              * jnp.tanh(x))
        return jax.grad(f)(x)
    return fn, (jnp.full((1, 1, 64, 64), 0.01), jnp.ones((32, 32, 32, 64)))


def splitk_film_broadcast():
    """A FiLM modulation from a split-K Dense: `h * (1 + scale) + shift`, the Dense's halves
    broadcast over the feature map and the result read twice (a swish). The split's reduce is a
    kernel of its own; the modulated map is computed inside its readers, never stored."""
    def fn(h, t, w):
        scale, shift = jnp.split(t @ w, 2, -1)
        y = h * (1 + scale[:, None, None]) + shift[:, None, None]
        return jnp.sum(y * jax.nn.sigmoid(y))
    return fn, (jnp.ones((32, 32, 32, 32)), jnp.ones((32, 4096)), jnp.full((4096, 64), 0.01))



def scatter_unit_sum():
    """A scatter-add into zeros with a size-one axis (a vmapped pool gradient's shape), summed
    over that axis and read by two row reductions: the sum is a bitcast to XLA (the algebraic
    simplifier's reduce of size-one dimensions), so nothing but the scatter's f32[512,1,1024]
    is stored."""
    def fn(g, idx):
        r = jnp.zeros((512, 1, 1024)).at[idx].add(g).sum(axis=1)
        return jnp.sin(r).sum(1), (r * r).sum(1)
    return fn, (jnp.ones((256, 1, 1024)), jnp.arange(256) * 2)


def _bn_relu_loss(x, gamma):
    mean = jnp.mean(x, axis=(0, 1, 2))
    c = x - mean
    var = jnp.mean(c * c, axis=(0, 1, 2))
    return jnp.sum(jax.nn.relu(c * jax.lax.rsqrt(var + 1e-5) * gamma) ** 2)


def bn_column(shape=(64, 8, 8, 256)):
    """Batch-norm statistics of NHWC data, and their gradient: each sum over N, H, W is a column
    reduction of 4096 rows, which XLA:GPU runs on 4 blocks. Priority fusion keeps the centred
    value `x - mean` (4 MiB) out of the variance's sum and stores it: fused, that slow kernel
    would read `x` and the broadcast mean."""
    return jax.grad(_bn_relu_loss), (jnp.ones(shape, jnp.float32), jnp.ones(shape[-1:], jnp.float32))


def bn_column_split():
    """`bn_column` over 16384 rows: the tree reduction rewriter splits each sum over many blocks,
    and nothing of 4 MiB is stored."""
    return bn_column((64, 16, 16, 256))


def relu_max_pool_gradient_added():
    """`max_pool_gradient_added` with a relu before the pool (a U-Net's encoder): the relu's
    zeros do not make the pool gradient's zeros shared, because there are none left: the
    algebraic simplifier makes the skip connection's gradient the scatter's operand (the dump's
    `input_scatter_fusion` reads a `wrapped_slice`) and no zero broadcast is stored."""
    return max_pool_gradient_added(jax.nn.relu)


def conv_batchnorm_grad():
    """Two convolutions with a batch norm (batch statistics) and a relu between them, one SGD
    step. The batch norm's input gradient is computed in the fusion that reads the first
    convolution's result for the last time, but XLA's heap simulator never writes it over that
    result (a cuDNN call's output is read through a get-tuple-element): the dump's
    `loop_add_fusion` and `cudnn-conv.3{0}` are at offsets of their own."""
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    w1 = jax.random.normal(ks[0], (3, 3, 16, 32)) * 0.1
    w2 = jax.random.normal(ks[1], (3, 3, 32, 8)) * 0.1
    dims = ("NHWC", "HWIO", "NHWC")

    def loss(p, x):
        w1, w2 = p
        h = jax.lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dims)
        mean = h.mean(axis=(0, 1, 2))
        var = ((h - mean) ** 2).mean(axis=(0, 1, 2))
        h = jax.nn.relu((h - mean) * jax.lax.rsqrt(var + 1e-5))
        u = jax.lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=dims)
        return jnp.sum(u ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ((w1, w2), jnp.ones((64, 32, 32, 16), jnp.float32))


def pool_indices_in_decoder():
    """A two-level U-Net with relus, a max pool, a strided transposed convolution up and a skip
    concatenation, one SGD step. XLA's list scheduler runs the pool gradient's variadic
    reduce-window (the pooled values and four s32 index arrays) during the forward decoder, so
    its index arrays are live from there to the backward's scatter, through the backward's
    peak (`xla.gpu.model.heap.pool_index_spans`)."""
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    w1 = jax.random.normal(ks[0], (3, 3, 8, 32)) * 0.1
    w2 = jax.random.normal(ks[1], (3, 3, 32, 64)) * 0.1
    wu = jax.random.normal(ks[2], (2, 2, 64, 32)) * 0.1
    w3 = jax.random.normal(ks[3], (3, 3, 64, 8)) * 0.1
    dims = ("NHWC", "HWIO", "NHWC")

    def loss(p, x):
        w1, w2, wu, w3 = p
        h = jax.nn.relu(jax.lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dims))
        d = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        d = jax.nn.relu(jax.lax.conv_general_dilated(d, w2, (1, 1), "SAME", dimension_numbers=dims))
        up = jax.lax.conv_transpose(d, wu, (2, 2), "SAME", dimension_numbers=dims)
        u = jax.lax.conv_general_dilated(jnp.concatenate([up, h], -1), w3, (1, 1), "SAME", dimension_numbers=dims)
        return jnp.sum(u ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ((w1, w2, wu, w3), jnp.ones((64, 32, 32, 8), jnp.float32))


def group_norm_silu_conv():
    """A convolution, a flax-style group norm (8 groups: mean and variance over height, width
    and each group's channels of [N, H, W, G, C/G]), a SiLU and a second convolution, one SGD
    step. XLA:GPU makes no Triton softmax fusion of the group norm
    (softmax_rewriter_triton.cc, ShouldFuseReduction: one reduced dimension, the last); the
    model takes it for one (a known gap: `test_gpu_unet_rules.py`)."""
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    w1 = jax.random.normal(ks[0], (3, 3, 16, 64)) * 0.1
    w2 = jax.random.normal(ks[1], (3, 3, 64, 16)) * 0.1
    dims = ("NHWC", "HWIO", "NHWC")

    def group_norm(x, scale, bias, groups=8):
        n, h, w, c = x.shape
        y = x.reshape(n, h, w, groups, c // groups)
        mean = y.mean(axis=(1, 2, 4), keepdims=True)
        var = ((y - mean) ** 2).mean(axis=(1, 2, 4), keepdims=True)
        return ((y - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(n, h, w, c) * scale + bias

    def loss(p, x):
        w1, w2, scale, bias = p
        h = jax.lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dims)
        h = jax.nn.silu(group_norm(h, scale, bias))
        u = jax.lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=dims)
        return jnp.sum(u ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, ((w1, w2, jnp.ones((64,)), jnp.zeros((64,))), jnp.ones((32, 32, 32, 16), jnp.float32))


def group_norm_decoder():
    """A convolution, a group norm with scale and bias, a SiLU, a 2x2 stride-2 transposed
    convolution, a SiLU and a convolution, one SGD step (float32). On A100 the transposed
    convolution's weight gradient reads the SiLU output transposed (NCHW to CNHW): XLA:GPU's
    multi-output fusion makes that copy the second output of the backward loop fusion that
    reads the same convolution result (`loop_add_transpose_fusion.1`), not a kernel of its own
    (`xla.gpu.model.conv.early_copies`)."""
    dims = ("NHWC", "HWIO", "NHWC")
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)

    def group_norm(h, scale, bias, groups=8):
        n, hh, ww, c = h.shape
        r = h.reshape(n, hh, ww, groups, c // groups)
        m = r.mean(axis=(1, 2, 4), keepdims=True)
        v = ((r - m) ** 2).mean(axis=(1, 2, 4), keepdims=True)
        return ((r - m) * jax.lax.rsqrt(v + 1e-5)).reshape(h.shape) * scale + bias

    def loss(p, x):
        w1, scale, bias, wt, w2 = p
        h = jax.nn.silu(group_norm(conv(x, w1), scale, bias))
        u = jax.lax.conv_transpose(h, wt, (2, 2), "SAME", dimension_numbers=dims)
        return jnp.mean(conv(jax.nn.silu(u), w2) ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return [a - 0.1 * b for a, b in zip(p, g)]
    p = [jnp.full((3, 3, 32, 64), 0.01), jnp.ones((64,)), jnp.zeros((64,)), jnp.full((2, 2, 64, 32), 0.01),
         jnp.full((3, 3, 32, 16), 0.01)]
    return step, (p, jnp.ones((8, 32, 32, 32)))
