"""What a factory leaves on a TPU before the step runs: every program its own code ran there.

A user's script builds its state on the chip (`model.init`, `optax.adam(...).init`, `jnp.ones`,
eager ops one by one); JAX compiles each op or jitted call into a program, and the TPU runtime
keeps each program's code resident from its first call to the end of the process: exactly
XLA:TPU's `generated_code_size_in_bytes` (on a TPU v5e, every one of 24 programs the layout
probe ran grew `bytes_in_use` by its output plus exactly that figure;
benchmarks/results/tpu_v5e_layouts.jsonl). Its temporaries take the one reservation the
runtime holds, the largest any program needed (`runtime/tpu_pool.simulate_tpu_loop`).

`factory_programs` compiles each program the factory ran (recorded as StableHLO while jaxmem
ran the factory on the host, `compiler.jaxpr_adapter.run_recording_programs`) for the chip,
deviceless, and sums what stays.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

from jaxmem.xla.gpu import compile as common

CACHE_PREFIX = "tpu-factory-program v1"


def factory_programs(texts: Sequence[str], device: Any, versions: str) -> dict[str, int]:
    """`{programs, code_bytes, temp_bytes}` of the distinct programs in `texts` compiled for
    `device` (a compile-only TPU chip): their code added up (resident on the chip) and the
    largest temporaries. Each program's figures are cached by its text."""
    from jaxmem.compiler.jaxpr_adapter import compile_text_for

    directory = common.cache_dir()
    code = temp = count = 0
    for text in dict.fromkeys(texts):
        if _takes_no_arguments(text):
            # A program of constants only (`jnp.zeros`, `jnp.ones`) leaves no code on the chip:
            # on a v5e, each of 24 made its array and nothing beside (tpu_v5e_layouts.jsonl).
            continue
        key = hashlib.sha256(f"{CACHE_PREFIX}\n{versions}\n{text}".encode()).hexdigest()
        hit = common.cache_read(directory, key)
        if hit is None:
            try:
                stats = compile_text_for(device, text)
            except Exception:  # a program XLA:TPU refuses (float64, a host callback): not on the chip
                continue
            hit = {"code": int(stats.generated_code_size_in_bytes), "temp": int(stats.temp_size_in_bytes)}
            common.cache_write(directory, key, hit)
        code += hit["code"]
        temp = max(temp, hit["temp"])
        count += 1
    return {"programs": count, "code_bytes": code, "temp_bytes": temp}


def _takes_no_arguments(text: str) -> bool:
    """Whether a StableHLO module's `main` takes no arguments.

    >>> _takes_no_arguments("func.func public @main() -> (tensor<2xf32>)"), _takes_no_arguments("@main(%arg0: tensor<f32>)")
    (True, False)
    """
    return re.search(r"@main\(\s*\)", text) is not None
