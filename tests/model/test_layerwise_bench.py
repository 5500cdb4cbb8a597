"""`bench/layerwise.py` at tiny shapes: the figures' structure, not their values."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # a benchmark script's run: the full tier
def test_measure_times_every_variant_and_bounds_the_overlap(bench_modules):
    with bench_modules("layerwise") as (module,):
        r = module.measure(module.TINY, repeats=1)
    assert set(r["seconds"]) == {"resident", "program", "loop", "copy_pinned", "copy_pageable"}
    assert all(v > 0 for v in r["seconds"].values())
    assert r["kv_bytes"] > 0
    for key in ("program_overlap", "loop_overlap"):
        assert 0.0 <= r[key] <= 1.0
    t = r["seconds"]
    assert r["program_vs_resident"] == t["program"] / t["resident"]
    assert module._overlap(2.0, 1.0, 4.0) == 0.75 and module._overlap(9.0, 1.0, 4.0) == 0.0
