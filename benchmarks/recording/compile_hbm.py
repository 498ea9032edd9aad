"""A program whose temporaries alone exceed the chip: XLA:TPU refuses it at compile time.

    jaxmem record --out hbm -- python benchmarks/recording/compile_hbm.py hbm_error.txt
"""
import sys

import jax
import jax.numpy as jnp


@jax.jit
def too_big(key):
    x = jax.random.normal(key, (5 << 10, 1 << 20), jnp.float32)  # 20 GiB, sorted row by row
    return jnp.sort(x, axis=-1)[:, :4]


def main(text_out: str | None) -> None:
    try:
        print(too_big(jax.random.key(0)))
    except jax.errors.JaxRuntimeError as err:
        if text_out:
            with open(text_out, "w") as f:
                f.write(str(err))
        raise


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
