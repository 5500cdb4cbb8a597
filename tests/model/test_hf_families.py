"""Qwen3, Qwen3-MoE, DeepSeek-V2 (and V2-Lite) and yarn RoPE match transformers' own models.

As in test_hf.py: each checkpoint is a tiny random model that transformers builds here,
re-initialised with weights large enough that logits are well separated, saved with
`save_pretrained` and loaded with `from_pretrained`; logits must match to 1e-4 relative and greedy
tokens exactly, through several attention and routed-expert implementations. The yarn configs
put the original context (2,048) where the blend between original and interpolated frequencies
covers several of the rotary dimensions, and give DeepSeek an mscale_all_dim, so both the
frequencies and the softmax scale are checked.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_reference import (  # noqa: E402
    NEW_TOKENS,
    NO_SPECIAL_TOKENS,
    PROMPT,
    RTOL,
    Checkpoint,
    hf_logits,
    our_logits,
    rel_err,
    write_hf,
)

from dualpath_jax.config import ExperimentConfig, ModelFamily, validate  # noqa: E402
from dualpath_jax.model.checkpoint import config_from_hf, from_pretrained  # noqa: E402
from dualpath_jax.model.generation import generate  # noqa: E402
from dualpath_jax.model.layers import MoE  # noqa: E402
from dualpath_jax.model.runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.hf


QWEN3 = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not hidden / heads
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    tie_word_embeddings=False,
    **NO_SPECIAL_TOKENS,
)
QWEN3_MOE = dict(
    QWEN3,
    num_hidden_layers=4,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)
DEEPSEEK_V2 = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    topk_method="group_limited_greedy",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.5,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    **NO_SPECIAL_TOKENS,
)
# DeepSeek-V2's own yarn values (mscale == mscale_all_dim: cos/sin unscaled, softmax sharpened).
V2_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
# V2-Lite's shape: no query LoRA, greedy routing over all experts, two shared experts.
DEEPSEEK_V2_LITE = dict(
    DEEPSEEK_V2,
    q_lora_rank=None,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    n_shared_experts=2,
    routed_scaling_factor=1.0,
)
# mscale != mscale_all_dim: cos/sin scaled too; other band edges than the defaults.
V3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 16,
    "beta_slow": 2,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
DEEPSEEK_V3 = dict(
    DEEPSEEK_V2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    rope_parameters=V3_YARN,
)
DEEPSEEK_V3.pop("topk_method")
# Without mscale: cos/sin scaled by 0.1 ln(factor) + 1, as transformers derives it.
QWEN3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 2048,
}


_BUILDERS = {
    "qwen3": ("Qwen3ForCausalLM", QWEN3, 10),
    "qwen3_yarn": ("Qwen3ForCausalLM", dict(QWEN3, rope_parameters=QWEN3_YARN), 11),
    "qwen3_moe": ("Qwen3MoeForCausalLM", QWEN3_MOE, 12),
    # Every other layer sparse (layers 1 and 3), softmax weights not renormalized.
    "qwen3_moe_step2": (
        "Qwen3MoeForCausalLM",
        dict(QWEN3_MOE, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False),
        13,
    ),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(DEEPSEEK_V2, rope_parameters=V2_YARN), 14),
    "deepseek_v2_lite": (
        "DeepseekV2ForCausalLM",
        dict(DEEPSEEK_V2_LITE, rope_parameters=V2_YARN),
        15,
    ),
    "deepseek_v3_yarn": ("DeepseekV3ForCausalLM", DEEPSEEK_V3, 16),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(name)`: the named checkpoint, written once per module."""
    cache: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in cache:
            cls_name, kwargs, seed = _BUILDERS[name]
            cache[name] = write_hf(tmp_path_factory.mktemp(name), cls_name, kwargs, seed)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(_BUILDERS))
def test_logits_match_transformers(checkpoint, name):
    ckpt = checkpoint(name)
    theirs = hf_logits(ckpt.hf, PROMPT)
    # Well-separated logits, or the comparison would say little.
    assert np.abs(theirs).max() > 1.0 and theirs[-1].std() > 0.3
    err = rel_err(our_logits(ModelRunner(from_pretrained(ckpt.path)), PROMPT), theirs)
    assert err < RTOL, f"{name}: max relative logit error {err:.2e}"


DENSE_IMPLS = [("reference", "ragged_dot"), ("xla", "ragged_dot"), ("pallas", "ragged_dot")]
MOE_IMPLS = [
    ("reference", "ragged_dot"),
    ("xla", "grouped"),
    ("xla", "gmm"),
    ("pallas", "ragged_dot"),
]


def _tiered(cases):
    """The fast tier: the oracle backend on one MoE GQA and one MLA family (every family's
    logits are compared there too); the rest in the full tier."""
    fast = {
        ("qwen3_moe", "reference", "ragged_dot"),
        ("deepseek_v3_yarn", "reference", "ragged_dot"),
    }
    return [c if c in fast else pytest.param(*c, marks=pytest.mark.slow) for c in cases]


@pytest.mark.parametrize(
    "name, impl, moe_impl",
    # Every backend once on a dense and a MoE family; the other families on the oracle and one
    # more (the backends are family-independent, the families' routing and RoPE are not).
    # The oracle backend (reference, ragged_dot) of each family in the fast tier, the other
    # backends in the full one.
    _tiered(
        [("qwen3", *i) for i in DENSE_IMPLS]
        + [("qwen3_yarn", "reference", "ragged_dot")]
        + [("qwen3_moe", *i) for i in MOE_IMPLS]
        + [("deepseek_v2", *MOE_IMPLS[0]), ("deepseek_v2", *MOE_IMPLS[1])]
        + [("deepseek_v2_lite", *MOE_IMPLS[0]), ("deepseek_v2_lite", *MOE_IMPLS[3])]
        + [("deepseek_v3_yarn", "reference", "ragged_dot"), ("deepseek_v3_yarn", "pallas", "gmm")]
    ),
)
def test_greedy_tokens_match_transformers(checkpoint, name, impl, moe_impl):
    ckpt = checkpoint(name)
    with torch.no_grad():
        out = ckpt.hf.generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0
        )
    theirs = out[0, len(PROMPT) :].tolist()
    assert len(theirs) == NEW_TOKENS
    model = from_pretrained(ckpt.path, attention_impl=impl, moe_impl=moe_impl)
    ours = generate(ModelRunner(model), [PROMPT], NEW_TOKENS)[0]
    assert ours == theirs


@pytest.mark.parametrize(
    "name, expect",
    [
        (
            "qwen3",
            dict(family=ModelFamily.QWEN3, head_dim=24, qk_norm=True, qkv_bias=False),
        ),
        (
            "qwen3_yarn",
            dict(rope_type="yarn", rope_factor=4.0, rope_original_max_len=2048, rope_mscale=0.0),
        ),
        (
            "qwen3_moe",
            dict(
                family=ModelFamily.QWEN3_MOE,
                n_routed_experts=8,
                n_shared_experts=0,
                dense_layers=(1,),
                moe_scoring="softmax",
                topk_method="greedy",
                norm_topk_prob=True,
            ),
        ),
        ("qwen3_moe_step2", dict(moe_layer_step=2, dense_layers=(), norm_topk_prob=False)),
        (
            "deepseek_v2",
            dict(
                family=ModelFamily.DEEPSEEK_V2,
                q_lora_rank=24,
                moe_scoring="softmax",
                topk_method="group_limited_greedy",
                norm_topk_prob=False,
                routed_scaling_factor=1.5,
                rope_mscale=0.707,
                rope_mscale_all_dim=0.707,
            ),
        ),
        ("deepseek_v2_lite", dict(q_lora_rank=0, topk_method="greedy", n_shared_experts=2)),
        (
            "deepseek_v3_yarn",
            dict(
                family=ModelFamily.DEEPSEEK,
                moe_scoring="sigmoid",
                topk_method="noaux_tc",
                rope_beta_fast=16.0,
                rope_beta_slow=2.0,
                rope_mscale_all_dim=0.8,
            ),
        ),
    ],
)
def test_config_from_transformers_config(checkpoint, name, expect):
    ckpt = checkpoint(name)
    cfg = from_pretrained(ckpt.path).cfg
    assert {k: getattr(cfg, k) for k in expect} == expect
    validate(ExperimentConfig(model=cfg))
    # The same layers have routed experts as in transformers' model.
    hf_moe = [hasattr(layer.mlp, "experts") for layer in ckpt.hf.model.layers]
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == hf_moe
    assert [isinstance(layer.mlp, MoE) for layer in from_pretrained(ckpt.path).layers] == hf_moe


def test_legacy_rope_scaling_maps_like_rope_parameters(checkpoint):
    """DeepSeek's own config.json files spell yarn as `rope_scaling` with a top-level
    `rope_theta` and the older `type` key; the mapping is the same."""
    hf = json.loads((checkpoint("deepseek_v2").path / "config.json").read_text())
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 10000.0, "rope_scaling": {"type": "yarn"} | dict(V2_YARN)}
    del legacy["rope_scaling"]["rope_type"], legacy["rope_scaling"]["rope_theta"]
    assert config_from_hf(legacy) == config_from_hf(hf)


def test_yarn_frequencies_match_transformers(checkpoint):
    """The blended inverse frequencies and the cos/sin factor, against transformers' rotary
    embedding (the logits tests check them only through the model)."""
    from dualpath_jax.model.layers import Rope

    for name, dim in (("qwen3_yarn", 24), ("deepseek_v3_yarn", 8)):
        ckpt = checkpoint(name)
        rotary = ckpt.hf.model.rotary_emb
        rope = Rope.for_model(from_pretrained(ckpt.path).cfg, dim)
        np.testing.assert_allclose(
            np.asarray(rope.inv_freq()), rotary.inv_freq.numpy(), rtol=1e-6, err_msg=name
        )
        assert rope.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
        # The blend is real: some frequencies kept, some divided by the factor, some between.
        shrink = (1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim)) / np.asarray(rope.inv_freq())
        assert np.isclose(shrink, 1.0).any() and np.isclose(shrink, 4.0).any(), name
        assert ((shrink > 1.01) & (shrink < 3.99)).any(), name
