"""KV sizes (paper numbers) and exact Layer/Full Block conversions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dualpath_jax.model import layout
from dualpath_jax.presets import (
    DEEPSEEK_V32_660B,
    PRESETS,
    QWEN25_32B,
    TINY_DEEPSEEK,
    TINY_QWEN2,
)


def test_kv_bytes_per_token_paper_numbers():
    assert layout.kv_bytes_per_token(QWEN25_32B, "float16") == 262_144
    assert layout.kv_bytes_per_token(DEEPSEEK_V32_660B, "fp8_flashmla") == 40_016
    assert layout.kv_bytes_per_token(DEEPSEEK_V32_660B, "float8_e4m3fn") == 35_136
    assert layout.kv_bytes_per_token_per_layer(DEEPSEEK_V32_660B, "fp8_flashmla") == 656
    with pytest.raises(ValueError, match="MLA"):
        layout.kv_bytes_per_token(QWEN25_32B, "fp8_flashmla")


def test_every_preset_has_a_kv_size():
    for cfg in PRESETS.values():
        assert layout.kv_bytes_per_token(cfg) > 0


@pytest.mark.parametrize("cfg", [TINY_QWEN2, TINY_DEEPSEEK], ids=lambda c: c.name)
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_block_round_trip_is_exact(cfg, kv_dtype):
    cfg = dataclasses.replace(cfg, kv_dtype=kv_dtype)
    bt = 16
    rs = np.random.RandomState(0)
    kv = rs.randn(cfg.num_layers, 3 * bt, cfg.kv_width).astype(layout.np_dtype(kv_dtype))
    blocks = layout.kv_to_full_blocks(kv, bt)
    lay = layout.BlockLayout.for_model(cfg, bt)
    assert blocks.shape == (3, *lay.shape) and blocks.dtype == np.uint8
    assert blocks[0].nbytes == lay.nbytes
    back = layout.full_blocks_to_kv(blocks, cfg)
    assert back.dtype == kv.dtype
    assert back.tobytes() == kv.tobytes()
    # A block's layer blocks concatenate to its full block; each holds that layer's rows.
    for n in range(3):
        lbs = [layout.layer_block(blocks[n], i) for i in range(cfg.num_layers)]
        assert all(lb.shape == (1, bt, lay.bytes_per_token_per_layer) for lb in lbs)
        assert np.array_equal(layout.layer_blocks_to_full(lbs), blocks[n])
        for i, lb in enumerate(lbs):
            rows = layout.bytes_to_kv_rows(lb[0], cfg)
            assert rows.tobytes() == kv[i, n * bt : (n + 1) * bt].tobytes()
            off = lay.layer_offset(i)
            assert blocks[n].reshape(-1)[off : off + lay.layer_nbytes].tobytes() == lb.tobytes()


def test_layout_errors():
    with pytest.raises(ValueError, match="whole number"):
        layout.kv_to_full_blocks(np.zeros((3, 10, 64), np.float32), 16)
    with pytest.raises(ValueError, match="expected uint8"):
        layout.bytes_to_kv_rows(np.zeros((4, 7), np.uint8), TINY_QWEN2)
    with pytest.raises(ValueError, match="layers"):
        layout.full_blocks_to_kv(np.zeros((1, 2, 16, 256), np.uint8), TINY_QWEN2)
