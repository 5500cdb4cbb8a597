"""orbax save/restore of parameters, and Hugging Face directories that `from_pretrained` refuses.

The comparison against transformers' own models is in test_hf.py (marker `hf`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dualpath_jax.model.checkpoint import (
    CheckpointError,
    config_from_hf,
    from_pretrained,
    restore_params,
    save_params,
)
from dualpath_jax.model.layers import Buffer
from dualpath_jax.model.layout import BlockLayout, Retention, UnsupportedLayout
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_DEEPSEEK_V2, TINY_QWEN2, TINY_QWEN3_MOE

PROMPTS = [[3, 141, 59, 26, 5, 35, 89, 79, 32], [256, 0, 17]]
CONFIGS = {
    "qwen2": TINY_QWEN2,
    "deepseek": TINY_DEEPSEEK,
    "deepseek_v2": TINY_DEEPSEEK_V2,
    "qwen3_moe": TINY_QWEN3_MOE,
    "qwen2_bf16_tied": dataclasses.replace(
        TINY_QWEN2, num_layers=2, dtype="bfloat16", kv_dtype="bfloat16", tie_embeddings=True
    ),
}


def perturbed_model(cfg, seed: int):
    """A random model whose every leaf (norm weights, biases, router biases too) is off its
    initial value, so that a restore that fell back to initial values would show."""
    gd, state = nnx.split(init_model(cfg, seed))
    rs = np.random.RandomState(seed)
    noisy = lambda x: jnp.asarray(  # noqa: E731
        (np.asarray(x, np.float32) + 0.1 * rs.standard_normal(x.shape)).astype(x.dtype)
    )
    return nnx.merge(gd, jax.tree.map(noisy, state))


def flat_params(model) -> dict:
    return nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model)))


def all_logits(model) -> np.ndarray:
    runner = ModelRunner(model)
    result, _ = runner.prefill_monolithic(
        PrefillBatch.build(runner.cfg, PROMPTS, [0] * len(PROMPTS)), all_logits=True
    )
    return np.asarray(result.logits)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    """(model, directory it was saved to), once per config."""
    model = perturbed_model(CONFIGS[request.param], seed=7)
    return model, save_params(model, tmp_path_factory.mktemp(request.param))


# --------------------------------------------------------------------------- orbax


def test_round_trip_is_bitwise(saved):
    model, path = saved
    restored = restore_params(path)
    assert restored.cfg == model.cfg
    want, got = flat_params(model), flat_params(restored)
    assert got.keys() == want.keys()
    for k in want:
        a, b = np.asarray(want[k]), np.asarray(got[k])
        assert a.dtype == b.dtype and a.shape == b.shape, k
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=str(k))
    # Variable kinds survive too (the V3 router's correction bias stays a non-trainable Buffer).
    kinds = lambda m: {p: type(v) for p, v in nnx.to_flat_state(nnx.state(m))}  # noqa: E731
    assert kinds(restored) == kinds(model)
    assert (Buffer in kinds(model).values()) == (model.cfg.family.value == "deepseek")


def test_round_trip_logits_identical(saved):
    model, path = saved
    want = all_logits(model)
    assert np.isfinite(want).all() and want.std() > 0.1
    np.testing.assert_array_equal(all_logits(restore_params(path)), want)


def test_restore_without_config_file(saved, tmp_path):
    model, path = saved
    copy = shutil.copytree(path, tmp_path / "ckpt")
    (copy / "dualpath_model.json").unlink()
    with pytest.raises(CheckpointError, match="dualpath_model.json"):
        restore_params(copy)
    # Given the config explicitly, the parameters alone are enough.
    np.testing.assert_array_equal(all_logits(restore_params(copy, model.cfg)), all_logits(model))


def test_restore_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a saved dualpath_jax model"):
        restore_params(tmp_path)


def test_save_overwrites(tmp_path):
    cfg = CONFIGS["qwen2"]
    save_params(perturbed_model(cfg, seed=1), tmp_path)
    second = perturbed_model(cfg, seed=2)
    save_params(second, tmp_path)
    np.testing.assert_array_equal(all_logits(restore_params(tmp_path)), all_logits(second))


# --------------------------------------------------------------------------- Hugging Face refusals

# Minimal config.json contents (as transformers writes them) of the two supported architectures.
HF_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "dtype": "float32",
}
HF_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "dtype": "bfloat16",
}
# DeepSeek-V3's own checkpoints ship this (older spelling) ...
YARN_SCALING = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def write_config(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_supported_configs_map():
    qwen = config_from_hf(HF_QWEN2)
    assert (qwen.family.value, qwen.head_dim, qwen.num_kv_heads, qwen.max_seq_len) == (
        "qwen2",
        16,
        2,
        512,
    )
    ds = config_from_hf(HF_DEEPSEEK)
    assert (ds.family.value, ds.dtype, ds.head_dim, ds.kv_width, ds.q_lora_rank) == (
        "deepseek",
        "bfloat16",
        24,
        40,
        24,
    )
    assert config_from_hf(HF_DEEPSEEK | {"q_lora_rank": None}).q_lora_rank == 0


def test_qwen3_moe_layer_pattern_maps():
    """Qwen3-MoE's own config.json files say `num_experts`; layer i is sparse when
    (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    hf = HF_QWEN2 | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 8,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [5],
    }
    cfg = config_from_hf(hf)
    assert (cfg.family.value, cfg.n_routed_experts, cfg.qk_norm, cfg.qkv_bias) == (
        "qwen3_moe",
        8,
        True,
        False,
    )
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [1, 3, 7]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MixtralForCausalLM"])
def test_unsupported_architecture(tmp_path, arch):
    path = write_config(tmp_path, HF_QWEN2 | {"architectures": [arch]})
    with pytest.raises(CheckpointError, match=arch):
        from_pretrained(path)


def test_no_architectures_names_the_model_type(tmp_path):
    config = {k: v for k, v in HF_QWEN2.items() if k != "architectures"} | {"model_type": "llama"}
    with pytest.raises(CheckpointError, match="llama"):
        from_pretrained(write_config(tmp_path, config))


@pytest.mark.parametrize("config", [HF_QWEN2, HF_DEEPSEEK], ids=["qwen2", "deepseek"])
def test_directory_without_safetensors(tmp_path, config):
    path = write_config(tmp_path, config)
    (path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="safetensors"):
        from_pretrained(path)


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "config, expect",
    [
        (
            HF_DEEPSEEK | {"rope_scaling": YARN_SCALING},
            dict(rope_factor=40.0, rope_original_max_len=4096, rope_mscale_all_dim=1.0),
        ),
        # ... and transformers 5 writes this (original_max_position_embeddings defaults to
        # max_position_embeddings, as transformers fills it in).
        (
            HF_DEEPSEEK
            | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}},
            dict(rope_factor=40.0, rope_original_max_len=512, rope_mscale_all_dim=0.0),
        ),
        (
            HF_QWEN2 | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}},
            dict(rope_factor=4.0, rope_theta=5e5, rope_beta_fast=32.0, rope_beta_slow=1.0),
        ),
        # A top-level original_max_position_embeddings wins over the RoPE dict's, as there.
        (
            HF_QWEN2
            | {
                "original_max_position_embeddings": 128,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
            dict(rope_original_max_len=128, rope_theta=10000.0),
        ),
    ],
    ids=["deepseek-rope_scaling", "deepseek-rope_parameters", "qwen2", "qwen2-top-level-original"],
)
def test_yarn_rope_scaling_maps(config, expect):
    cfg = config_from_hf(config)
    assert cfg.rope_type == "yarn"
    assert {k: getattr(cfg, k) for k in expect} == expect


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3", "longrope"])
def test_unsupported_rope_scaling(tmp_path, rope_type):
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(CheckpointError, match=f"RoPE scaling '{rope_type}' is not supported"):
        from_pretrained(write_config(tmp_path, HF_QWEN2 | {"rope_parameters": rope}))


HF_QWEN3 = HF_QWEN2 | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
HF_DEEPSEEK_V2 = HF_DEEPSEEK | {"architectures": ["DeepseekV2ForCausalLM"], "n_group": 1}


@pytest.mark.parametrize(
    "config, match",
    [
        (HF_QWEN3 | {"attention_bias": True}, "Qwen3 attention_bias=True"),
        (HF_QWEN2 | {"hidden_act": "gelu"}, "activation 'gelu'"),
        (HF_QWEN3 | {"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
        (
            HF_QWEN2 | {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial rotary",
        ),
        (
            HF_QWEN2 | {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
            "per layer type",
        ),
        (HF_DEEPSEEK_V2 | {"norm_topk_prob": True}, "norm_topk_prob=True"),
        (HF_DEEPSEEK_V2 | {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        (HF_DEEPSEEK | {"topk_method": "greedy"}, "topk_method 'greedy'"),
        (HF_DEEPSEEK | {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        (HF_DEEPSEEK_V2 | {"moe_layer_freq": 2}, "moe_layer_freq=2"),
        (HF_DEEPSEEK_V2 | {"mlp_bias": True}, "mlp_bias=True"),
    ],
)
def test_unsupported_features(config, match):
    with pytest.raises(CheckpointError, match=re.escape(match)):
        config_from_hf(config)


@pytest.mark.parametrize(
    "config, window, layers",
    [
        (HF_QWEN2 | {"use_sliding_window": False, "sliding_window": 64}, 0, ()),
        (HF_QWEN2 | {"use_sliding_window": True, "sliding_window": 64}, 0, ()),  # from layer 28
        (
            HF_QWEN2 | {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
            64,
            (1,),
        ),
        (
            HF_QWEN3
            | {
                "use_sliding_window": True,
                "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            32,
            (0,),
        ),
        (HF_QWEN3 | {"layer_types": ["full_attention"] * 2, "sliding_window": 32}, 0, ()),
        (
            HF_QWEN2
            | {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}
            | {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
            | {"use_sliding_window": True, "sliding_window": 16},
            16,
            (0, 1),
        ),
    ],
    ids=["off", "past-the-layers", "max_window_layers", "layer_types", "all-full", "qwen3-moe"],
)
def test_sliding_window_maps_to_window_layers(config, window, layers):
    cfg = config_from_hf(config)
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (window, layers)
    groups = BlockLayout.for_model(cfg, 16).groups
    assert [g.layers for g in groups if g.retention == Retention.WINDOW] == (
        [layers] if layers else []
    )
    assert all(g.window == window for g in groups if g.retention == Retention.WINDOW)


def test_sliding_window_layers_are_refused_by_the_model_forward(tmp_path):
    hf = HF_QWEN2 | {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}
    with pytest.raises(UnsupportedLayout, match="layer 1 .* last 64 tokens .* model forward"):
        from_pretrained(write_config(tmp_path, hf))
