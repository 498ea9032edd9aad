"""`python -m jaxmem.xla.tpu`: the deviceless XLA:TPU compile child (`compile.main`)."""

import sys

from jaxmem.xla.tpu.compile import main

sys.exit(main())
