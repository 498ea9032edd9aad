"""Install or show the deviceless compilers (XLA:GPU, XLA:TPU) matching the installed JAX.

    jaxmem compilers install            # JAX's CUDA plugin with ptxas, and libtpu (about 1 GB)
    jaxmem compilers install --gpu      # only the CUDA plugin
    jaxmem compilers status             # what is there, for which JAX, and where

They go to a folder of jaxmem's own (`~/.cache/jaxmem/compilers/jax-<version>-<python>`,
under `$JAXMEM_HOME` where that is set), not into this Python's packages: JAX itself never
loads them; only jaxmem's compiles for `--device h100-80gb`, `--device tpu-v5e-16gb` and the
like do. Installing JAX of another version later needs its own install.
"""

from __future__ import annotations

import argparse
from typing import Any

from jaxmem.cli import OneLineParser


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").strip().splitlines()
    parser = OneLineParser(prog="jaxmem compilers", description=doc[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(doc[1:]))
    parser.add_argument("action", choices=("install", "status"), help="install them, or show what is there")
    parser.add_argument("--gpu", action="store_true", help="only XLA:GPU (JAX's CUDA plugin, ptxas)")
    parser.add_argument("--tpu", action="store_true", help="only XLA:TPU (libtpu)")
    parser.add_argument("--force", action="store_true", help="install again even where the right versions are there")
    return parser


def describe(state: dict[str, Any]) -> list[str]:
    """The lines `status` prints for `compilers.status()`'s dictionary.

    >>> describe({"jax": "0.9.2", "jaxlib": "0.9.2", "python": "cp311", "folder": "/c",
    ...           "compilers": {"gpu": {"name": "XLA:GPU", "package": "jax-cuda12-plugin",
    ...                                 "where": None, "version": None, "needs": "0.9.2"}}})
    ['JAX 0.9.2 (jaxlib 0.9.2), cp311; compilers folder: /c', 'XLA:GPU: jax-cuda12-plugin==0.9.2 not installed (jaxmem compilers install)']
    """
    from jaxmem.xla.compilers import INSTALL_COMMAND

    lines = [f"JAX {state['jax']} (jaxlib {state['jaxlib']}), {state['python']}; compilers folder: {state['folder']}"]
    for row in state["compilers"].values():
        if row["where"] is None:
            lines.append(f"{row['name']}: {row['package']}=={row['needs']} not installed ({INSTALL_COMMAND})")
        else:
            place = "this Python's packages" if row["where"] == "environment" else row["where"]
            lines.append(f"{row['name']}: {row['package']} {row['version']} in {place}")
    return lines


def main(argv: list[str]) -> int:
    from jaxmem.xla import compilers

    args = _parser().parse_args(argv)
    if args.action == "status":
        print("\n".join(describe(compilers.status())))
        return 0
    kinds = [k for k, chosen in (("gpu", args.gpu), ("tpu", args.tpu)) if chosen] or list(compilers.KINDS)
    print(f"jaxmem compilers: installing {', '.join(compilers.COMPILERS[k].name for k in kinds)} "
          f"for JAX {compilers.jax_versions()[0]} into {compilers.folder()}", flush=True)
    state = compilers.install_compilers(kinds, force=args.force)
    if not state["installed"]:
        print("jaxmem compilers: already installed")
    print("\n".join(describe(state)))
    return 0
