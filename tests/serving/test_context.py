"""The served context with `--checkpoint`: the checkpoint's `max_position_embeddings`, within
the memory the decode slots may take; a context the user pins is kept."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.serving.run import context_limit, serving_config

HF_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "dtype": "float32",
}


def _checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_QWEN2))
    return str(tmp_path)


def test_the_context_follows_the_checkpoint_not_the_preset(tmp_path):
    cfg = emulated_cpu_experiment(1, 1)
    assert cfg.cluster.decode_max_len == 2048  # the preset's
    served = serving_config(cfg, _checkpoint(tmp_path))
    assert served.model.max_seq_len == 8192
    assert served.cluster.decode_max_len == 8192  # a tiny model's KV fits any host
    pinned = serving_config(cfg, _checkpoint(tmp_path), pinned_context=True)
    assert pinned.cluster.decode_max_len == 2048


def _with(cfg: ExperimentConfig, **cluster) -> ExperimentConfig:
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, **cluster))


def test_memory_bounds_the_context_and_says_so():
    cfg = _with(emulated_cpu_experiment(1, 2), decode_slots=4)
    per_token = BlockLayout.for_model(cfg.model, 16).nbytes // 16
    # room for 4 slots x 1,000 tokens on each of the 2 DEs' share of a quarter of the host
    host = 4 * 2 * 4 * 1000 * per_token
    tokens, why = context_limit(cfg, host_bytes=host)
    assert tokens == 992 and tokens % 16 == 0  # whole blocks
    assert "host memory over 2 decode engine(s)" in why
    # an explicit budget wins over the host's memory; enough of it and the model's context stands
    tokens, why = context_limit(_with(cfg, decode_kv_bytes=4 * 512 * per_token), host_bytes=host)
    assert (tokens, why.endswith("(cluster.decode_kv_bytes)")) == (512, True)
    assert context_limit(cfg, host_bytes=10**15) == (
        cfg.model.max_seq_len,
        "the model's max_seq_len",
    )
    # GPU and TPU DEs size their pools from device memory: the model's context stands
    assert context_limit(_with(cfg, platform="gpu"), host_bytes=host)[0] == cfg.model.max_seq_len
    with pytest.raises(ValueError, match="do not fit"):
        context_limit(cfg, host_bytes=per_token)
