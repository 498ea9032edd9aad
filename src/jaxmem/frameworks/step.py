"""A training step as the framework that runs it compiles it: one `jax.jit` of a pure function.

Every framework jaxmem reads ends in one JAX program: plain JAX in the user's `jax.jit`, Flax NNX
in the `jax.jit` that `nnx.jit` wraps around the module's state, Equinox in `filter_jit`'s,
Keras in its trainer's. A `Step` is that program's `jax.jit` with the arguments the framework
hands it (abstract: no array of the user's is touched), and what is needed to change it and to
run it as the user would (`Change`, `runner`).

    step = as_step(nnx.jit(train_step), (model, optimizer, x, y))   # jaxmem.frameworks
    traced = step.trace()              # JAX's Traced of the program nnx.jit compiles
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager


FRAMEWORK_NAMES = {"jax": "JAX", "flax.nnx": "Flax NNX", "equinox": "Equinox", "keras": "Keras"}


@dataclass
class Change:
    """A change to the user's code that removes a cost the framework adds: what it does, the code
    to paste, and how to build the changed step (traced, then compiled by the caller to check it)."""

    title: str
    code: str
    build: Callable[[], "Step"]


@dataclass
class Step:
    """One step as its framework compiles it.

    `traced` is JAX's `Traced` of the program the framework compiles (its arguments abstract);
    `how` says in one line how jaxmem read it (None for plain JAX); `names` are the flat
    inputs as the user knows them (`model.layers[0].kernel`), `state` the flat inputs that are
    the model's and optimizer's state. `pure()` gives a function, its arguments and keyword
    arguments whose `jax.jit` is the program (for `jaxmem.fit` and the executor, which trace
    functions themselves). `runner(*user_args, **user_kwargs)` runs the step as the user does
    (for checking a change's results): `clone` copies the user's arguments first, so that a
    donating run leaves the user's own arrays alone, and `results(out, args)` reads what a run
    left: its outputs and the state it updated. `changes()` lists the changes worth compiling.
    `for_platform(platform)`, where set, is the program traced as on that platform ("gpu",
    "tpu"), for a framework that traces differently there (Keras).
    """

    framework: str
    name: str
    traced: Any
    how: str | None = None
    names: list[str] | None = None
    state: frozenset[int] = frozenset()
    user_fn: Callable[..., Any] | None = None
    runner: Callable[..., Any] | None = None
    user_args: tuple[Any, ...] = ()
    user_kwargs: dict[str, Any] = field(default_factory=dict)
    clone: Callable[[Any], Any] | None = None
    results: Callable[[Any, tuple[Any, ...]], Any] | None = None
    changes: Callable[[], list[Change]] = lambda: []
    devices: list[Any] = field(default_factory=list)
    pure: Callable[[], tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] | None = None
    for_platform: Callable[[str], Any] | None = None

    @property
    def label(self) -> str:
        """The framework as people name it ("Flax NNX")."""
        return FRAMEWORK_NAMES.get(self.framework, self.framework)


def from_args_info(traced: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments a `Traced` was traced with, as `jax.ShapeDtypeStruct`s in the same pytree
    (a framework's own containers kept)."""
    import jax

    def struct(info: Any) -> Any:
        aval = info._aval
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)

    positional, named = traced.args_info
    is_info = lambda x: hasattr(x, "donated")  # noqa: E731
    return tuple(jax.tree.map(struct, tuple(positional), is_leaf=is_info)), dict(
        jax.tree.map(struct, dict(named), is_leaf=is_info))


def in_context(fn: Callable[..., Any], context: Callable[[], ContextManager[Any]] | None) -> Callable[..., Any]:
    """`fn`, called inside `context()` where given (NNX's update context, which its inner
    `jax.jit` needs while it traces)."""
    if context is None:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "step")
    return call


def to_struct(leaf: Any) -> Any:
    """`leaf` as a `jax.ShapeDtypeStruct` with no sharding where `jax.jit` takes it as an array
    (arrays, structs, numpy scalars; Python scalars weakly typed, as `jax.jit` makes them); any
    other leaf as it is, for the framework to take or refuse.

    >>> to_struct(3), to_struct("relu")
    (ShapeDtypeStruct(shape=(), dtype=int32, weak_type=True), 'relu')
    """
    import jax

    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, weak_type=bool(getattr(leaf, "weak_type", False)))
    if isinstance(leaf, (bool, int, float, complex)):
        aval = jax.typeof(leaf)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
    return leaf


def abstract(tree: Any) -> Any:
    """Every array leaf of `tree` as a `jax.ShapeDtypeStruct` (`to_struct`)."""
    import jax

    return jax.tree.map(to_struct, tree)


def devices_of(tree: Any) -> list[Any]:
    """The devices the arrays of `tree` live on, each once, in the order met."""
    import jax

    seen: list[Any] = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        try:
            devices = sorted(leaf.devices(), key=lambda d: d.id)
        except Exception:  # a tracer, or a deleted (donated) array: no devices to read
            continue
        seen += [d for d in devices if d not in seen]
    return seen


def copy_arrays(tree: Any) -> Any:
    """`tree` with every JAX array copied (a donating run consumes the copies, never the
    user's own buffers); every other leaf as it is."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def has_values(tree: Any) -> bool:
    """Whether every array leaf of `tree` holds values (no `jax.ShapeDtypeStruct`)."""
    import jax

    return not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tree))


def arg_names(signature_of: Callable[..., Any] | None, count: int) -> list[str]:
    """The names of `count` positional parameters of `signature_of` (`args[i]` where it has
    none), for code to paste (`donate_argnames`)."""
    import inspect

    names = [f"args[{i}]" for i in range(count)]
    try:
        params = list(inspect.signature(signature_of).parameters.values()) if signature_of else []
    except (TypeError, ValueError):
        return names
    for i, p in enumerate(params[:count]):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names[i] = p.name
    return names


def fn_name(fn: Any) -> str:
    """The function's name as reports show it (through `functools.partial` and wrappers)."""
    for candidate in (fn, getattr(fn, "fun", None), getattr(fn, "__wrapped__", None), getattr(fn, "func", None)):
        name = getattr(candidate, "__name__", None)
        if candidate is not None and isinstance(name, str):
            return name
    return type(fn).__name__


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and the first `limit` characters of its text."""
    text = " ".join(str(err).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def donated_positions(traced: Any) -> tuple[int, ...]:
    """The positional arguments of a `Traced` whose every array leaf is donated."""
    import jax

    positional, _ = traced.args_info
    out = []
    for k, arg in enumerate(positional):
        infos = jax.tree.leaves(arg, is_leaf=lambda x: hasattr(x, "donated"))
        if infos and all(i.donated for i in infos):
            out.append(k)
    return tuple(out)
