"""A loop that allocates until the device refuses (E0100 on a TPU v5e), and catches the error:
the post-mortem must say what was asked, what was free, and who holds the rest.

    jaxmem record --out e0100 -- python benchmarks/recording/alloc_until_oom.py
"""
import jax
import jax.numpy as jnp

MiB = 1 << 20


def grow(held: list, mib: int) -> None:
    held.append(jnp.full((mib * MiB // 4,), 1.0, jnp.float32))


def main() -> None:
    held: list = []
    small: list = []
    try:
        for i in range(10_000):
            grow(held, 1024)                      # 1 GiB at a time
            if i % 4 == 0:
                grow(small, 64)                   # and a little from another line
            jax.block_until_ready(held[-1])
    except jax.errors.JaxRuntimeError as err:
        print("caught after", len(held), "GiB:", str(err).splitlines()[0][:160])


if __name__ == "__main__":
    main()
