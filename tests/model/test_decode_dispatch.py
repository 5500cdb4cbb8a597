"""`bench/decode_dispatch.py` at a tiny size: the figures' structure, not their values."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # a benchmark script's run: the full tier
def test_measure_reports_the_dispatch_and_its_parts(bench_modules):
    with bench_modules("decode_dispatch") as (module,):
        r = module.measure(layers=3, steps=4, slots=2)
    assert (r["layers"], r["slots"]) == (3, 2)
    for key in (
        "dispatch_ms",
        "launch_ms",
        "step_ms",
        "per_layer_dispatch_ms",
        "per_layer_step_ms",
    ):
        assert r[key] > 0, key
    assert abs(r["host_ms"] - (r["dispatch_ms"] - r["launch_ms"])) < 1e-9
