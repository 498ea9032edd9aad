"""The benchmark suite: named programs in plain JAX, each a zero-argument factory of `(fn, args)`.

Every factory is a module-level function, so a subprocess can load it by its `target` string
(`"jaxmem.examples.suite:mlp_train"`). Sizes are chosen so each program traces, compiles and
plans in seconds on a CPU, while live memory is MBs to hundreds of MBs, so that differences
between schedules and placements are real bytes.

    >>> program = PROGRAMS["mlp_forward"]
    >>> fn, args = program.factory()
    >>> program.kind, program.target
    ('forward', 'jaxmem.examples.suite:mlp_forward')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from jaxmem.examples import cnn, control, gpt, mlp, rnn, zoo

Factory = Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]


@dataclass(frozen=True)
class Program:
    """One suite entry.

    Attributes:
        name: the registry key.
        factory: zero-argument callable returning `(fn, args)`.
        donate_argnums: positional arguments of `fn` to donate (as `jax.jit`'s).
        kind: "forward", "training" (a full step with an optimizer update, or a loss and its
            gradient) or "control" (loops, conditionals, branches).
        target: `"jaxmem.examples.suite:<factory name>"`, loadable by `jaxmem analyze` and by a
            subprocess.
        description: one line for tables.
    """

    name: str
    factory: Factory
    donate_argnums: tuple[int, ...]
    kind: str
    target: str
    description: str = ""


# -- factories (module level, so that a subprocess can import them by name) ---------------------

def mlp_forward():
    """MLP forward: 4 gelu layers of 1024, batch 2048, softmax over 1000 classes."""
    return mlp.make_forward(depth=4, width=1024, in_dim=1024, classes=1000, batch=2048, activation="gelu")


def mlp_train():
    """MLP training step with Adam: 4 relu layers of 1024, batch 1024, 10 classes."""
    return mlp.make_train_step(depth=4, width=1024, in_dim=784, classes=10, batch=1024, activation="relu")


def mlp_deep_train():
    """Deep MLP training step with Adam: 16 silu layers of 512, batch 1024."""
    return mlp.make_train_step(depth=16, width=512, in_dim=512, classes=100, batch=1024, activation="silu")


def transformer_forward():
    """Transformer forward (loss): 4 layers, d_model 384, 8 heads, RMSNorm, exact gelu, untied head."""
    return gpt.make_forward(n_layers=4, d_model=384, n_heads=8, seq=128, batch=8, vocab=8192,
                            tied=False, norm="rmsnorm", exact_gelu=True)


def transformer_train():
    """Transformer training step with Adam: 4 layers, d_model 256, 4 heads, layernorm, tanh gelu, tied."""
    return gpt.make_train_step(n_layers=4, d_model=256, n_heads=4, seq=128, batch=8, vocab=4096)


def transformer_wide_train():
    """Wide transformer training step: 2 layers, d_model 512, 16 heads, seq 256, RMSNorm, exact gelu, untied."""
    return gpt.make_train_step(n_layers=2, d_model=512, n_heads=16, seq=256, batch=4, vocab=2048, d_ff=1536,
                               tied=False, norm="rmsnorm", exact_gelu=True)


def transformer_train_step(n_layers: int):
    """The scaling study's transformer training step with `n_layers` layers (d_model 256, 4 heads,
    seq 128, batch 8, vocab 4096): `transformer_train_step(12)` is the speed target's program."""
    return gpt.make_train_step(n_layers=n_layers, d_model=256, n_heads=4, seq=128, batch=8, vocab=4096)


def transformer_train_12():
    """12-layer transformer training step with Adam (thousands of equations; the plan-time target)."""
    return transformer_train_step(12)


def cnn_forward():
    """CNN forward: three 3x3 conv stages (32, 64, 128 channels), max/avg pooling, 64x64 images, batch 16."""
    return cnn.make_forward(batch=16, size=64, channels=(32, 64, 128), classes=100)


def cnn_train():
    """CNN training step with Adam: the same network as cnn_forward."""
    return cnn.make_train_step(batch=16, size=64, channels=(32, 64, 128), classes=100)


def rnn_scan_grad():
    """GRU over 64 steps with lax.scan (hidden 512, batch 64): loss and gradient."""
    return rnn.make_loss_and_grad(batch=64, seq=64, in_dim=128, hidden=512)


def while_cond():
    """Block power iteration in while_loop (1024x1024, 256 vectors), then cond between two branches."""
    return control.make_while_cond(n=1024, k=256)


def parallel_branches():
    """Eight independent 3-layer silu towers (width 2048) on one input, concatenated and mixed."""
    return control.make_parallel_branches(batch=512, in_dim=512, width=2048, branches=8, depth=3)


# -- the registry ------------------------------------------------------------------------------

def _program(factory: Factory, kind: str, donate: tuple[int, ...] = (), name: str | None = None,
             module: str = "suite") -> Program:
    name = name or factory.__name__
    doc = (factory.__doc__ or "").strip().splitlines()
    description = doc[0] if doc else ""
    if donate:
        description = f"{description} Arguments {', '.join(map(str, donate))} donated."
    return Program(name=name, factory=factory, donate_argnums=donate, kind=kind,
                   target=f"jaxmem.examples.{module}:{factory.__name__}", description=description)


PROGRAMS: dict[str, Program] = {p.name: p for p in [
    _program(mlp_forward, "forward"),
    _program(mlp_train, "training"),
    _program(mlp_train, "training", donate=(0, 1), name="mlp_train_donated"),
    _program(mlp_deep_train, "training"),
    _program(transformer_forward, "forward"),
    _program(transformer_train, "training"),
    _program(transformer_train, "training", donate=(0, 1), name="transformer_train_donated"),
    _program(transformer_wide_train, "training"),
    _program(transformer_train_12, "training"),
    _program(cnn_forward, "forward"),
    _program(cnn_train, "training"),
    _program(rnn_scan_grad, "training"),
    _program(while_cond, "control"),
    _program(parallel_branches, "control"),
]}

# Training steps as users write them today (`zoo.py`): gathers, `dot_product_attention`, scanned
# layers, batch norm, bf16, a long sequence. Kept apart from PROGRAMS, whose figures BENCHMARKS.md
# records; `ALL_PROGRAMS` has both.
ZOO: dict[str, Program] = {p.name: p for p in [
    _program(f, "training", donate=(0, 1), module="zoo") for f in (
        zoo.moe_train, zoo.attention_train, zoo.scanned_transformer_train, zoo.scanned_checkpoint_train,
        zoo.convnet_bn_train, zoo.bf16_train, zoo.long_seq_train)
]}
ALL_PROGRAMS: dict[str, Program] = {**PROGRAMS, **ZOO}

# The layer counts of the plan-time scaling study (`transformer_train_step(n)`).
SCALING_LAYERS: tuple[int, ...] = (6, 12, 24, 48)
