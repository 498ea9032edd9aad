"""A standard layout (`xla.sharding.layout_specs`) as plain JAX code a user pastes: the mesh, the rule
that picks each array's `PartitionSpec`, and the `jax.device_put` calls. The rule is the one
`layout_specs` applies, written out, so the pasted code lays the arrays out exactly as the layout
jaxmem compiled (a test runs the printed code against `layout_specs`).

>>> print(layout_code("fsdp", {"data": 8}).splitlines()[0])
# FSDP over data on 8 devices: each state array sharded over "data" on its largest dimension that divides;
"""

from __future__ import annotations

_WORDS = {
    "dp": "replicated data parallel on {n} devices: every state array whole on each device;",
    "fsdp": "FSDP over data on {n} devices: each state array sharded over \"data\" on its largest dimension that divides;",
    "fsdp_tp": ("FSDP + tensor parallel on a {shape} mesh: each state array sharded over \"data\" on its largest "
                "dimension that divides, then over \"model\" on its next largest;"),
}

_HELPERS = '''def _largest(shape, parts, skip=None):
    dims = [d for d in range(len(shape)) if d != skip and shape[d] % parts == 0 and shape[d] >= parts]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


def state_sharding(x):
    spec = [None] * len(x.shape)
{state_rule}    return NamedSharding(mesh, P(*spec))


def batch_sharding(x):
    spec = [None] * len(x.shape)
    if spec and x.shape[0] % mesh.shape["data"] == 0:
        spec[0] = "data"
    return NamedSharding(mesh, P(*spec))
'''

_FSDP_RULE = '''    d = _largest(x.shape, mesh.shape["data"]) if spec else None
    if d is not None:
        spec[d] = "data"
'''
_TP_RULE = '''    m = _largest(x.shape, mesh.shape["model"], skip=d) if spec else None
    if m is not None:
        spec[m] = "model"
'''


def layout_code(layout: str, mesh: dict[str, int]) -> str:
    """The code that lays a step's arguments out as `layout` on a mesh of `mesh`'s axis sizes
    (axes "data", and "model" for FSDP + tensor parallel): the state (every argument but the
    last) by the layout's rule, the batch (the last) over "data" on its first dimension."""
    names = tuple(mesh)
    sizes = tuple(mesh.values())
    n = 1
    for v in sizes:
        n *= v
    head = _WORDS[layout].format(n=n, shape="x".join(str(v) for v in sizes))
    rule = "" if layout == "dp" else _FSDP_RULE + (_TP_RULE if layout == "fsdp_tp" else "")
    return "\n".join([
        f"# {head}",
        "# the batch (the step's last argument) over \"data\" on its first dimension.",
        "import jax",
        "from jax.sharding import NamedSharding, PartitionSpec as P",
        "",
        f"mesh = jax.make_mesh({sizes!r}, {names!r})",
        "",
        "",
        _HELPERS.format(state_rule=rule).rstrip(),
        "",
        "",
        "# each argument of the step but the last, then the last:",
        "state = jax.device_put(state, jax.tree.map(state_sharding, state))",
        "batch = jax.device_put(batch, jax.tree.map(batch_sharding, batch))",
    ])


__all__ = ["layout_code"]
