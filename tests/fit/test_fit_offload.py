"""Issue 12: offloading residuals to `pinned_host`, judged by XLA:GPU (deviceless H100).

fit tries offload on scan bodies only: `offload_dot_with_no_batch_dims('device', 'pinned_host')`
and `save_and_offload_only_these_names` over the body's carry and its dots, named as fit prints
them. The test compiles a small transformer step written by hand as fit prints each candidate
and reads XLA:GPU's own memory_analysis(): on a scan body the offloaded residuals leave the
device (host temporaries, a device total below the same values saved on the device, FLOPs and
values unchanged) and fit's figure is the hand-written step's; on a layer written in a Python
loop they do not (XLA copies each value out just before it copies it back), which is why fit
does not try offload there."""

from __future__ import annotations

import pytest

GPU_SCRIPT = r"""
import json, linecache, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxmem.compiler.costs import jaxpr_flops
from jaxmem.examples import zoo
from jaxmem.examples.layers import gelu, layernorm
from jaxmem.fitting.judge import Judge, values_equal
from jaxmem.fitting.policy import OFFLOAD, policy_expression, search_policies
from jaxmem.fitting.sites import CARRY_TAG, OFFLOAD_NAMES
from jaxmem.xla.gpu.compile import abstract_args, spec_for, target_config, with_memory
from jaxmem.units import PRESETS
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
from test_fit_policy import SMALL, _scanned, _loop, _lm_by_hand

def analysis(fn, args):
    # XLA:GPU's memory_analysis() of the step as fit's judge compiles it: device total, host temps.
    text = with_memory(target_config(spec_for("h100-80gb")), PRESETS["h100-80gb"])
    topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    structs = abstract_args(args, NamedSharding(mesh, PartitionSpec()))
    s = jax.jit(fn, donate_argnums=(0, 1)).trace(*structs).lower().compile().memory_analysis()
    device = s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes - s.alias_size_in_bytes
    return int(device), int(s.host_temp_size_in_bytes)

def flops(fn, args):
    return jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)

def scan_layers(layer, policy, x, stacked):
    x, _ = jax.lax.scan(jax.checkpoint(lambda c, lp: (layer(c, lp), None), policy=policy), x, stacked)
    return x

def loop_layers(layer, policy, x, per_layer):
    for lp in per_layer:
        x = jax.checkpoint(layer, policy=policy)(x, lp)
    return x

def named_by_hand(policy_name, tags):
    # The scanned step as a user writes fit's named offload: the carry named on the body's first
    # line, each product on a line fit lists named by that line's tag (zoo._block, by hand).
    _, args = _scanned()
    policy = eval(policy_expression(policy_name), {{"jax": jax}})
    name = lambda v, key: checkpoint_name(v, tags[key]) if key in tags else v
    def block(p, x):
        b, s, d = x.shape
        n = SMALL["n_heads"]
        h = layernorm(x, p["ln1"], p["ln1_b"])
        qkv = name(h @ p["qkv"], "qkv").reshape(b, s, 3, n, d // n)
        attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True, implementation="xla")
        x = x + name(attn.reshape(b, s, d) @ p["o"], "o")
        h = layernorm(x, p["ln2"], p["ln2_b"])
        return x + name(gelu(name(h @ p["up"], "down")) @ p["down"], "down")
    def body(carry, lp):
        carry = jax.tree.map(lambda v: checkpoint_name(v, CARRY_TAG), carry)
        return block(lp, carry), None
    def layers(layer, _policy, x, stacked):
        x, _ = jax.lax.scan(jax.checkpoint(body, policy=policy), x, stacked)
        return x
    return _lm_by_hand(_scanned, policy_name, layers)

def row(fn, args, step, a):
    device, host = analysis(step, a)
    return {{"device": device, "host": host, "flops": flops(step, a),
             "equal": bool(values_equal(jax.jit(fn)(*args), jax.jit(step)(*a)))}}

FULL = {full!r}
out = {{}}
for name, example, layers in (("scan", _scanned, scan_layers), ("loop", _loop, loop_layers)):
    fn, args = example()
    out[name] = {{p: row(fn, args, *_lm_by_hand(example, p, layers))
                  for p in (OFFLOAD, "dots_with_no_batch_dims_saveable", "nothing_saveable")[:3 if FULL else 2]}}
if not FULL:
    print(json.dumps(out))
    sys.exit(0)
# fit on the scanned step, a budget nothing meets: offload is compiled however jaxmem plans it.
fn, args = _scanned()
found = search_policies(fn, args, donate=(0, 1), judge=Judge("h100-80gb"), budget=1, reorder=False)
offloads = [c for c in found.candidates if c.policy == OFFLOAD or c.policy.startswith(OFFLOAD_NAMES)]
out["fit"] = [{{"kind": c.kind, "policy": c.policy, "total": c.xla_total_bytes, "code": c.code,
               "dots": [linecache.getline(x.file, x.line) for x in c.dots]}} for c in offloads]
named = next(c for c in offloads if c.policy.startswith(OFFLOAD_NAMES))
# Which of zoo._block's products each tag names, read off the line fit lists for it.
tags = {{}}
for x in named.dots:
    text = linecache.getline(x.file, x.line)
    for key in ("qkv", "o", "down"):
        if f'p["{{key}}"]' in text:
            tags[key] = f"{{x.file.rsplit('/', 1)[-1]}}:{{x.line}}"
out["named_tags"] = tags
out["named_by_hand"] = row(fn, args, *named_by_hand(named.policy, tags))
print(json.dumps(out))
"""


def _check_hand_written(data: dict) -> tuple[dict, dict]:
    scan, loop = data["scan"], data["loop"]
    off, dots = scan["offload_dot_with_no_batch_dims"], scan["dots_with_no_batch_dims_saveable"]
    # On a scan body the same dots are kept, at no more FLOPs, but in host memory.
    assert off["flops"] <= dots["flops"]
    assert off["host"] > 0 and dots["host"] == 0
    assert off["device"] < dots["device"]
    assert off["equal"] and dots["equal"]
    # In a Python loop XLA:GPU keeps each offloaded value on the device until the backward pass:
    # offload is no lower than saving the same dots on the device.
    off, dots = loop["offload_dot_with_no_batch_dims"], loop["dots_with_no_batch_dims_saveable"]
    assert off["device"] >= dots["device"]
    assert off["equal"]
    return scan, loop


@pytest.mark.slow
def test_offload_leaves_the_device_on_a_scan_body_only(run_gpu_script):
    """Written by hand: offload against the same dots saved on the device, on a scan body and on
    a Python loop (four XLA:GPU compiles)."""
    _check_hand_written(run_gpu_script(GPU_SCRIPT.replace("{full!r}", "False")))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_fits_offload_candidates_are_the_hand_written_steps(run_gpu_script):
    """fit's two offload candidates on the scan body, each compiled, against the step written by
    hand as fit prints it (every policy candidate is compiled: several minutes)."""
    data = run_gpu_script(GPU_SCRIPT.replace("{full!r}", "True"))
    scan, _ = _check_hand_written(data)
    # fit tries offload on the scan body only; each figure is the hand-written step's.
    fit = {c["policy"].split(":", 1)[0]: c for c in data["fit"]}
    assert sorted(c["kind"] for c in data["fit"]) == ["scan", "scan"]
    plain = fit["offload_dot_with_no_batch_dims"]
    assert plain["total"] == scan["offload_dot_with_no_batch_dims"]["device"]
    assert "jax.lax.scan(jax.checkpoint(" in plain["code"] and "'pinned_host'" in plain["code"]
    # The named offload: the carry and every dot line named, in host memory, nothing saved on
    # the device: the hand-written step (named as printed) compiles to fit's figure, with the
    # same values, below nothing_saveable's total at nothing_saveable's FLOPs or fewer.
    named = fit["offload_these_names"]
    assert "save_and_offload_only_these_names(names_which_can_be_saved=[]" in named["code"]
    assert "checkpoint_name(v, 'scan_carry')" in named["code"]
    assert sorted(data["named_tags"]) == ["down", "o", "qkv"]
    by_hand = data["named_by_hand"]
    assert by_hand["device"] == named["total"]
    assert by_hand["equal"] and by_hand["host"] > 0
    assert by_hand["flops"] <= scan["nothing_saveable"]["flops"]


def test_named_policies_keep_only_the_tags_the_candidate_binds():
    """A dot inside the user's own jax.checkpoint in a scan body stays under that checkpoint's
    policy: fit's tagging does not reach it, so its tag is dropped from the policy (and from the
    `checkpoint_name` lines fit prints); the carry and a dot outside it keep theirs."""
    import jax
    import jax.numpy as jnp

    from jaxmem.fitting.policy import _applied, _trace, scan_dot_lines
    from jaxmem.fitting.sites import CARRY_TAG, NAMED_DOTS, OFFLOAD_NAMES, dot_tag

    def inner(x, w):
        return jnp.tanh(x @ w)

    def body(x, w):
        x = jax.checkpoint(inner)(x, w)   # the user's own checkpoint
        return jnp.sin(x @ w), None       # a dot fit can name

    def loss(w, x):
        y, _ = jax.lax.scan(body, x, jnp.stack([w, w]))
        return jnp.sum(y)

    def step(w, x):
        return jax.grad(loss)(w, x)

    args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
    lines = scan_dot_lines(_trace(step, args, ()).closed_jaxpr)
    by_text = {("sin" if "sin" in open(x.file).read().splitlines()[x.line - 1] else "tanh"): dot_tag(x) for x in lines}
    assert sorted(by_text) == ["sin", "tanh"]   # both dot lines are seen in the differentiated step
    name = OFFLOAD_NAMES + ",".join([CARRY_TAG, by_text["tanh"], by_text["sin"]])
    assert _applied(step, args, name, "scan", None, False, 0) == OFFLOAD_NAMES + f"{CARRY_TAG},{by_text['sin']}"
    # Nothing left to name: the candidate is not tried at all.
    assert _applied(step, args, NAMED_DOTS + by_text["tanh"], "scan", None, False, 0) is None
