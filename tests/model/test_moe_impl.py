"""Routed-expert implementations (`ModelConfig.moe_impl`): `grouped` (tiled, memory-bounded) and
`gmm` (Pallas megablox; interpret mode on CPU) compute `ragged_dot`'s rows, for any routing
(skewed to one expert, empty experts, groups longer than a tile), and give its greedy tokens."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax import ConfigError, apply_overrides, validate
from dualpath_jax import model as dm
from dualpath_jax.config import ExperimentConfig
from dualpath_jax.kvstore import model_fingerprint
from dualpath_jax.model import moe
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_DEEPSEEK_V2, TINY_QWEN3_MOE

PROMPTS = [[(7 * i + 3) % 257 for i in range(37)], [(5 * i + 1) % 257 for i in range(20)]]

# Rows per expert: mixed, all on one expert, one row on the last, groups past a 128-row tile.
SIZES = {
    "mixed": [5, 0, 17, 3, 0, 0, 9, 2],
    "one_expert": [0, 0, 36, 0, 0, 0, 0, 0],
    "single_row": [0, 0, 0, 0, 0, 0, 0, 1],
    "long_groups": [130, 1, 0, 129, 0, 0, 0, 4],
}

_ffn = jax.jit(moe.expert_ffn, static_argnums=5)


def expert_inputs(sizes, hidden=40, inter=24, dtype=jnp.float32, seed=0):
    """xs [N, hidden], sizes [E], w_gate / w_up [E, hidden, inter], w_down [E, inter, hidden]."""
    e, n = len(sizes), sum(sizes)
    k = jax.random.split(jax.random.key(seed), 4)
    xs = jax.random.normal(k[0], (n, hidden), jnp.float32).astype(dtype)

    def w(key, shape):
        return (shape[1] ** -0.5 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return (
        xs,
        jnp.asarray(sizes, jnp.int32),
        w(k[1], (e, hidden, inter)),
        w(k[2], (e, hidden, inter)),
        w(k[3], (e, inter, hidden)),
    )


@pytest.mark.parametrize("impl", ["grouped", "gmm"])
@pytest.mark.parametrize("routing", sorted(SIZES))
def test_each_implementation_computes_the_ragged_dot_rows(impl, routing):
    args = expert_inputs(SIZES[routing])
    ref = np.asarray(_ffn(*args, "ragged_dot"))
    out = _ffn(*args, impl)
    assert out.shape == ref.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["grouped", "gmm"])
def test_bfloat16_and_dimensions_past_one_kernel_tile(impl):
    # hidden 200 and inter 144 are not multiples of gmm's 128 tile: its k remainder is masked.
    args = expert_inputs([70, 0, 200, 3, 11, 0, 0, 16], 200, 144, jnp.bfloat16)
    ref = np.asarray(_ffn(*args, "ragged_dot"), np.float32)
    out = _ffn(*args, impl)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tile", [1, 8, 16, 128])
def test_grouped_is_exact_at_any_tile(tile):
    args = expert_inputs(SIZES["long_groups"])
    ref = np.asarray(_ffn(*args, "ragged_dot"))
    out = jax.jit(moe.grouped, static_argnums=5)(*args, tile)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


def test_rows_past_the_groups_are_zero_as_in_ragged_dot():
    xs, sizes, *w = expert_inputs([4, 0, 3, 0, 0, 0, 0, 2])
    xs = jnp.concatenate([xs, jnp.ones((5, xs.shape[1]))])  # 5 rows in no group
    ref = np.asarray(_ffn(xs, sizes, *w, "ragged_dot"))
    assert not ref[9:].any()
    for impl in ("grouped", "gmm"):
        np.testing.assert_allclose(np.asarray(_ffn(xs, sizes, *w, impl)), ref, atol=1e-5)


def test_tile_rows_follow_the_mean_group():
    assert moe.tile_rows(512, 256) == 8  # decode-sized: at most 7 padding rows per expert
    assert moe.tile_rows(16384, 256) == 64
    assert moe.tile_rows(1 << 20, 8) == 128
    assert moe.tile_rows(0, 8) == 8


@pytest.mark.parametrize(
    "cfg",
    # whole greedy runs per implementation: the full tier (the rows of each implementation
    # against ragged_dot stay in the fast one)
    [
        pytest.param(c, marks=pytest.mark.slow)
        for c in (TINY_DEEPSEEK, TINY_DEEPSEEK_V2, TINY_QWEN3_MOE)
    ],
    ids=lambda c: c.name,
)
def test_greedy_tokens_are_identical_under_every_moe_impl(cfg):
    models = {
        impl: dm.init_model(dataclasses.replace(cfg, moe_impl=impl), 0) for impl in moe.MOE_IMPLS
    }
    assert cfg.is_moe_layer(2)
    assert [m.layers[2].mlp.moe_impl for m in models.values()] == list(moe.MOE_IMPLS)
    tokens = {impl: dm.generate(ModelRunner(m), PROMPTS, 8) for impl, m in models.items()}
    assert tokens["grouped"] == tokens["ragged_dot"]
    assert tokens["gmm"] == tokens["ragged_dot"]


def test_auto_is_ragged_dot_on_cpu_and_bad_names_are_refused():
    assert moe.resolve_moe_impl("auto") == "ragged_dot"  # tests pin the CPU
    assert [moe.resolve_moe_impl(i) for i in moe.MOE_IMPLS] == list(moe.MOE_IMPLS)
    with pytest.raises(ValueError, match="moe_impl must be"):
        moe.resolve_moe_impl("dense")
    with pytest.raises(ValueError, match="moe_impl must be"):
        dm.init_model(dataclasses.replace(TINY_DEEPSEEK, moe_impl="dense"), 0)
    cfg = ExperimentConfig()
    assert apply_overrides(cfg, ["model.moe_impl=grouped"]).model.moe_impl == "grouped"
    with pytest.raises(ConfigError, match=r"model.moe_impl: must be one of"):
        validate(apply_overrides(cfg, ["model.moe_impl=dense"]))


def test_the_moe_impl_is_not_part_of_the_kv_identity():
    fps = {
        model_fingerprint(dataclasses.replace(TINY_DEEPSEEK, moe_impl=i))
        for i in ("auto", *moe.MOE_IMPLS)
    }
    assert len(fps) == 1


def test_gmm_without_megablox_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.tpu.megablox", None)
    with pytest.raises(ValueError, match="moe_impl 'gmm' needs Pallas megablox"):
        moe.expert_ffn(*expert_inputs(SIZES["mixed"]), "gmm")
