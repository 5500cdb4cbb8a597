"""Sizing-only model presets for Table 1 rows that `model/presets.py` does not cover.

These are never instantiated as arrays; they only feed `sched.cost.ModelCost`. Dimensions are
from the models' public configurations (Hugging Face `config.json`).
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.config import ModelConfig, ModelFamily
from dualpath_jax.model.presets import PRESETS as MODEL_PRESETS
from dualpath_jax.sched.cost import ModelCost

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


def _gpt_oss(kv_format: str | None) -> ModelCost:
    c = ModelCost.from_model(GPT_OSS_120B, kv_format)
    return dataclasses.replace(
        c,
        full_attn_layers=c.num_layers - GPT_OSS_WINDOW_LAYERS,
        window_layers=GPT_OSS_WINDOW_LAYERS,
        window=GPT_OSS_WINDOW,
    )


def sizing_cost(name: str, kv_format: str | None = None) -> ModelCost:
    """`ModelCost` of a model preset (`model/presets.py`) or a sizing-only preset here."""
    if name == GPT_OSS_120B.name:
        return _gpt_oss(kv_format)
    if name == QWEN3_235B_A22B.name:
        return ModelCost.from_model(QWEN3_235B_A22B, kv_format)
    if name in MODEL_PRESETS:
        return ModelCost.from_model(MODEL_PRESETS[name], kv_format)
    raise KeyError(f"unknown model {name!r}; known: {sorted({*MODEL_PRESETS, *SIZING_MODELS})}")


SIZING_MODELS: tuple[str, ...] = (GPT_OSS_120B.name, QWEN3_235B_A22B.name)
