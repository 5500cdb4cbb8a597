"""`bench/sampler.py` at a small vocabulary above the nucleus's top-k: every batch (greedy and
top-p, peaked and flat logits) draws the same tokens in the sampler's earlier form and now."""

from __future__ import annotations


def test_the_sampler_bench_draws_the_same_tokens_both_ways(bench_modules):
    with bench_modules("sampler") as (module,):
        rows = module.run(slots=4, vocab=4096, repeats=1)
    assert [(r["logits"], r["batch"]) for r in rows] == [
        (spread, batch) for spread in ("peaked", "flat") for batch in ("greedy", "t0.8 top-p 0.95")
    ]
    assert all(r["same_tokens"] and r["now_ms"] > 0 for r in rows)
