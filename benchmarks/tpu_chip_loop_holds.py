"""What a user's loop holds beside the step, on a TPU v5e: `eval/linen_lm_remat_dropout` (no
donation, 161 MB of state) run 3 steps three ways, each in a fresh process (the chip's peak
counters only grow): as its `run` is written (its parameter keeps the first state alive, and
nothing waits between steps), with the first state released, and released with each step waited
for. The chip's peak in use against the state's bytes says how many states the loop held.

    . benchmarks/tpu_chip_setup.sh
    python3 benchmarks/tpu_chip_loop_holds.py > $OUT/loop_holds.jsonl
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "framework_steps"))
sys.path.insert(0, HERE)
NAME = "eval/linen_lm_remat_dropout"


def child(way: str) -> None:
    import jax

    from steps import load
    from tpu_chip_frameworks import place

    module = load(NAME)
    device = jax.devices()[0]
    with jax.default_device(jax.devices("cpu")[0]):
        built = module.build()
    holder = [place(built, device)]
    del built
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(holder[0][0]) if isinstance(x, jax.Array))
    if way == "as written":
        module.run(holder[0], 3)
    else:
        state, tokens, rng = holder.pop()
        for _ in range(3):
            rng, step_rng = jax.random.split(rng)
            state, loss = module.train_step(state, tokens, step_rng)
            if way == "released, each step waited for":
                jax.block_until_ready(state)
        jax.block_until_ready(state)
    stats = device.memory_stats()
    print(json.dumps({"program": NAME, "loop": way, "state_bytes": state_bytes,
                      "peak_bytes_in_use": stats["peak_bytes_in_use"],
                      "peak_bytes_reserved": stats.get("peak_bytes_reserved", 0),
                      "states_held_at_peak": round(stats["peak_bytes_in_use"] / state_bytes, 2)}), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        child(sys.argv[2])
        return
    for way in ("as written", "released", "released, each step waited for"):
        proc = subprocess.run([sys.executable, __file__, "--one", way], capture_output=True, text=True, timeout=500)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        print(lines[-1] if lines else json.dumps({"loop": way, "error": proc.stderr.strip()[-300:]}), flush=True)


if __name__ == "__main__":
    main()
