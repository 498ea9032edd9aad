"""The report data against brute force over the plan, and the writers that read it back."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import pytest

from jaxmem.compiler.planner import plan as jaxmem_plan
from jaxmem.reports.chrome_trace import write_chrome_trace
from jaxmem.reports.data import from_plan
from jaxmem.reports.html import payload, render_html
from reports_fixtures import naive_plan, train_step_example


def brute_live(plan, x):
    arena = sum(b.size for b in plan.buffers if b.start <= x <= b.end)
    caller = sum(plan.values[v].nbytes for v in plan.invars if plan.values[v].buffer is None)
    return arena + caller


@pytest.fixture(scope="module", params=["naive", "jaxmem"])
def plan(request):
    fn, args = train_step_example()
    if request.param == "naive":
        return naive_plan(fn, *args)
    return jaxmem_plan(fn, *args, donate_argnums=(0, 1, 2), xla=False)


def test_stacked_bytes_equal_brute_force(plan):
    data = from_plan(plan)
    n = len(plan.schedule)
    assert (data.x_min, data.x_max) == (-1, n)
    totals = data.totals
    for x in range(-1, n + 1):
        assert totals[x + 1] == brute_live(plan, x), x
    assert data.peak_bytes == max(totals) == brute_live(plan, data.peak_x)
    assert data.peak_bytes <= plan.peak_bytes


def test_blocks_partition_each_buffer_in_time(plan):
    data = from_plan(plan)
    by_buffer = {}
    for b in data.blocks:
        if b.region == "arena":
            by_buffer.setdefault(b.buffer, []).append(b)
    assert set(by_buffer) == {b.id for b in plan.buffers}
    for buf in plan.buffers:
        parts = sorted(by_buffer[buf.id], key=lambda b: b.start)
        assert parts[0].start == buf.start and parts[-1].end == buf.end
        for a, b in zip(parts, parts[1:]):
            assert a.end + 1 == b.start
        assert all(p.address == buf.offset and p.size == buf.size for p in parts)


def test_html_payload_reads_back(plan):
    data = from_plan(plan)
    page = render_html(data)
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    got = json.loads(m.group(1))
    assert got == json.loads(json.dumps(payload(data)))
    pts = got["points"]
    assert max(pts["total"]) == data.peak_bytes
    assert [sum(col[i] for col in pts["cols"]) for i in range(len(pts["x"]))] == pts["total"]
    drawn = sum(got["blocks"]["size"][i] for i in range(len(got["blocks"]["size"]))
                if got["blocks"]["start"][i] <= data.peak_x <= got["blocks"]["end"][i])
    assert drawn == data.peak_bytes
    assert got["top"][0]["size"] == max(b.size for b in data.live_at(data.peak_x))
    # Self-contained: no external resources of any kind.
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|https?://", page)


def test_chrome_trace_one_counter_series_per_category(plan, tmp_path):
    data = from_plan(plan)
    path = tmp_path / "trace.json"
    write_chrome_trace(path, data)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid"} <= set(e) and e["ph"] in ("C", "X", "M", "i")
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float))
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"live memory"}
    series = set().union(*(e["args"] for e in counters))
    assert series == set(data.categories)
    assert all(isinstance(v, int) for e in counters for v in e["args"].values())
    ts = [e["ts"] for e in counters]
    assert ts == sorted(ts) and len(ts) == len(plan.schedule) + 2
    sums = [sum(e["args"].values()) for e in counters]
    assert sums == [brute_live(plan, x) for x in range(-1, len(plan.schedule) + 1)]


def test_user_names_are_escaped():
    hostile = '</script><script>document.title="pwned"</script><img src=x onerror=alert(1)>'
    src = f"def {'f'}(x):\n    return jnp.tanh(x) * 2\n"
    scope = {"jnp": jnp}
    exec(compile(src, hostile + ".py", "exec"), scope)
    fn = scope["f"]
    fn.__code__ = fn.__code__.replace(co_name="<script>alert(2)</script>", co_qualname="<script>alert(2)</script>")
    plan = naive_plan(fn, jnp.ones((64, 64)))
    data = from_plan(plan, title=hostile)
    assert any(hostile in b.source for b in data.blocks)
    page = render_html(data)
    # The only script elements are the report's own two; the title is text.
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert "<img" not in page and "pwned\"</script>" not in page
    got = json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S).group(1))
    assert any(hostile in row["source"] for row in got["top"])
    assert got["title"] == hostile


def test_aggregates_account_for_every_hidden_block():
    from jaxmem.reports.html import aggregate, split_visible
    from reports_fixtures import synthetic_plan

    data = from_plan(synthetic_plan(5000, 2000, seed=3))
    shown, rest = split_visible(data, max_blocks=500)
    assert len(shown) + len(rest) == len(data.blocks) and len(shown) >= 500
    peak_live = {id(b) for b in data.live_at(data.peak_x)[:40]}
    assert peak_live <= {id(b) for b in shown}
    top = max(b.address + b.size for b in data.blocks)
    agg = aggregate(data, rest, top)
    assert sum(agg["count"]) == len(rest)
    assert sum(agg["bytes"]) == sum(b.size for b in rest)
    # Brute force: each hidden block lies inside the box of some aggregate of its category.
    boxes = list(zip(agg["addr"], agg["size"], agg["start"], agg["end"], agg["cat"]))
    for b in rest[:300]:
        c = data.categories.index(b.category)
        assert any(a <= b.address and b.address + b.size <= a + s and st <= b.start and b.end <= en and k == c
                   for a, s, st, en, k in boxes)
    assert all(0 < f <= 1 for f in agg["fill"])


def test_arguments_are_labelled_by_pytree_path():
    import jax

    fn, args = train_step_example()
    plan = naive_plan(fn, *args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    data = from_plan(plan, arg_paths=paths)
    labels = {b.label for b in data.blocks if b.region == "caller"}
    assert labels == set(paths)
    assert {b.category for b in data.blocks if b.region == "caller" and b.label.startswith("[1]")} == {"optimizer_state"}


from hypothesis import given, settings, strategies as st

from jaxmem.compiler.plan_types import Plan, PlannedBuffer, Step, ValueInfo
from jaxmem.reports.categories import CATEGORIES


@st.composite
def random_plans(draw):
    """Plans of random shape: buffers held by one to three values in turn (as aliasing and
    donation make them), steps reading random earlier values, some arguments in the caller."""
    n = draw(st.integers(1, 25))
    steps = [Step(i, None, draw(st.sampled_from(["add", "mul", "dot_general"])), [], []) for i in range(n)]
    values, buffers, invars, vid = {}, [], [], 0
    for bid in range(draw(st.integers(0, 12))):
        start = draw(st.integers(-1, n - 1))
        end = draw(st.integers(start, n))
        lo = max(start, 0)
        defs = sorted(draw(st.lists(st.integers(lo, max(lo, min(end, n - 1))), min_size=1, max_size=3)))
        size = draw(st.integers(1, 64)) * 256
        vals = []
        for k, d in enumerate(defs):
            producer = None if (k == 0 and start == -1) else d
            values[vid] = ValueInfo(vid, (size // 4,), "float32", size, producer, bid)
            if producer is None:
                invars.append(vid)
            else:
                steps[producer].outputs.append(vid)
            vals.append(vid)
            vid += 1
        buffers.append(PlannedBuffer(bid, draw(st.integers(0, 64)) * 256, size, start, end, vals, "temp"))
    for _ in range(draw(st.integers(0, 3))):
        values[vid] = ValueInfo(vid, (4,), "float32", 16 * draw(st.integers(1, 9)), None, None)
        invars.append(vid)
        vid += 1
    for step in steps:
        earlier = [v for v, info in values.items() if info.producer is None or info.producer < step.index]
        step.operands = draw(st.lists(st.sampled_from(earlier), max_size=3)) if earlier else []
    produced = [v for v, info in values.items() if info.producer is not None]
    outvars = draw(st.lists(st.sampled_from(produced), max_size=3, unique=True)) if produced else []
    arena = max((b.offset + b.size for b in buffers), default=0)
    return Plan(arena, arena, 0, 0, 0, 0, steps, buffers, values, invars, outvars)


@settings(max_examples=150, deadline=None)
@given(random_plans())
def test_random_plans_blocks_and_totals(plan):
    data = from_plan(plan)
    n = len(plan.schedule)
    for x in range(-1, n + 1):
        assert data.totals[x + 1] == brute_live(plan, x)
    assert all(b.category in CATEGORIES for b in data.blocks)
    for buf in plan.buffers:
        parts = sorted((b for b in data.blocks if b.region == "arena" and b.buffer == buf.id), key=lambda b: b.start)
        assert parts[0].start == buf.start and parts[-1].end == buf.end
        assert all(a.end + 1 == b.start for a, b in zip(parts, parts[1:]))
    caller = [b for b in data.blocks if b.region == "caller"]
    assert sum(b.size for b in caller) == sum(plan.values[v].nbytes for v in plan.invars if plan.values[v].buffer is None)


def test_gpt_blocks_name_their_user_source_line():
    from jaxmem.examples.gpt import make_train_step

    fn, args = make_train_step(n_layers=1, d_model=64, n_heads=2, seq=16, batch=2, vocab=512)
    data = from_plan(jaxmem_plan(fn, *args, xla=False))
    made = [b for b in data.blocks if b.region == "arena" and b.start >= 0 and b.label not in ("scratch", "temp")]
    # Steps inlined from jitted library functions (log_softmax) take their call site's line.
    assert sum(1 for b in made if "examples/" in b.source) >= 0.95 * len(made)
    assert all("/jax/" not in f[0] for b in data.blocks for f in b.frames)


def test_chrome_trace_named_json_gz_is_gzipped(plan, tmp_path):
    import gzip

    data = from_plan(plan)
    write_chrome_trace(tmp_path / "trace.json", data)
    write_chrome_trace(tmp_path / "trace.json.gz", data)
    assert gzip.decompress((tmp_path / "trace.json.gz").read_bytes()) == (tmp_path / "trace.json").read_bytes()
