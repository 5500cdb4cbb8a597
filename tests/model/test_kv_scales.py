"""fp8 KV with per-token scales (`ModelConfig.kv_scales`): the rows carry their scales, the paged
kernel applies them page by page, and greedy tokens match across backends and the oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax import ConfigError, apply_overrides, validate
from dualpath_jax import model as dm
from dualpath_jax.config import ExperimentConfig
from dualpath_jax.kernels import paged_attention as pa
from dualpath_jax.kernels.kv_rows import RowLayout, quantize_rows, split_kv
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.presets import PRESETS, TINY_DEEPSEEK, TINY_QWEN2

FP8 = jnp.float8_e4m3fn
LAYOUTS = {
    "gqa": (RowLayout.gqa(2, 8, scaled=True), 4),
    "mla": (RowLayout.mla(256, 16, scaled=True), 4),  # two 128-column latent tiles + RoPE
}


def _rows(layout, shape, rng, spread=True):
    x = rng.normal(size=(*shape, layout.data_width))
    if spread:  # segments of very different magnitudes: what one scale per row could not hold
        x *= np.repeat(
            10.0 ** rng.integers(-3, 2, size=(*shape, layout.data_width // 8)), 8, axis=-1
        )
    return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_quantized_rows_round_trip_within_fp8_precision(name):
    layout, _ = LAYOUTS[name]
    x = _rows(layout, (3, 5), np.random.default_rng(0))
    q = quantize_rows(x, layout, FP8)
    assert q.shape[-1] == layout.row_width and q.dtype == FP8
    k, v = split_kv(q, layout, FP8, jnp.float32)
    k0, v0 = split_kv(x, layout.unscaled, jnp.float32, jnp.float32)
    for got, want in ((k, k0), (v, v0)):
        # e4m3 keeps 3 mantissa bits (within 1/16 of a value) down to its subnormals, whose
        # step is 2**-9 of the segment's scale (its max over 448): bounded by the row's max
        want = np.asarray(want)
        err = np.abs(np.asarray(got) - want)
        amax = np.abs(want).max(axis=(-2, -1), keepdims=True)
        assert (err <= np.abs(want) / 15 + amax / 448 * 2.0**-9).all()


def test_a_run_of_whole_heads_is_a_scaled_row_of_those_heads():
    """Each GQA head's scales sit after its own data: the columns of heads 1..2 of a row of 4
    are the row those 2 heads quantize to (what a device holds when pages split by KV head)."""
    layout = RowLayout.gqa(4, 8, scaled=True)
    assert layout.head_stride == 2 * 8 + 8 and layout.row_width == 4 * layout.head_stride
    assert layout.scale_columns == [h * 24 + c for h in range(4) for c in (16, 20)]
    x = _rows(layout, (3, 5), np.random.default_rng(4))
    rows = np.asarray(quantize_rows(x, layout, FP8).view(jnp.uint8))
    part = layout.with_heads(2)
    want = quantize_rows(x[..., 1 * 16 : 3 * 16], part, FP8)
    np.testing.assert_array_equal(rows[..., 24:72], np.asarray(want.view(jnp.uint8)))
    k, v = split_kv(rows[..., 24:72], part, FP8, jnp.float32)
    k_all, v_all = split_kv(rows, layout, FP8, jnp.float32)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(k_all)[..., 1:3, :])
    np.testing.assert_array_equal(np.asarray(v), np.asarray(v_all)[..., 1:3, :])


def test_the_scaled_row_layout_is_in_the_block_keys():
    """Scaled rows' layout is part of the model fingerprint (a store written in another layout
    is never read as this one); unscaled models' keys are unchanged by it."""
    from dualpath_jax.kvstore import identity

    cfg = _fp8(TINY_QWEN2, True)
    key, plain = identity.model_fingerprint(cfg), identity.model_fingerprint(TINY_QWEN2)
    old = identity.KV_SCALE_LAYOUT
    try:
        identity.KV_SCALE_LAYOUT = old + 1
        assert identity.model_fingerprint(cfg) != key
        assert identity.model_fingerprint(TINY_QWEN2) == plain
    finally:
        identity.KV_SCALE_LAYOUT = old


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kernel_applies_the_scales_as_the_oracle(name):
    layout, hq = LAYOUTS[name]
    rng = np.random.default_rng(1)
    b, n, ps, p = 3, 4, 4, 16
    pages = quantize_rows(_rows(layout, (p, 2, ps), rng), layout, FP8)
    new = quantize_rows(_rows(layout, (b, n), rng), layout, FP8)
    table = jnp.asarray(rng.permutation(p)[: b * 4].reshape(b, 4), jnp.int32)
    lens = jnp.asarray([0, 6, 13], jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, n, hq, layout.key_width)), jnp.float32)
    scale = layout.key_width**-0.5
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint8)
    want = pa.paged_attention_reference(q, bits, table, lens, new, layout, scale, layer=1,
                                        kv_dtype=FP8)  # fmt: skip
    got = pa.paged_attention(q, bits, table, lens, new, layout, scale, layer=1, kv_dtype=FP8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # the same with the shapes the kernel has compiled for a GPU (interpreted here)
    got = pa._paged_attention(
        q, bits, table, lens, new, jnp.ones((1,), jnp.int32), None, jnp.full((b,), n),
        layout=layout, scale=scale, kv_dtype=jnp.dtype(FP8), block_q=64, kv_splits=2, compiled=True, interpret=True,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # ... and in the TPU form (scales assembled from their bytes in VMEM)
    got = pa._paged_attention_tpu(
        q, bits, table, lens, new, jnp.ones((1,), jnp.int32), None, jnp.full((b,), n),
        layout=layout, scale=scale, kv_dtype=jnp.dtype(FP8), interpret=True,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # and the in-kernel write puts whole scaled rows (data and scale bytes) in their pages
    write = jnp.asarray([4, 1, 2], jnp.int32)
    _, written = pa.paged_attention(q, bits, table, lens, new, layout, scale, layer=1,
                                    kv_dtype=FP8, write_lens=write)  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(written), np.asarray(pa.write_pages(bits, table, lens, new, write, 1))
    )


def _fp8(cfg, scales, impl="reference"):
    return dataclasses.replace(cfg, kv_dtype="float8_e4m3fn", kv_scales=scales, attention_impl=impl)


@pytest.mark.parametrize(
    "family",
    # MLA's scaled rows against the oracle stay in the fast tier (the kernel tests); its whole
    # greedy run in the full one
    [TINY_QWEN2, pytest.param(TINY_DEEPSEEK, marks=pytest.mark.slow)],
    ids=["qwen2", "deepseek"],
)
def test_greedy_tokens_match_across_backends_and_the_oracle(family):
    prompts = [[(7 * i + 3) % 257 for i in range(37)], [(5 * i + 1) % 257 for i in range(20)]]
    runners = {
        impl: ModelRunner(dm.init_model(_fp8(family, True, impl), seed=0))
        for impl in ("reference", "pallas")
    }
    tokens = {impl: dm.generate(r, prompts, 8) for impl, r in runners.items()}
    assert tokens["pallas"] == tokens["reference"]
    assert tokens["reference"][1] == dm.reference_generate(runners["reference"], prompts[1], 8)


@pytest.mark.parametrize("family", [TINY_QWEN2, TINY_DEEPSEEK], ids=["qwen2", "deepseek"])
def test_scaled_fp8_logits_stay_near_full_precision(family):
    """Logits of a layerwise prefill over cached scaled-fp8 KV are within fp8's precision
    (~6%) of the f32-KV model's."""
    prompt = [(3 * i + 2) % 257 for i in range(48)]

    def logits(cfg):
        runner = ModelRunner(dm.init_model(cfg, seed=0))
        _, kv = runner.prefill_monolithic(PrefillBatch.build(cfg, [prompt[:32]], [0]))
        kv = np.asarray(kv)
        tail = PrefillBatch.build(cfg, [prompt[32:]], [32])
        res = runner.prefill_layerwise(tail, lambda i: kv[i][:, : tail.c_pad])
        return np.asarray(res.last_logits, np.float32)

    full = logits(family)
    err = np.abs(logits(_fp8(family, True)) - full).max()
    assert err < 0.06 * np.abs(full).max(), (err, np.abs(full).max())


def test_scales_keep_rows_a_bare_cast_cannot_hold():
    """Segments far outside e4m3's range (|x| up to 1e4, or all below its smallest normal):
    a cast overflows or flushes them, the per-token scales keep 3 mantissa bits of each."""
    layout, _ = LAYOUTS["gqa"]
    x = _rows(layout, (4,), np.random.default_rng(2), spread=False)
    x = x * jnp.asarray([1e4, 1e-5, 1.0, 1e3])[:, None]
    k, _ = split_kv(quantize_rows(x, layout, FP8), layout, FP8, jnp.float32)
    k0, _ = split_kv(x, layout.unscaled, jnp.float32, jnp.float32)
    rel = np.abs(np.asarray(k) - np.asarray(k0)) / np.abs(np.asarray(k0)).max(-1, keepdims=True)
    assert rel.max() < 1 / 15
    cast = np.asarray(x.astype(FP8).astype(jnp.float32))
    assert not np.isfinite(cast[0]).all() or np.abs(cast[0] - np.asarray(x[0])).max() > 1e3
    assert np.abs(cast[1]).max() == 0  # flushed to zero


@pytest.mark.parametrize("family", [TINY_QWEN2, TINY_DEEPSEEK], ids=["qwen2", "deepseek"])
@pytest.mark.parametrize("scales", [False, True])
def test_the_row_layout_is_as_wide_as_the_config_says(family, scales):
    for cfg in (_fp8(family, scales), _fp8(PRESETS["deepseek-v3-660b"], scales)):
        assert RowLayout.for_model(cfg).row_width == cfg.kv_width


def test_config_needs_an_fp8_kv_dtype_and_widens_the_row():
    assert _fp8(TINY_QWEN2, True).kv_width == TINY_QWEN2.kv_width + 4 * 2 * TINY_QWEN2.num_kv_heads
    cfg = ExperimentConfig(model=TINY_QWEN2)
    with pytest.raises(ConfigError, match="model.kv_scales: needs an fp8 kv_dtype"):
        validate(apply_overrides(cfg, ["model.kv_scales=true"]))
    ok = apply_overrides(cfg, ["model.kv_scales=true", "model.kv_dtype=float8_e4m3fn"])
    validate(ok)
