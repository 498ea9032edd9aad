"""GPT-2 small (the Flax TrainState step of benchmarks/tpu_models/eval/near_limit_gpt2.py) trained
for N steps on random tokens, each step timed; the clean run `jaxmem record` is measured on, and
the same run without it for the recording's overhead.

    python benchmarks/recording/gpt2_train.py --batch 8 --steps 20 --times times.json
    jaxmem record --out gpt2 -- python benchmarks/recording/gpt2_train.py --batch 8 --steps 20
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tpu_models", "eval"))
from near_limit_gpt2 import CTX, GPT2, VOCAB, train_step  # noqa: E402


def build(batch: int):
    model = GPT2()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1))

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((1, CTX), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = jax.jit(init)()
    tokens = jax.random.randint(jax.random.key(1), (batch, CTX + 1), 0, VOCAB, jnp.int32)
    return state, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--times", default=None)
    a = p.parse_args()
    state, tokens = build(a.batch)
    step = jax.jit(train_step, donate_argnums=(0,))
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        state, loss = step(state, tokens)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    result = {"batch": a.batch, "steps": a.steps, "times": times, "loss": float(loss),
              "peak": stats.get("peak_bytes_in_use", 0) + stats.get("peak_bytes_reserved", 0)}
    print(json.dumps({k: v for k, v in result.items() if k != "times"}))
    if a.times:
        with open(a.times, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
