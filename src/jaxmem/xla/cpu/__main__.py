"""`python -m jaxmem.xla.cpu`: the XLA:CPU compile child (`compile.main`)."""

import sys

from jaxmem.xla.cpu.compile import main

sys.exit(main())
