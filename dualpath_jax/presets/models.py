"""Model presets: CPU-sized tiny models for tests and demos, full-size specs for sizing.

Tiny models, one per family: `tiny-qwen2`, `tiny-qwen3`, `tiny-qwen3-moe`, `tiny-deepseek`
(DeepSeek-V3) and `tiny-deepseek-v2`.

The full-size specs (`qwen2.5-32b`, `deepseek-v3-660b`, `deepseek-v3.2-660b`, `ds-27b`) feed the
cost models, the analysis tools and the simulator; they are never instantiated as arrays.
`get_preset(name)` looks them up (also `dualpath_jax.model.get_preset`).

Sizing-only presets (`GPT_OSS_120B`, `QWEN3_235B_A22B`: Table 1 rows that no other part of the
project runs) feed `sched.cost.ModelCost` through `presets.calibration.sizing_cost(name)` only.
Dimensions are from the models' public configurations (Hugging Face `config.json`). This module
imports nothing of the package but `config`: the model namespace (`dualpath_jax.model`) and the
layers beneath the cost models may take these presets.
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.config import ModelConfig, ModelFamily

TINY_QWEN2 = ModelConfig(
    name="tiny-qwen2",
    family=ModelFamily.QWEN2,
    vocab_size=257,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    max_seq_len=8192,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    qkv_bias=True,
)

TINY_DEEPSEEK = ModelConfig(
    name="tiny-deepseek",
    family=ModelFamily.DEEPSEEK,
    vocab_size=257,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=4,
    head_dim=24,
    intermediate_size=96,
    max_seq_len=8192,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    qkv_bias=False,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    n_group=2,
    topk_group=1,
)

TINY_QWEN3 = ModelConfig(
    name="tiny-qwen3",
    family=ModelFamily.QWEN3,
    vocab_size=257,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=24,  # explicit, not hidden / heads, as in Qwen3
    intermediate_size=96,
    max_seq_len=8192,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    qkv_bias=False,
    qk_norm=True,
)

# Qwen3-MoE: softmax routing over all experts; layer 1 is dense (mlp_only_layers).
TINY_QWEN3_MOE = dataclasses.replace(
    TINY_QWEN3,
    name="tiny-qwen3-moe",
    family=ModelFamily.QWEN3_MOE,
    num_layers=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    dense_layers=(1,),
    moe_scoring="softmax",
    topk_method="greedy",
    norm_topk_prob=True,
)

# DeepSeek-V2-Lite-shaped: no query LoRA, softmax routing limited to the best expert group,
# and yarn RoPE (factor 4 over 2,048 positions, with V2's mscale 0.707).
TINY_DEEPSEEK_V2 = dataclasses.replace(
    TINY_DEEPSEEK,
    name="tiny-deepseek-v2",
    family=ModelFamily.DEEPSEEK_V2,
    q_lora_rank=0,
    routed_scaling_factor=2.0,
    moe_scoring="softmax",
    topk_method="group_limited_greedy",
    norm_topk_prob=False,
    rope_type="yarn",
    rope_factor=4.0,
    rope_original_max_len=2048,
    rope_mscale=0.707,
    rope_mscale_all_dim=0.707,
)

QWEN25_32B = ModelConfig(
    name="qwen2.5-32b",
    family=ModelFamily.QWEN2,
    vocab_size=152064,
    hidden_size=5120,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=27648,
    max_seq_len=131072,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    dtype="bfloat16",
    kv_dtype="float16",
)

# Qwen2.5-7B (its Hugging Face config.json).
QWEN25_7B = ModelConfig(
    name="qwen2.5-7b",
    family=ModelFamily.QWEN2,
    vocab_size=152064,
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=18944,
    max_seq_len=131072,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    dtype="bfloat16",
    kv_dtype="bfloat16",
)

DEEPSEEK_V3_660B = ModelConfig(
    name="deepseek-v3-660b",
    family=ModelFamily.DEEPSEEK,
    vocab_size=129280,
    hidden_size=7168,
    num_layers=61,
    num_heads=128,
    num_kv_heads=128,
    head_dim=192,
    intermediate_size=18432,
    max_seq_len=163840,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    qkv_bias=False,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    dtype="bfloat16",
    kv_dtype="float8_e4m3fn",
)

DEEPSEEK_V32_660B = dataclasses.replace(
    DEEPSEEK_V3_660B,
    name="deepseek-v3.2-660b",
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
)

# Paper appendix A.2; MLA dims are not given there, so DeepSeek-V3's are assumed.
DS_27B = dataclasses.replace(
    DEEPSEEK_V32_660B,
    name="ds-27b",
    hidden_size=2560,
    intermediate_size=12288,
    num_layers=30,
    num_heads=32,
    num_kv_heads=32,
    n_routed_experts=72,
    moe_intermediate_size=1536,
    num_experts_per_tok=6,
    n_shared_experts=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    index_n_heads=32,
    index_head_dim=64,
    index_topk=1024,
)

PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        TINY_QWEN2,
        TINY_DEEPSEEK,
        TINY_QWEN3,
        TINY_QWEN3_MOE,
        TINY_DEEPSEEK_V2,
        QWEN25_7B,
        QWEN25_32B,
        DEEPSEEK_V3_660B,
        DEEPSEEK_V32_660B,
        DS_27B,
    )
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------- sizing only

# GPT-OSS-120B: 36 layers alternating sliding-window (128 tokens) and full attention, GQA with
# 64 query / 8 KV heads of 64, 128 experts (top 4) of width 2880.
GPT_OSS_120B = ModelConfig(
    name="gpt-oss-120b",
    family=ModelFamily.QWEN2,  # GQA attention; the family only selects the attention counts
    vocab_size=201088,
    hidden_size=2880,
    num_layers=36,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=2880,
    max_seq_len=131072,
    n_routed_experts=128,
    num_experts_per_tok=4,
    moe_intermediate_size=2880,
    dtype="bfloat16",
    kv_dtype="float8_e4m3fn",
)
GPT_OSS_WINDOW = 128
GPT_OSS_WINDOW_LAYERS = 18

# Qwen3-235B-A22B: 94 layers, GQA 64 query / 4 KV heads of 128, 128 experts (top 8) of width 1536.
QWEN3_235B_A22B = ModelConfig(
    name="qwen3-235b-a22b",
    family=ModelFamily.QWEN2,
    vocab_size=151936,
    hidden_size=4096,
    num_layers=94,
    num_heads=64,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=12288,
    max_seq_len=131072,
    qkv_bias=False,
    n_routed_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=1536,
    dtype="bfloat16",
    kv_dtype="float8_e4m3fn",
)


SIZING_MODELS: tuple[str, ...] = (GPT_OSS_120B.name, QWEN3_235B_A22B.name)
