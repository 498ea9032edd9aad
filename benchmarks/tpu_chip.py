"""What a real TPU chip does with the suite's programs: the truth jaxmem's TPU verdicts are checked
against. Runs on a machine with a TPU v5e (JAX 0.10.2, libtpu 0.0.42.1), never in CI.

For each program, in a fresh process (a TPU's peak counters only grow, and one process at a time
holds the chip): the arguments are put on the chip, the step is compiled as `jax.jit` compiles it
(with the program's donation), `compiled.memory_analysis()` is read, and the step runs `--steps`
times as a training loop runs it (`params, opt = step(params, opt, batch)`: an output whose dtype
and shape match an argument's replaces it, in order, as `jaxmem.runtime.steps.match_state` pairs
them), with `device.memory_stats()` read before anything, after the arguments, after the compile
and after every step. One JSON line per program.

    PYTHONPATH=src python benchmarks/tpu_chip.py --out $OUT/chip.jsonl
    PYTHONPATH=src python benchmarks/tpu_chip.py --batch-sizes 16,17,18 --out $OUT/maxbatch.jsonl

`--batch-sizes` runs `jaxmem.examples.gpt:batch_example` at each batch size instead (the maxbatch
check): whether it compiles and runs the steps, and XLA:TPU's message where it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

PROGRAMS = ("mlp_forward", "mlp_train", "mlp_train_donated", "mlp_deep_train", "transformer_forward",
            "transformer_train", "transformer_train_donated", "transformer_wide_train", "transformer_train_12",
            "cnn_forward", "cnn_train", "rnn_scan_grad", "while_cond", "parallel_branches", "moe_train",
            "attention_train", "scanned_transformer_train", "scanned_checkpoint_train", "convnet_bn_train",
            "bf16_train", "long_seq_train")


def _stats(device: Any) -> dict[str, int]:
    return {k: int(v) for k, v in (device.memory_stats() or {}).items() if isinstance(v, (int, float))}


def _is_format(x: Any) -> bool:
    return hasattr(x, "layout")


def _layout_text(fmt: Any) -> str:
    return str(getattr(fmt, "layout", fmt))


def _leaf(x: Any) -> dict[str, Any]:
    """An array as it sits on the chip: shape, dtype, its buffer's bytes and its layout."""
    try:
        size = int(x.on_device_size_in_bytes())
    except Exception:  # a typed PRNG key or a backend without the figure
        size = -1
    try:
        layout = _layout_text(x.format)
    except Exception:
        layout = ""
    return {"shape": list(getattr(x, "shape", ())), "dtype": str(getattr(x, "dtype", type(x).__name__)),
            "bytes": size, "layout": layout}


def _materialize(args: Any, device: Any) -> Any:
    """Arrays on the chip, one buffer each; a `ShapeDtypeStruct` becomes zeros there (token ids
    0 are valid)."""
    import jax
    import jax.numpy as jnp

    def leaf(x: Any) -> Any:
        if not hasattr(x, "shape"):   # a Python scalar (a TrainState's step): passed as the user passes it
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))()
        return jax.device_put(x, device)

    return jax.tree.map(leaf, args)


def _state_pairs(args: Any, outs: Any) -> dict[int, int]:
    """flat output index -> flat argument index it replaces: first unclaimed argument leaf with the
    same dtype and shape, in output order."""
    import jax

    keys_in = [(str(jax.typeof(x).dtype), tuple(jax.typeof(x).shape)) for x in jax.tree.leaves(args)]
    claimed: set[int] = set()
    pairs = {}
    for i, out in enumerate(jax.tree.leaves(outs)):
        key = (str(out.dtype), tuple(out.shape))
        for j, k in enumerate(keys_in):
            if j not in claimed and k == key:
                pairs[i] = j
                claimed.add(j)
                break
    return pairs


def run_one(fn: Any, args: Any, donate: tuple[int, ...], steps: int) -> dict[str, Any]:
    """One program on the chip: memory_analysis and memory_stats at each stage."""
    import jax

    device = jax.devices()[0]
    row: dict[str, Any] = {"device_kind": device.device_kind, "jax": jax.__version__, "stats": {}}
    try:
        from importlib.metadata import version

        row["libtpu"] = version("libtpu")
    except Exception:  # the machine's own install may not be a distribution
        row["libtpu"] = ""
    row["stats"]["start"] = _stats(device)
    args = _materialize(args, device)
    jax.block_until_ready(args)
    row["stats"]["arguments"] = _stats(device)
    row["argument_leaves"] = [_leaf(x) for x in jax.tree.leaves(args)]
    started = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    row["input_layouts"] = [_layout_text(f) for f in jax.tree.leaves(compiled.input_formats[0], is_leaf=_is_format)]
    row["compile_seconds"] = round(time.perf_counter() - started, 3)
    row["memory_analysis"] = _analysis(compiled)
    row["stats"]["compiled"] = _stats(device)
    flat, tree = jax.tree.flatten(args)
    del args   # the loop holds only the current state, as `params, opt = step(params, opt, batch)` does
    out = None
    for step in range(1, steps + 1):
        row["stats"][f"before{step}"] = _stats(device)
        out = compiled(*jax.tree.unflatten(tree, flat))
        jax.block_until_ready(out)
        outs = jax.tree.leaves(out)
        if step == 1:
            row["output_leaves"] = [_leaf(x) for x in outs]
        for i, j in _state_pairs(flat, outs).items():
            flat[j] = outs[i]
        row["stats"][f"step{step}"] = _stats(device)
    last = row["stats"][f"step{steps}"]
    row["chip_peak_bytes"] = last.get("peak_bytes_in_use", 0) + last.get("peak_bytes_reserved", 0)
    del out
    return row


def load_target(name: str, batch_size: int | None) -> tuple[Any, Any, tuple[int, ...], Any]:
    """(fn, args, donated positions, module) of a suite program's name, or of `path.py:factory`
    (its module's `DONATE`, if any, names the donated arguments; `batch_size` is passed as the
    factory's `batch`)."""
    if ".py:" not in name:
        if batch_size is not None:
            from jaxmem.examples.gpt import batch_example

            return (*batch_example(batch_size), (0, 1), None)
        from jaxmem.examples.suite import ALL_PROGRAMS

        program = ALL_PROGRAMS[name]
        return (*program.factory(), tuple(program.donate_argnums), None)
    import importlib.util

    path, factory = name.rsplit(":", 1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kwargs = {} if batch_size is None else {"batch": batch_size}
    fn, args = getattr(module, factory)(**kwargs)
    return fn, args, tuple(getattr(module, "DONATE", ())), module


def run_loop(fn: Any, args: Any, donate: tuple[int, ...], eval_fn: Any, eval_args: Any, steps: int) -> dict[str, Any]:
    """A train step and an eval step alternating in one process, `steps` times each: the eval
    step's first argument is the train step's current first argument (the parameters)."""
    import jax

    device = jax.devices()[0]
    row: dict[str, Any] = {"device_kind": device.device_kind, "jax": jax.__version__, "stats": {}}
    row["stats"]["start"] = _stats(device)
    args, eval_args = _materialize(args, device), _materialize(eval_args, device)
    eval_rest = list(eval_args[1:])
    jax.block_until_ready((args, eval_rest))
    row["stats"]["arguments"] = _stats(device)
    train = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    evaluate = jax.jit(eval_fn).lower(args[0], *eval_rest).compile()
    row["memory_analysis"] = _analysis(train)
    row["eval_memory_analysis"] = _analysis(evaluate)
    row["stats"]["compiled"] = _stats(device)
    flat, tree = jax.tree.flatten(args)
    del args, eval_args
    for step in range(1, steps + 1):
        out = train(*jax.tree.unflatten(tree, flat))
        jax.block_until_ready(out)
        outs = jax.tree.leaves(out)
        for i, j in _state_pairs(flat, outs).items():
            flat[j] = outs[i]
        del out, outs
        row["stats"][f"train{step}"] = _stats(device)
        metrics = evaluate(jax.tree.unflatten(tree, flat)[0], *eval_rest)
        jax.block_until_ready(metrics)
        del metrics
        row["stats"][f"step{step}"] = _stats(device)
    last = row["stats"][f"step{steps}"]
    row["chip_peak_bytes"] = last.get("peak_bytes_in_use", 0) + last.get("peak_bytes_reserved", 0)
    return row


def _analysis(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
            "generated_code_bytes": int(m.generated_code_size_in_bytes)}


LAYOUT_CASES = (((300,), "float32"), ((37,), "float32"), ((1000,), "float32"), ((5,), "bfloat16"),
                ((1000,), "int8"), ((77,), "bool"), ((), "int32"), ((), "float32"), ((100, 300), "float32"),
                ((300, 77), "float32"), ((77, 10), "float32"), ((50, 100), "float32"), ((7, 3), "float32"),
                ((200, 333), "bfloat16"), ((333, 5), "bfloat16"), ((96, 200), "int8"), ((96, 200), "bool"),
                ((64, 77), "int8"), ((3, 3, 3, 19), "float32"), ((3, 3, 19, 41), "bfloat16"),
                ((2, 5, 7), "float32"), ((1024, 256), "float32"), ((4096, 3), "float32"), ((3, 4096), "float32"))


def probe_layouts() -> dict[str, Any]:
    """Per shape and dtype: the array as `jnp` makes it on the chip and as `jax.device_put` puts
    it there (layout, buffer bytes, what `bytes_in_use` grew by), the layout a program compiled
    for it expects, and what calling that program with it costs (three calls with the array as
    made, then one with the program's own output)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    device = jax.devices()[0]
    rows, keep = [], []
    for shape, dtype in LAYOUT_CASES:
        rec: dict[str, Any] = {"shape": list(shape), "dtype": dtype}
        before = _stats(device)["bytes_in_use"]
        made = jax.jit(lambda: jnp.zeros(shape, dtype))()
        jax.block_until_ready(made)
        rec["jnp"] = {**_leaf(made), "in_use_delta": _stats(device)["bytes_in_use"] - before}
        before = _stats(device)["bytes_in_use"]
        put = jax.device_put(np.zeros(shape, dtype), device)
        jax.block_until_ready(put)
        rec["device_put"] = {**_leaf(put), "in_use_delta": _stats(device)["bytes_in_use"] - before}
        op = (lambda x: ~x) if dtype == "bool" else (lambda x: x + 1)
        compiled = jax.jit(op).lower(made).compile()
        rec["program_in_layout"] = _layout_text(compiled.input_formats[0][0])
        rec["program_out_layout"] = _layout_text(compiled.output_formats)
        rec["memory_analysis"] = _analysis(compiled)
        calls = []
        arg = made
        for call in range(4):
            stats = _stats(device)
            out = compiled(arg)
            jax.block_until_ready(out)
            after = _stats(device)
            calls.append({"in_use_before": stats["bytes_in_use"], "in_use_after": after["bytes_in_use"],
                          "peak_rise": after["peak_bytes_in_use"] - max(stats["peak_bytes_in_use"], stats["bytes_in_use"]),
                          "peak_over_before": after["peak_bytes_in_use"] - stats["bytes_in_use"],
                          "reserved": after.get("peak_bytes_reserved", 0), "out": _leaf(out)})
            keep.append(out)
            arg = out if call == 2 else made
        rec["calls"] = calls
        keep += [made, put]
        rows.append(rec)
    return {"program": "layouts", "device_kind": device.device_kind, "jax": jax.__version__, "cases": rows,
            "stats_end": _stats(device), "ok": True}


FACTORY_ON_CHIP = False


def _factory_on_chip(name: str, batch_size: int | None) -> tuple[Any, Any, tuple[int, ...], Any, dict[str, Any]]:
    """The factory run on the chip: the programs it compiled (JAX's backend-compile events),
    and `bytes_in_use` after it against the arrays still alive, the arrays it returned, and the
    runtime's own buffer."""
    import jax

    device = jax.devices()[0]
    compiles: list[float] = []

    def listen(event: str, seconds: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    before = _stats(device)
    fn, args, donate, module = load_target(name, batch_size)
    jax.block_until_ready(args)
    after = _stats(device)
    live = sum(int(x.on_device_size_in_bytes()) for x in jax.live_arrays() if x.devices() == {device})
    returned = sum(int(x.on_device_size_in_bytes()) for x in jax.tree.leaves(args) if hasattr(x, "on_device_size_in_bytes"))
    info = {"compiles": len(compiles), "stats_before": before, "stats_after": after, "live_array_bytes": live,
            "returned_array_bytes": returned}
    return fn, args, donate, module, info


def child(name: str, steps: int, batch_size: int | None) -> int:
    """One program in this process; prints one JSON line."""
    row: dict[str, Any] = {"program": name, "steps": steps}
    try:
        import jax

        if name == "layouts":
            row.update(probe_layouts())
            print("ROW " + json.dumps(row), flush=True)
            return 0
        # The factory runs on the host CPU, so that the chip's counters (whose peaks only grow)
        # hold nothing but the step's arguments when the measurement starts; with
        # --factory-on-chip it runs on the chip as a user's script runs it, and what it leaves
        # there beside the arrays it returns is recorded.
        if FACTORY_ON_CHIP:
            fn, args, donate, module, row["factory"] = _factory_on_chip(name, batch_size)
            eval_fn, eval_args = None, None
        else:
            with jax.default_device(jax.devices("cpu")[0]):
                fn, args, donate, module = load_target(name, batch_size)
                loop = getattr(module, "make_eval", None)
                eval_fn, eval_args = loop() if loop else (None, None)
        if batch_size is not None:
            row["batch_size"] = batch_size
        row["donate"] = list(donate)
        if eval_fn is not None:
            row["loop"] = "train+eval"
            row.update(run_loop(fn, args, donate, eval_fn, eval_args, steps))
        else:
            row.update(run_one(fn, args, donate, steps))
        row["ok"] = True
    except Exception as err:  # the chip's own failure is the measurement
        row["ok"] = False
        row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:600]}"
    try:
        from importlib.metadata import version

        row.setdefault("libtpu", version("libtpu"))
    except Exception:  # the machine's own install may not be a distribution
        row.setdefault("libtpu", "")
    print("ROW " + json.dumps(row), flush=True)
    return 0


def parent(names: list[str], steps: int, out_path: str, batch_sizes: list[int]) -> int:
    jobs = [(n, None) for n in names] if not batch_sizes else [(n, b) for n in names for b in batch_sizes]
    with open(out_path, "a", encoding="utf-8") as out:
        for name, batch in jobs:
            cmd = [sys.executable, __file__, "--one", name, "--steps", str(steps)]
            if FACTORY_ON_CHIP:
                cmd.append("--factory-on-chip")
            if batch is not None:
                cmd += ["--batch-size", str(batch)]
            for attempt in range(2):   # the chip can refuse a program started just after another
                started = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                rows = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
                if rows and "lockfile" not in rows[-1]:
                    break
                time.sleep(5)
            if not rows:
                rows = [json.dumps({"program": name, "batch_size": batch, "ok": False,
                                    "error": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"})]
            row = json.loads(rows[-1])
            row["wall_seconds"] = round(time.perf_counter() - started, 1)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(name, batch, row.get("ok"), row.get("chip_peak_bytes"), row.get("memory_analysis"),
                  row.get("error", "")[:200], flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", default=None)
    parser.add_argument("--programs", default=",".join(PROGRAMS),
                        help="suite program names, `path.py:factory` targets, or `layouts`, comma-separated")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--batch-sizes", default="")
    parser.add_argument("--out", default="chip.jsonl")
    parser.add_argument("--factory-on-chip", action="store_true")
    args = parser.parse_args()
    global FACTORY_ON_CHIP
    FACTORY_ON_CHIP = args.factory_on_chip
    if args.one:
        return child(args.one, args.steps, args.batch_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    names = [n for n in args.programs.split(",") if n]
    if sizes and args.programs == parser.get_default("programs"):
        names = ["batch_example"]
    return parent(names, args.steps, args.out, sizes)


if __name__ == "__main__":
    sys.exit(main())
