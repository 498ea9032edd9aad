"""`python -m jaxmem` is the `jaxmem` command."""

from jaxmem.cli.main import entry

entry()
