"""The user holds arrays until a program cannot be loaded: its temporaries' reservation no
longer fits at the bottom of memory (E0101 on a TPU v5e). The post-mortem must name the program,
its reservation, and the held arrays' lines and bytes.

    jaxmem record --out e0101 -- python benchmarks/recording/hold_then_load.py 14
"""
import sys

import jax
import jax.numpy as jnp

GiB = 1 << 30


def hold(gib: int) -> list:
    return [jnp.ones((GiB // 4,), jnp.float32) for _ in range(gib)]  # 1 GiB each, held


@jax.jit
def sorted_noise(key):
    x = jax.random.normal(key, (GiB // 4,), jnp.float32)  # 1 GiB of temporaries and more for the sort
    return jnp.sort(x)[:8]


def main(gib: int) -> None:
    held = hold(gib)
    jax.block_until_ready(held)
    print("holding", len(held), "GiB")
    print(sorted_noise(jax.random.key(0)))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 14)
