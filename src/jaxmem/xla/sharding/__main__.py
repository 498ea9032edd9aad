"""`python -m jaxmem.xla.sharding TARGET --device ...`: the sharded TARGET's compile child."""

import sys

from jaxmem.xla.sharding import main

sys.exit(main())
