"""XLA:GPU's or XLA:TPU's figures for a program lowered in this process: its StableHLO text is
handed to a deviceless compile child, which needs nothing else of the user's.

A function held in memory (a notebook's, `jaxmem.analyze`'s) cannot be imported by a child
process by name. JAX lowers it here for the target platform (`Traced.lower(lowering_platforms=
("cuda",))` or `("tpu",)`: no device is needed to lower), and the child compiles the text for
one compile-only GPU or TPU chip with the options `jax.jit` compiles with, then reads the same
figures as a TARGET's compile (`gpu.compile.compile_lowered_for_gpu`,
`tpu.compile.compile_lowered_for_tpu`): memory_analysis, the layouts, the aliases, the buffers
live at XLA's peak from its dumps.

    program = from_lowered(jax.jit(step, donate_argnums=0).trace(w, x).lower(lowering_platforms=("tpu",)))
    ref = lowered_reference(program, resolve("tpu-v5e-16gb"))

Run as a module it is the child:

    JAX_PLATFORMS=cpu python -m jaxmem.xla.lowered PROGRAM.json --device h100-80gb
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from jaxmem.accelerators import Accelerator, resolve
from jaxmem.errors import PlanError
from jaxmem.xla.gpu import compile as common
from jaxmem.xla.gpu.compile import XlaGpuReference

TOP_BUFFERS = common.TOP_BUFFERS


@dataclass
class LoweredProgram:
    """What a compile child needs of a lowered program: its StableHLO text (with its source
    locations), the platform it was lowered for, every flat argument (`shape`, `dtype`,
    `weak_type`, `donated`) and output (`shape`, `dtype`), the arguments the module kept
    (`jax.jit` drops unused ones), and the programs a factory ran before it (a TPU keeps their
    code resident; `tpu.factory`)."""

    text: str
    platform: str
    arguments: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    kept: list[int]
    factory_texts: list[str] = field(default_factory=list)

    @property
    def donated(self) -> list[bool]:
        """Per flat argument, whether it is donated."""
        return [bool(a["donated"]) for a in self.arguments]


def _leaf(info: Any) -> dict[str, Any]:
    """A leaf's shape, dtype and weak type; a typed PRNG key as its key data (`uint32[..., 2]`
    for threefry), as a device holds it."""
    import jax

    if jax.dtypes.issubdtype(info.dtype, jax.dtypes.prng_key):
        info = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(info.shape, info.dtype))
    return {"shape": [int(d) for d in info.shape], "dtype": str(info.dtype),
            "weak_type": bool(getattr(info, "weak_type", False))}


def from_lowered(lowered: Any, platform: str, factory_texts: Sequence[str] = ()) -> LoweredProgram:
    """A `jax.stages.Lowered` (lowered for `platform`) as the compile child reads it; each
    argument's donation as JAX lowered it (`Lowered.args_info`, per leaf)."""
    import jax

    infos = jax.tree.leaves(lowered.args_info, is_leaf=lambda x: hasattr(x, "donated"))
    arguments = [{**_leaf(getattr(i, "_aval", i)), "donated": bool(i.donated)} for i in infos]
    outputs = [_leaf(o) for o in jax.tree.leaves(lowered.out_info)]
    kept = common._kept_arguments(lowered, len(arguments))
    return LoweredProgram(lowered.as_text(debug_info=True), platform, arguments, outputs, kept,
                          list(factory_texts))


def structs_of(leaves: Sequence[dict[str, Any]]) -> list[Any]:
    """The `jax.ShapeDtypeStruct` of each leaf description."""
    import jax
    import jax.numpy as jnp

    return [jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]), weak_type=d.get("weak_type", False))
            for d in leaves]


# -- the parent side ---------------------------------------------------------------------------

def lowered_reference(program: LoweredProgram, accelerator: Accelerator | str, *, top: int = TOP_BUFFERS,
                      use_cache: bool = True, timeout: float = 1800.0,
                      on_start: Callable[[Any], None] | None = None) -> XlaGpuReference:
    """XLA's figures of `program` for a GPU or TPU preset, compiled deviceless in a fresh Python
    (cached by program text, target and versions).

    Raises:
        GpuUnavailable, TpuUnavailable: that compiler cannot run here.
        PlanError: XLA refused the program (one line from the child).
    """
    from jaxmem.xla.tpu import compile as tpu

    acc = resolve(accelerator) if isinstance(accelerator, str) else accelerator
    reason = tpu.unavailable_reason() if acc.is_tpu else common.unavailable_reason()
    if reason:
        raise (tpu.TpuUnavailable if acc.is_tpu else common.GpuUnavailable)(reason)
    env = tpu.child_env if acc.is_tpu else common.child_env
    fd, path = tempfile.mkstemp(prefix="jaxmem-program-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(program), f)
        cmd = [sys.executable, "-m", "jaxmem.xla.lowered", path, "--device", acc.name]
        try:
            data = common.run_compile_child(cmd, env, f"{acc.xla_name} compile", top=top, donate_argnums=(),
                                            kwargs=None, use_cache=use_cache, timeout=timeout, on_start=on_start)
        except common.GpuUnavailable as err:   # the child's "unavailable" exit code
            raise (tpu.TpuUnavailable(str(err)) if acc.is_tpu else err) from None
    finally:
        os.unlink(path)
    return common.reference_from_json(data)


# -- the child side ----------------------------------------------------------------------------

class TextCompiled:
    """A program text's executable, read as `jax.stages.Compiled` is read by the figures' code."""

    def __init__(self, executable: Any) -> None:
        from types import SimpleNamespace

        from jaxmem.compiler.jaxpr_adapter import executable_figures

        self._stats, self._hlo, ins, outs = executable_figures(executable)
        self.input_formats = ([SimpleNamespace(layout=x) for x in ins], {})
        self.output_formats = [SimpleNamespace(layout=x) for x in outs]

    def memory_analysis(self) -> Any:
        return self._stats

    def as_text(self) -> str:
        return self._hlo


class TextLowered:
    """A program text lowered for `device`, read as `jax.stages.Lowered` is read by the figures'
    code: `compile(compiler_options=...)`, `out_info`, `kept_var_idx`."""

    def __init__(self, program: LoweredProgram, device: Any) -> None:
        self.program, self.device = program, device
        self.out_info = structs_of(program.outputs)
        self.kept_var_idx = list(program.kept)

    def compile(self, compiler_options: dict[str, Any] | None = None) -> TextCompiled:
        from jaxmem.compiler.jaxpr_adapter import compile_text_executable

        return TextCompiled(compile_text_executable(self.device, self.program.text, compiler_options))


def compile_program(program: LoweredProgram, accelerator: Accelerator, *, top: int, dump_dir: str | None,
                    use_cache: bool) -> dict[str, Any]:
    """The child's compile of `program` for one compile-only device of `accelerator`: the
    figures as a TARGET's compile child prints them."""
    structs = structs_of(program.arguments)
    if accelerator.is_tpu:
        from jaxmem.xla.tpu import compile as tpu

        device = tpu.topology_devices(accelerator.topology or "")[0]
        data = tpu.compile_lowered_for_tpu(TextLowered(program, device), structs, program.donated, program.text,
                                           accelerator=accelerator, top=top, dump_dir=dump_dir, use_cache=use_cache)
        if program.factory_texts and not data.get("oom"):
            data["factory"] = _factory(program.factory_texts, device, accelerator)
        return data
    spec = common.spec_for(accelerator.name)
    if spec is None:
        raise PlanError(f"{accelerator.name} is not a GPU preset with an XLA target description")
    text, mesh = common.gpu_target(spec, accelerator.name)
    device = mesh.devices.flat[0]
    return common.compile_lowered_for_gpu(TextLowered(program, device), structs, program.donated, program.text,
                                          spec=spec, device=accelerator.name, target_text=text, top=top,
                                          dump_dir=dump_dir, use_cache=use_cache)


def _factory(texts: Sequence[str], device: Any, accelerator: Accelerator) -> dict[str, int]:
    """The programs a factory ran before the step, compiled for the chip (`tpu.factory`), with
    the runtime's reservation for their temporaries."""
    from importlib.metadata import version

    import jax

    from jaxmem.xla.tpu.compile import RESERVATION_OVERHEAD
    from jaxmem.xla.tpu.factory import factory_programs

    factory = factory_programs(texts, device, f"jax {jax.__version__} libtpu {version('libtpu')} "
                                              f"{accelerator.topology}")
    # The runtime's reservation for their temporaries: at least what XLA:TPU preallocates of
    # them (counted whole here), with the runtime's overhead.
    factory["reserved_bytes"] = factory["temp_bytes"] + RESERVATION_OVERHEAD if factory["temp_bytes"] else 0
    return factory


def main(argv: list[str] | None = None) -> int:
    """The subprocess side: print a lowered program's XLA figures as one JSON object. Exit 3
    when the device's compiler is unavailable here, 2 for any other error."""
    from jaxmem.xla.start import quiet_jax_start
    from jaxmem.xla.tpu import compile as tpu

    parser = argparse.ArgumentParser(prog="python -m jaxmem.xla.lowered")
    parser.add_argument("program")
    parser.add_argument("--device", required=True)
    parser.add_argument("--top", type=int, default=TOP_BUFFERS)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)

    def compile() -> dict[str, Any]:
        accelerator = resolve(args.device)
        if accelerator.is_tpu:
            for name, value in tpu.DEVICELESS_ENV.items():
                os.environ.setdefault(name, value)
        quiet_jax_start()
        with open(args.program, encoding="utf-8") as f:
            program = LoweredProgram(**json.load(f))
        dump_dir = os.environ.get("JAXMEM_TPU_DUMP") if accelerator.is_tpu else common.dump_dir_from_flags()
        try:
            return compile_program(program, accelerator, top=args.top, dump_dir=dump_dir or None,
                                   use_cache=not args.no_cache)
        except tpu.TpuUnavailable as err:
            raise common.GpuUnavailable(str(err)) from None   # the child's "unavailable" exit code

    return common.child_reply(compile)


if __name__ == "__main__":
    sys.exit(main())
