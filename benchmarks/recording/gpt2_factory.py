"""The step `gpt2_train.py` runs, as a factory for `jaxmem analyze` (batch 8 by default):

    jaxmem analyze benchmarks/recording/gpt2_factory.py:make --device tpu-v5e-16gb --donate 0
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tpu_models", "eval"))
import near_limit_gpt2  # noqa: E402

DONATE = (0,)


def make(batch: int = 8):
    return near_limit_gpt2.make(batch=batch)
