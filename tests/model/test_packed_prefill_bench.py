"""`bench/packed_prefill.py` at tiny shapes: the figures' structure, not their values."""

from __future__ import annotations


def test_measure_times_both_layouts_of_each_batch(bench_modules):
    with bench_modules("layerwise", "packed_prefill") as (layerwise, module):
        tiny = layerwise.TINY
        r = module.measure(tiny, module.TINY_BATCHES, repeats=1)
    agentic, even = r["batches"]["agentic"], r["batches"]["even"]
    assert agentic["real_tokens"] == 50 and agentic["padded_rows"] == 4 * 64
    assert agentic["packed_rows"] == 64 and even["packed_rows"] is None
    for b in r["batches"].values():
        assert b["max_logit_diff"] < 1e-4 and all(t > 0 for t in b["seconds"].values())
    cost = agentic["layer_cost"]
    assert cost["packed"]["flops"] < cost["padded"]["flops"]
