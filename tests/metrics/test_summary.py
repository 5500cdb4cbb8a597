"""`metrics.summary`: the distributions and the TTFT breakdown of `summary.json`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dualpath_jax.metrics.summary import dist, max_over_avg, summarize
from dualpath_jax.results import RoundResult


def test_dist_drops_missing_and_non_finite_values():
    vals = [3.0, None, math.nan, 1.0, math.inf, 2.0, -math.inf, 4.0]
    got = dist(iter(vals))
    kept = np.array([3.0, 1.0, 2.0, 4.0])
    want = dict(zip(("p50", "p90", "p99"), np.percentile(kept, [50, 90, 99])), mean=kept.mean())
    assert got == pytest.approx(want, rel=0, abs=0)
    assert dist(vals) == got  # a list or any iterable
    assert dist([None, math.nan]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def _result(i: int, read_s: float) -> RoundResult:
    return RoundResult(
        request=f"r{i}",
        tokens=range(3),
        ttft_s=1.0 + i,
        ttst_s=0.1,
        tpot_s=0.05,
        jct_s=2.0 + i,
        queue_s=0.2,
        cached_tokens=64,
        prompt_tokens=100,
        read_path="pe",
        recomputed_blocks=0,
        read_s=read_s,
        prefill_s=0.5,
    )


def test_ttft_breakdown_prefers_first_token_events_and_skips_unreached_rounds():
    results = [_result(0, 0.3), _result(1, math.nan), _result(2, 0.7)]
    kw = dict(policy="dualpath", mode="offline", emulated=True, agents=1, errors=0, jct_s=5.0)
    s = summarize(results=results, reports=[], **kw)
    assert s["ttft_breakdown_s"]["kv_read"]["mean"] == pytest.approx(0.5)
    events = [{"kind": "first_token", "request": "r1", "read_s": 0.2, "prefill_s": 0.5}]
    s = summarize(results=results, reports=[], events=events, **kw)
    assert s["ttft_breakdown_s"]["kv_read"]["mean"] == pytest.approx(0.4)
    assert s["round_jct_s"]["mean"] == pytest.approx(3.0)


def test_max_over_avg_weighs_windows_by_bytes():
    s = {"a": [(0.0, 10.0), (1.0, 1.0)], "b": [(0.0, 10.0)]}
    assert max_over_avg(s) == pytest.approx(11 / 10.5)
    assert max_over_avg(s, weighted=False) == pytest.approx(1.5)
