"""Allocation traces: one plain-data schema (`model`), readers and writers per format, and replay.

    from jaxmem.traces.readers import load_trace
    from jaxmem.traces.replay import replay

    trace = load_trace("memory.pickle")                   # snapshot, Chrome trace, RMM CSV, jaxmem
    report = replay(trace, ["caching", "bfc"], capacity=80 << 30)

Modules: model (the schema), readers (load_trace, format sniffing), safe_pickle, torch_snapshot,
chrome, rmm_csv, jaxmem_format, recorded_device (the recorded cudaMalloc addresses), replay.
"""
