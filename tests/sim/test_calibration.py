"""The Hopper roofline reproduces the published serving numbers it is calibrated to, its parts
behave as the hardware does, and the paper's clusters are sized consistently."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_jax.config import SchedulerConfig
from dualpath_jax.presets import (
    DEEPSEEK_V3_660B,
    DEEPSEEK_V3_SERVING,
    DEEPSEEK_V32_660B,
    HOPPER_NODE,
    PAPER_MODELS,
    QWEN25_32B,
    calibrate,
    get_gpu,
    hopper_calibration,
    make_cost_model,
    paper_cost_model,
    paper_experiment,
)
from dualpath_jax.sched.cost import ModelCost, RooflineCostModel
from dualpath_jax.sched.intra import PendingPrefill, PrefillQueue


def _ds_v3_prefill_per_node(cost) -> float:
    """Prompt tokens/s of one 8-GPU node on DeepSeek's published workload, packed into forward
    batches under the compute quota as the prefill engines pack them."""
    pub = DEEPSEEK_V3_SERVING
    cached = round(pub.hit_rate * pub.context_tokens)
    new = pub.context_tokens - cached
    q = PrefillQueue()
    for i in range(64):
        q.add(PendingPrefill(str(i), cached, new))
    quota = SchedulerConfig().compute_quota_ms / 1e3
    plan = q.next_batch(cost.attention_time, quota)
    pairs = plan.pairs
    # A chunked request counts the prompt tokens its new tokens stand for.
    tokens = sum(b for _, b in pairs) * pub.context_tokens / new
    return pub.gpus_per_node * tokens / cost.prefill_time(pairs)


def test_roofline_predicts_deepseeks_published_prefill_throughput():
    # 73.7k prompt tokens/s per H800 node (56.3% cache hits); tolerance 5%: the calibration
    # is solved for one request, the engines pack quota-sized batches.
    cost = make_cost_model(HOPPER_NODE, DEEPSEEK_V3_660B, expert_parallel=32)
    assert _ds_v3_prefill_per_node(cost) == pytest.approx(73.7e3, rel=0.05)
    # An uncalibrated roofline (peak GEMM efficiency) would claim several times that.
    peak = dataclasses.replace(cost, prefill_efficiency=0.0)
    assert _ds_v3_prefill_per_node(peak) > 2.5 * 73.7e3


def test_calibrated_constants_are_physical():
    cal = hopper_calibration()
    assert 0.1 < cal.prefill_efficiency < 0.6  # end-to-end fraction of FP8/BF16 peak
    # Decode at the published point: 1 / 21 tokens/s per user per step; the overhead is what the
    # roofline does not see, a part of the step and never all of it.
    assert 0.0 < cal.decode_overhead_s < 1 / 21
    cost = make_cost_model(HOPPER_NODE, DEEPSEEK_V3_660B, expert_parallel=144)
    batch = round(14.8e3 / 8 / 21)
    assert cost.decode_step_time(batch, 4989) == pytest.approx(1 / 21, rel=0.02)
    # Calibrating against the same numbers on BF16 GEMMs needs a higher efficiency.
    assert calibrate(fp8=False).prefill_efficiency > cal.prefill_efficiency


def test_dense_mla_prefill_takes_the_cheaper_mha_form():
    m = ModelCost.from_model(DEEPSEEK_V3_660B)
    # Many queries over a long context: expanding the latent (MHA form) is cheaper than absorbed.
    assert m.prefill_attention_flops(2809, 2180) < m.attention_flops(2809, 2180) / 2
    # One query (decode): the absorbed form is cheaper and kept.
    assert m.prefill_attention_flops(30000, 1) == m.attention_flops(30000, 1)
    # DSA (V3.2) attends top-k keys in the absorbed form only.
    s = ModelCost.from_model(DEEPSEEK_V32_660B)
    assert s.mha_pair_flops == 0 and s.prefill_attention_flops(2809, 2180) == s.attention_flops(
        2809, 2180
    )


def test_weights_per_gpu_follow_expert_parallelism_and_fp8():
    m = ModelCost.from_model(DEEPSEEK_V3_660B)
    gpu = get_gpu("h800")
    one = RooflineCostModel(m, gpu, fp8=True)
    assert one.weight_bytes_per_gpu == pytest.approx(m.total_params)  # 1 byte per parameter
    ep = RooflineCostModel(m, gpu, fp8=True, expert_parallel=32)
    dense = m.total_params - m.routed_expert_params
    assert ep.weight_bytes_per_gpu == pytest.approx(dense + m.routed_expert_params / 32)
    assert 30e9 < ep.weight_bytes_per_gpu < 45e9  # fits an 80 GB H800 with room for KV
    assert RooflineCostModel(m, gpu).weight_bytes_per_gpu == pytest.approx(2 * m.total_params)
    # Decode streams fewer weights per step as experts spread over more GPUs.
    assert ep.decode_step_time(8, 4096) < one.decode_step_time(8, 4096)


@pytest.mark.parametrize("key", sorted(PAPER_MODELS))
def test_paper_clusters_are_sized_consistently(key):
    cfg, cost = paper_experiment(key, agents=4)
    m = PAPER_MODELS[key]
    assert (cfg.cluster.prefill_nodes, cfg.cluster.decode_nodes) == (
        m.prefill_nodes,
        m.decode_nodes,
    )
    assert cfg.hardware.engines_per_node == 8 and cfg.hardware.snic_bytes_per_s == 50e9
    assert cfg.hardware.hbm_bytes == pytest.approx(cost.kv_hbm_bytes())
    assert cost.weight_bytes_per_gpu + cost.kv_hbm_bytes() <= get_gpu(m.gpu).hbm_bytes
    assert cfg.hardware.dram_buffer_bytes * 8 == m.dram_buffer_bytes
    assert cost == paper_cost_model(key, m.decode_nodes)
    # Qwen 32B runs data parallel in BF16: the whole model on every GPU.
    if key == "qwen32b":
        assert cost.weight_bytes_per_gpu == pytest.approx(
            ModelCost.from_model(QWEN25_32B).weight_bytes
        )


def test_v32_prefill_at_the_64k_trace_is_compute_heavier_than_v3_at_deepseeks_workload():
    # Per new token, DSA's indexer over 32.7k cached keys costs more than the 5k-token workload
    # the calibration comes from, so new tokens/s per GPU fall (the paper's PEs are compute bound).
    v3 = make_cost_model(HOPPER_NODE, DEEPSEEK_V3_660B, expert_parallel=32)
    v32 = paper_cost_model("ds660b", 4)
    new_v3 = v3.prefill_tokens_per_s(2809, 2180, 4) * 2180 / 4989
    new_v32 = v32.prefill_tokens_per_s(32721, 429, 16) * 429 / 33150
    assert new_v32 < new_v3


def test_decode_overhead_is_paid_per_moe_layer():
    """The calibrated step overhead (expert-parallel dispatch/combine) scales with MoE layers:
    DeepSeek-V3 and V3.2 (58 each) pay all of it, DS 27B (29) half, dense Qwen none; a
    simulation's default cost model and `paper_cost_model` agree for every paper model."""
    from dualpath_jax.sim.run import default_cost

    cal = hopper_calibration()
    assert cal.moe_layers == 58
    overhead = {
        k: paper_cost_model(k, PAPER_MODELS[k].decode_nodes).decode_overhead_s for k in PAPER_MODELS
    }
    assert overhead["ds660b"] == pytest.approx(cal.decode_overhead_s)
    assert overhead["ds27b"] == pytest.approx(cal.decode_overhead_s * 29 / 58)
    assert overhead["qwen32b"] == 0.0
    for key in PAPER_MODELS:
        cfg, cost = paper_experiment(key)
        default = default_cost(cfg, PAPER_MODELS[key].kv_format)
        # (a dense model's expert-parallel width is moot: it has no routed experts to spread)
        assert dataclasses.replace(default, expert_parallel=cost.expert_parallel) == cost
        assert default.weight_bytes_per_gpu == cost.weight_bytes_per_gpu


def test_a_scaled_out_cluster_can_keep_its_units_expert_parallel_group():
    """48P96D as 24 replicated 2P4D groups: the same weights per GPU, HBM for KV and decode step
    as 2P4D; spreading the experts over all 768 decode GPUs halves the weights per GPU."""
    _, unit = paper_experiment("ds660b", 2, 4)
    big_cfg, replicated = paper_experiment("ds660b", 48, 96, ep_decode_nodes=4)
    _, spread = paper_experiment("ds660b", 48, 96)
    assert replicated == unit and big_cfg.cluster.decode_nodes == 96
    assert spread.weight_bytes_per_gpu < 0.6 * unit.weight_bytes_per_gpu
