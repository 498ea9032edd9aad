"""`python -m jaxmem.xla.gpu`: the deviceless XLA:GPU compile child (`compile.main`)."""

import sys

from jaxmem.xla.gpu.compile import main

sys.exit(main())
