"""Attention backends (`ModelConfig.attention_impl`): `xla` (jax.nn.dot_product_attention) and
`pallas` (the paged kernel, interpret mode on CPU) give the reference path's logits within float
tolerance and the same greedy tokens, through the monolithic forward, layerwise prefill over
cached KV and batched paged decode, for GQA (Qwen2, Qwen3) and MLA (default and yarn RoPE)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiers import family_params

from dualpath_jax import ConfigError, apply_overrides, validate
from dualpath_jax import model as dm
from dualpath_jax.config import ExperimentConfig
from dualpath_jax.kvstore import model_fingerprint
from dualpath_jax.model.layers import ATTENTION_IMPLS, resolve_attention_impl
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_DEEPSEEK_V2, TINY_QWEN2, TINY_QWEN3

# GQA with QKV bias and with q/k norms; MLA with default RoPE and with yarn (its softmax scale).
FAMILIES = {
    "qwen2": TINY_QWEN2,
    "qwen3": TINY_QWEN3,
    "deepseek": TINY_DEEPSEEK,
    "deepseek_v2": TINY_DEEPSEEK_V2,
}
PROMPTS = [[(7 * i + 3) % 257 for i in range(37)], [(5 * i + 1) % 257 for i in range(20)]]


def runners(cfg):
    return {
        impl: ModelRunner(dm.init_model(dataclasses.replace(cfg, attention_impl=impl), seed=0))
        for impl in ATTENTION_IMPLS
    }


@pytest.fixture(
    scope="module",
    # Qwen3 (q/k norms) and DeepSeek-V2 (yarn's scale) in the full tier only.
    params=family_params(sorted(FAMILIES)),
)
def both(request):
    return runners(FAMILIES[request.param])


@pytest.mark.parametrize("impl", [i for i in ATTENTION_IMPLS if i != "reference"])
def test_monolithic_and_layerwise_logits_match_the_reference(both, impl):
    ref, xla = both["reference"], both[impl]
    whole = PrefillBatch.build(ref.cfg, PROMPTS, [0, 0])
    (r_out, r_kv), (x_out, x_kv) = (rn.prefill_monolithic(whole) for rn in (ref, xla))
    np.testing.assert_allclose(
        np.asarray(x_out.last_logits), np.asarray(r_out.last_logits), atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(x_kv), np.asarray(r_kv), atol=1e-5)
    # Layerwise over cached KV: the first 16 tokens cached, the rest new.
    kv = np.asarray(r_kv)
    tail = PrefillBatch.build(ref.cfg, [p[16:] for p in PROMPTS], [16, 16])

    def load(i):
        return kv[i][:, : tail.c_pad]

    r_tail, x_tail = (rn.prefill_layerwise(tail, load) for rn in (ref, xla))
    np.testing.assert_allclose(
        np.asarray(x_tail.last_logits), np.asarray(r_tail.last_logits), atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(x_tail.last_logits), np.asarray(r_out.last_logits), atol=1e-4
    )


def test_greedy_tokens_are_identical_under_every_backend(both):
    tokens = {impl: dm.generate(rn, PROMPTS, 12) for impl, rn in both.items()}
    assert tokens["xla"] == tokens["reference"]
    assert tokens["pallas"] == tokens["reference"]
    assert tokens["reference"][0] == dm.reference_generate(both["reference"], PROMPTS[0], 12)


def test_auto_is_the_reference_path_on_cpu_the_kernel_on_accelerators_bad_names_refused():
    assert resolve_attention_impl("auto") == "reference"  # tests pin the CPU
    # what another platform runs is known without one: the paged kernel on GPU
    assert dm.resolve_attention_impl("auto", platform="gpu") == "pallas"
    assert resolve_attention_impl("auto", platform="cuda") == "pallas"
    assert resolve_attention_impl("auto", platform="tpu") == "pallas"
    assert resolve_attention_impl("xla", platform="gpu") == "xla"
    with pytest.raises(ValueError, match="unknown platform"):
        resolve_attention_impl("auto", platform="metal")
    assert [resolve_attention_impl(i) for i in ATTENTION_IMPLS] == list(ATTENTION_IMPLS)
    with pytest.raises(ValueError, match="attention_impl must be"):
        resolve_attention_impl("flash")
    cfg = ExperimentConfig()
    assert apply_overrides(cfg, ["model.attention_impl=xla"]).model.attention_impl == "xla"
    with pytest.raises(ConfigError, match=r"model.attention_impl: must be one of"):
        validate(apply_overrides(cfg, ["model.attention_impl=flash"]))


def test_the_backend_is_not_part_of_the_kv_identity():
    fps = {
        model_fingerprint(dataclasses.replace(TINY_QWEN2, attention_impl=i))
        for i in ("auto", *ATTENTION_IMPLS)
    }
    assert len(fps) == 1


def test_the_kernels_pages_per_step_come_from_the_config(monkeypatch):
    """`model.attention_pages_per_step` reaches the paged kernel (0: its default), gives the
    same tokens, and is not part of the KV's identity."""
    from dualpath_jax.kernels import paged_attention as pa

    seen, kernel = [], pa.paged_attention

    def spy(*args, **kw):
        seen.append(kw.get("pages_per_compute_block"))
        return kernel(*args, **kw)

    monkeypatch.setattr(pa, "paged_attention", spy)
    tokens = {}
    for step in (0, 1, 3):
        cfg = dataclasses.replace(
            TINY_QWEN2, attention_impl="pallas", attention_pages_per_step=step
        )
        tokens[step] = dm.generate(ModelRunner(dm.init_model(cfg, seed=0)), PROMPTS[:1], 4)
        assert set(seen) == {step or None}, seen
        seen.clear()
    assert tokens[1] == tokens[3] == tokens[0]
    fps = {
        model_fingerprint(dataclasses.replace(TINY_QWEN2, attention_pages_per_step=s))
        for s in (0, 2)
    }
    assert len(fps) == 1
    cfg = apply_overrides(ExperimentConfig(), ["model.attention_pages_per_step=4"])
    assert cfg.model.attention_pages_per_step == 4
    with pytest.raises(ConfigError, match="attention_pages_per_step"):
        validate(apply_overrides(ExperimentConfig(), ["model.attention_pages_per_step=-1"]))
