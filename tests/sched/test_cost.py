"""Cost models: FLOP counts, the Hopper roofline, the fitted CPU model, alpha and beta."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_jax.config import HardwareConfig, SchedulerConfig
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.presets import (
    DEEPSEEK_V3_660B,
    DEEPSEEK_V32_660B,
    QWEN25_32B,
    TINY_QWEN2,
    get_gpu,
    make_cost_model,
)
from dualpath_jax.sched.cost import (
    FittedCostModel,
    ModelCost,
    RooflineCostModel,
    derive_alpha,
    derive_alpha_beta,
    derive_beta,
    summed_keys,
)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(0, 300), st.integers(0, 400))
def test_summed_keys_matches_brute_force(cached, bsz, limit):
    want = sum(min(cached + j, limit) if limit else cached + j for j in range(1, bsz + 1))
    assert summed_keys(cached, bsz, limit) == want


def test_gqa_counts_for_qwen25_32b():
    c = ModelCost.from_model(QWEN25_32B)
    assert c.pair_flops == 4 * 40 * 128  # QK^T + PV per head
    assert c.kv_bytes(1) == 262_144  # 64 layers x 2 x 8 heads x 128 x 2 B
    assert c.active_params == pytest.approx(32.0e9, rel=0.03)  # dense: active == total
    assert c.active_params == pytest.approx(c.total_params - 152064 * 5120, rel=1e-9)


def test_mla_moe_counts_for_deepseek_v3():
    c = ModelCost.from_model(DEEPSEEK_V3_660B, "fp8_flashmla")
    assert c.pair_flops == 2 * 128 * (512 + 64) + 2 * 128 * 512  # absorbed MLA
    assert c.kv_bytes(1) == 61 * 656
    # Published: 671B total, 37B activated (both with the embedding; no MTP module here).
    assert c.total_params == pytest.approx(671e9, rel=0.02)
    assert c.active_params + 129280 * 7168 == pytest.approx(37.5e9, rel=0.03)
    assert c.topk == 0


def test_sparse_attention_caps_keys_and_adds_the_indexer():
    dense = ModelCost.from_model(DEEPSEEK_V3_660B)
    sparse = ModelCost.from_model(DEEPSEEK_V32_660B)
    assert sparse.topk == 2048 and sparse.index_pair_flops == 2 * 64 * 128
    # Below top-k, only the indexer differs; far beyond it, main attention stops growing.
    short = sparse.attention_flops(1000, 10) - dense.attention_flops(1000, 10)
    assert short == pytest.approx(61 * sparse.index_pair_flops * summed_keys(1000, 10))
    per_query = sparse.attention_flops(100_000, 1) / 61
    assert per_query == pytest.approx(2048 * sparse.pair_flops + 100_001 * sparse.index_pair_flops)


def test_roofline_h200_and_monotonicity():
    gpu = get_gpu("H200")
    m = RooflineCostModel(ModelCost.from_model(QWEN25_32B), gpu)
    assert m.flops_per_s == pytest.approx(790e12, rel=1e-3)
    assert m.bytes_per_s == pytest.approx(4.3e12, rel=1e-3)
    # Decode of one sequence is memory bound: ~64 GB of weights at 4.3 TB/s.
    assert m.decode_step_time(1, 1000) == pytest.approx(
        m.model.weight_bytes / 4.3e12 + 1000 * 262_144 / 4.3e12, rel=1e-6
    )
    # Prefill of 8k new tokens is compute bound: ~2 * 32B * 8k FLOPs.
    t = m.prefill_time([(0, 8192)])
    assert t == pytest.approx(m.model.prefill_flops(0, 8192) / 790e12, rel=1e-3)
    times = [m.prefill_time([(c, n)]) for c, n in [(0, 100), (0, 200), (5000, 200), (50000, 200)]]
    assert times == sorted(times)
    assert m.attention_time([(32000, 429)]) < m.prefill_time([(32000, 429)])
    with pytest.raises(KeyError, match="unknown GPU"):
        get_gpu("a100x")


def test_fitted_model_recovers_coefficients_and_round_trips():
    rng = np.random.default_rng(0)
    true_p, true_d = (0.02, 3e-5, 4e-9), (0.005, 1e-4, 2e-8)
    ps = []
    for _ in range(60):
        c, n = int(rng.integers(0, 4000)), int(rng.integers(1, 500))
        t = true_p[0] + true_p[1] * n + true_p[2] * summed_keys(c, n)
        ps.append((c, n, t * (1 + 0.01 * rng.standard_normal())))
    ds = []
    for _ in range(60):
        b, ctx = int(rng.integers(1, 16)), int(rng.integers(1, 4000))
        ds.append((b, ctx, true_d[0] + true_d[1] * b + true_d[2] * b * ctx))
    m = FittedCostModel.fit(ps, ds)
    assert m.prefill == pytest.approx(true_p, rel=0.1)
    assert m.decode == pytest.approx(true_d, rel=1e-6)
    assert FittedCostModel.from_json(m.to_json()) == m
    assert m.attention_time([(100, 10)]) == pytest.approx(m.prefill[2] * summed_keys(100, 10))
    with pytest.raises(ValueError, match="not a FittedCostModel"):
        FittedCostModel.from_json('{"prefill": [1]}')


def test_fit_keeps_coefficients_non_negative():
    # Times that fall with the token count would need a negative slope; it is clipped to 0.
    m = FittedCostModel.fit([(0, 10, 1.0), (0, 20, 0.9), (0, 30, 0.8)])
    assert all(v >= 0 for v in m.prefill)


def test_make_cost_model_picks_roofline_or_fitted():
    hw = HardwareConfig(gpu="h800")
    assert isinstance(make_cost_model(hw, QWEN25_32B), RooflineCostModel)
    with pytest.raises(ValueError, match="FittedCostModel"):
        make_cost_model(HardwareConfig(gpu="cpu"), TINY_QWEN2)
    fitted = FittedCostModel((0.0, 1e-4, 0.0))
    assert make_cost_model(HardwareConfig(gpu="cpu"), TINY_QWEN2, fitted=fitted) is fitted


def test_alpha_is_three_seconds_of_the_storage_link():
    hw = HardwareConfig(snic_bytes_per_s=50e9)
    kvb = kv_bytes_per_token(DEEPSEEK_V32_660B, "fp8_flashmla")
    assert derive_alpha(SchedulerConfig(), hw, kvb) == pytest.approx(3 * 50e9 / 40_016)
    assert derive_alpha(SchedulerConfig(alpha_tokens=123.0), hw, kvb) == 123.0
    assert derive_alpha(SchedulerConfig(), HardwareConfig(), kvb) == math.inf


def test_beta_is_five_seconds_of_prefill():
    cost = FittedCostModel(prefill=(0.0, 1e-3, 0.0))  # 1 ms per new token, no attention
    # Any batch: 100 new tokens per request -> 0.1 s per request of 1100 tok_e tokens.
    beta = derive_beta(SchedulerConfig(), cost, ref_cached=1000, ref_new=100)
    assert beta == pytest.approx(5 * 1100 / 0.1)
    assert derive_beta(SchedulerConfig(beta_tokens=7.0), cost, ref_cached=1, ref_new=1) == 7.0
    roof = make_cost_model(HardwareConfig(gpu="h200"), DEEPSEEK_V32_660B, weight_shards=16)
    a, b = derive_alpha_beta(
        dataclasses.replace(SchedulerConfig()),
        HardwareConfig(gpu="h200", snic_bytes_per_s=50e9),
        roof,
        kv_bytes_per_token=40_016,
        ref_cached=32721,
        ref_new=429,
    )
    assert a == pytest.approx(3 * 50e9 / 40_016)
    # Tens of requests of ~33k tokens per 5 s on one H200 (prefill of 429 new tokens is cheap).
    assert 1e5 < b < 1e8
