"""KV layouts as layer groups: one group is today's Full Block byte for byte; several groups have
per-group rows, sizes and retention, a stable identity, and clear errors where unsupported."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

import numpy as np
import pytest

from dualpath_jax import config
from dualpath_jax.config import StoreConfig
from dualpath_jax.kernels.kv_rows import RowLayout
from dualpath_jax.kvstore.codec import BlockFormat
from dualpath_jax.kvstore.identity import block_keys, key_path, model_fingerprint
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.model.layout import (
    BlockLayout,
    LayerGroup,
    Retention,
    UnsupportedLayout,
    kv_bytes_per_token_per_layer,
    kv_to_full_blocks,
    np_dtype,
)
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2

BT = 16
PROMPT = [(i * 37 + 11) % 257 for i in range(4 * BT + 6)]  # 4 whole blocks and 6 tokens more

# Model fingerprint and sha256 of the four stored blocks' files (key order) of PROMPT through the
# file store, computed with the store and layout before layer groups existed: the store's bytes
# and the block keys of a one-group layout must not change.
GOLDEN = {
    "qwen2_f32": (
        TINY_QWEN2,
        "1a943262a362e142ce2135e63c9ea019",
        "bd8d78de2f0473dbd7ca598f97dc6821c352d97792de745981839687cf0aee3d",
    ),
    "deepseek_bf16": (
        dataclasses.replace(TINY_DEEPSEEK, kv_dtype="bfloat16"),
        "e2f92f859624ec1c97021b4e06dc6d5c",
        "66f24adf55c0e1affddf1d13fe4afb467bb8aa4d7f971c16cf2e8bf0ec9f50cb",
    ),
    "qwen2_fp8_scaled": (
        dataclasses.replace(TINY_QWEN2, kv_dtype="float8_e4m3fn", kv_scales=True),
        "32cb56ffef93aac2a68c8bf4827ea58f",
        "df205d1b57a7357fd4beb183713e05ab87c64b060af7183543f9fdf20dd4878b",
    ),
}

WINDOWED = dataclasses.replace(TINY_QWEN2, sliding_window=40, sliding_window_layers=(1,))


def prompt_rows(cfg: config.ModelConfig, tokens: int) -> np.ndarray:
    """KV rows `[L, tokens, W]` in `cfg.kv_dtype` made by integer arithmetic (exact in every
    dtype, the same on every machine): the shape a prompt's KV has, not a forward's floats."""
    n = cfg.num_layers * tokens * cfg.kv_width
    i = np.arange(n, dtype=np.int64)
    if cfg.kv_scales:  # scaled rows are raw bytes (data and scales) of the 1-byte dtype
        flat = (i * 7919 % 251).astype(np.uint8).view(np_dtype(cfg.kv_dtype))
    else:
        flat = ((i * 7919 % 1021 - 510).astype(np.float32) / 64).astype(np_dtype(cfg.kv_dtype))
    return flat.reshape(cfg.num_layers, tokens, cfg.kv_width)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_one_group_stores_the_same_bytes(tmp_path, name):
    cfg, fingerprint, digest = GOLDEN[name]
    assert model_fingerprint(cfg) == fingerprint
    keys = block_keys(PROMPT, BT, fingerprint)
    kv = prompt_rows(cfg, len(PROMPT))
    store_cfg = StoreConfig(root=str(tmp_path), block_tokens=BT, capacity_bytes=-1)
    with open_block_store(store_cfg, cfg) as store:
        assert store.fmt.layout.uniform
        store.write_full(keys, kv_to_full_blocks(kv[:, : len(keys) * BT], BT)).result(10)
    h = hashlib.sha256()
    for key in keys:
        h.update((tmp_path / key_path(key)).read_bytes())
    assert h.hexdigest() == digest


@pytest.mark.parametrize("cfg", [c for c, _, _ in GOLDEN.values()], ids=sorted(GOLDEN))
def test_one_group_is_the_full_block(cfg):
    lay = BlockLayout.for_model(cfg, BT)
    width = kv_bytes_per_token_per_layer(cfg)
    (group,) = lay.groups
    assert group.layers == tuple(range(cfg.num_layers)) and group.retention == Retention.ALL
    assert group.row == RowLayout.for_model(cfg) and group.kv_dtype == cfg.kv_dtype
    assert group.row_bytes == width == cfg.kv_width * np_dtype(cfg.kv_dtype).itemsize
    # page geometry: a page is one block's rows of a layer; the decode pool's page all layers'
    assert (group.page_size, group.pages_per_block, group.page_nbytes) == (BT, 1, BT * width)
    bytes_only = BlockLayout(cfg.num_layers, BT, width)
    for lay_ in (lay, bytes_only):
        assert lay_.uniform
        assert lay_.shape == (cfg.num_layers, BT, width)
        assert lay_.bytes_per_token_per_layer == width
        assert (lay_.num_layers, lay_.block_tokens) == (cfg.num_layers, BT)
        assert lay_.layer_nbytes == BT * width and lay_.nbytes == cfg.num_layers * BT * width
        assert [lay_.layer_offset(i) for i in range(cfg.num_layers + 1)] == [
            i * BT * width for i in range(cfg.num_layers + 1)
        ]
    kv = prompt_rows(cfg, 3 * BT)
    blocks = kv_to_full_blocks(kv, BT)
    assert blocks.shape == (3, *lay.shape) and blocks.dtype == np.uint8
    # block n, layer l is the bytes of that layer's rows n*bt .. (n+1)*bt
    assert blocks[1, 2].tobytes() == kv[2, BT : 2 * BT].tobytes()


def three_groups() -> BlockLayout:
    """Layers 0 and 3 keep all tokens, layer 1 the last 40, layer 2 one 96-byte state."""
    row = RowLayout.for_model(TINY_QWEN2)
    return BlockLayout(
        groups=[
            LayerGroup((2,), 96, BT, retention=Retention.STATE),
            LayerGroup((0, 3), 256, BT, row=row, kv_dtype="float32"),
            LayerGroup((1,), 128, BT, page_size=8, retention="window", window=40),
        ]
    )


def test_several_groups_geometry():
    lay = three_groups()
    assert [g.layers for g in lay.groups] == [(0, 3), (1,), (2,)]  # ordered by first layer
    assert [lay.group_index(i) for i in range(4)] == [0, 1, 2, 0]
    assert lay.group_of(2).retention == Retention.STATE
    assert [lay.layer_part_shape(i) for i in range(4)] == [(BT, 256), (BT, 128), (1, 96), (BT, 256)]
    assert [g.layer_nbytes for g in lay.groups] == [BT * 256, BT * 128, 96]
    assert [g.nbytes for g in lay.groups] == [2 * BT * 256, BT * 128, 96]
    assert lay.nbytes == 2 * BT * 256 + BT * 128 + 96
    assert [lay.layer_offset(i) for i in range(5)] == [
        0,
        BT * 256,
        BT * 256 + BT * 128,
        BT * 256 + BT * 128 + 96,
        lay.nbytes,
    ]
    window = lay.groups[1]
    assert (window.page_size, window.pages_per_block, window.page_nbytes) == (8, 2, 8 * 128)
    assert (lay.groups[2].pages_per_block, lay.groups[2].page_nbytes) == (1, 96)
    assert (lay.num_layers, lay.block_tokens, lay.uniform) == (4, BT, False)
    with pytest.raises(IndexError):
        lay.group_index(4)


@pytest.mark.parametrize("attr", ["shape", "bytes_per_token_per_layer", "layer_nbytes"])
def test_uniform_attributes_refuse_several_groups(attr):
    with pytest.raises(UnsupportedLayout, match=rf"BlockLayout\.{attr} takes one layer group"):
        getattr(three_groups(), attr)


def test_retention_token_counts():
    full, window, state = (
        LayerGroup((0,), 4, BT),
        LayerGroup((0,), 4, BT, retention=Retention.WINDOW, window=40),
        LayerGroup((0,), 4, BT, retention=Retention.STATE),
    )
    ns = [0, 5, 16, 40, 41, 100]
    assert [full.kept_tokens(n) for n in ns] == ns
    assert [window.kept_tokens(n) for n in ns] == [0, 5, 16, 40, 40, 40]
    assert [state.kept_tokens(n) for n in ns] == [0] * 6
    assert [full.kept_bytes(n) for n in ns] == [4 * n for n in ns]
    assert [window.kept_bytes(n) for n in ns] == [0, 20, 64, 160, 160, 160]
    assert [state.kept_bytes(n) for n in ns] == [0, 4, 4, 4, 4, 4]
    # the blocks a context reads: all of them; those holding the last 40 tokens; the last state
    assert [full.needed_blocks(n) for n in ns] == [range(a) for a in (0, 1, 1, 3, 3, 7)]
    assert [window.needed_blocks(n) for n in ns] == [
        range(0, 0),
        range(0, 1),
        range(0, 1),
        range(0, 3),
        range(0, 3),  # tokens 1..40 start in block 0
        range(3, 7),  # tokens 60..99
    ]
    assert [state.needed_blocks(n) for n in ns] == [range(0)] * 2 + [
        range(0, 1),
        range(1, 2),
        range(1, 2),
        range(5, 6),
    ]
    with pytest.raises(ValueError, match="context"):
        full.kept_tokens(-1)


def test_identity_json_and_hash():
    lay = three_groups()
    text = lay.to_json()
    assert BlockLayout.from_dict(json.loads(text)) == lay
    assert hash(BlockLayout.from_dict(json.loads(text))) == hash(lay)
    assert text == three_groups().to_json()  # canonical: sorted keys, no spaces
    assert json.loads(text)["groups"][1] == {
        "layers": [1],
        "row_bytes": 128,
        "block_tokens": BT,
        "page_size": 8,
        "retention": "window",
        "window": 40,
        "row": None,
        "kv_dtype": "",
    }
    assert re.fullmatch("[0-9a-f]{32}", lay.digest)
    # the digest is of the canonical JSON, the same in every process
    assert lay.digest == hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    one_group = BlockLayout(3, BT, 256)  # a literal: the text and digest are stable
    assert one_group.to_json() == (
        '{"groups":[{"block_tokens":16,"kv_dtype":"","layers":[0,1,2],"page_size":16,'
        '"retention":"all","row":null,"row_bytes":256,"window":0}]}'
    )
    assert one_group.digest == "fea43b131264890e40ab22d4f0fc1f5d"
    one = BlockLayout.for_model(TINY_QWEN2, BT)
    assert (
        BlockLayout.from_dict(one.to_dict()) == one
        and {one: 1}[BlockLayout.for_model(TINY_QWEN2, BT)]
    )
    other = dataclasses.replace(lay.groups[1], window=41)
    assert BlockLayout(groups=[*lay.groups[:1], other, lay.groups[2]]).digest != lay.digest


def test_replace_resizes_a_uniform_layout():
    lay = BlockLayout.for_model(TINY_QWEN2, BT)
    fewer = dataclasses.replace(lay, num_layers=2)
    assert fewer.shape == (2, BT, 256) and fewer.groups[0].row == lay.groups[0].row
    wider = dataclasses.replace(lay, bytes_per_token_per_layer=12, block_tokens=4)
    assert wider == BlockLayout(3, 4, 12) and wider.groups[0].page_size == 4


def test_windowed_model_maps_to_a_window_group():
    lay = BlockLayout.for_model(WINDOWED, BT)
    assert [(g.layers, g.retention, g.window) for g in lay.groups] == [
        ((0, 2), Retention.ALL, 0),
        ((1,), Retention.WINDOW, 40),
    ]
    assert all(g.row == RowLayout.for_model(WINDOWED) for g in lay.groups)
    assert not lay.uniform and lay.summary == (
        "layers 0,2: all tokens, 256 B rows; layer 1: last 40 tokens, 256 B rows"
    )
    # a window is part of the KV's identity; no window keeps the fingerprint of before
    assert model_fingerprint(WINDOWED) != model_fingerprint(TINY_QWEN2)
    assert model_fingerprint(dataclasses.replace(WINDOWED, sliding_window=41)) != (
        model_fingerprint(WINDOWED)
    )
    assert WINDOWED.is_window_layer(1) and not WINDOWED.is_window_layer(0)


def test_what_cannot_take_several_groups_says_so(tmp_path):
    with pytest.raises(UnsupportedLayout, match=r"the block store \(kvstore/codec.py"):
        BlockFormat(three_groups(), "float32", "ab" * 16)
    with pytest.raises(UnsupportedLayout, match="last 40 tokens"):
        open_block_store(StoreConfig(root=str(tmp_path), capacity_bytes=-1), WINDOWED)
    assert not os.listdir(tmp_path)
    with pytest.raises(UnsupportedLayout, match="layer 1 .* model forward and its attention"):
        init_model(WINDOWED)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: BlockLayout(3, 0, 8), "must be positive"),
        (lambda: BlockLayout(3, 16), "needs all three"),
        (lambda: dataclasses.replace(three_groups(), num_layers=2), "only a one-group"),
        (lambda: BlockLayout(groups=[LayerGroup((0, 2), 8, 16)]), "cover 0..L-1"),
        (
            lambda: BlockLayout(groups=[LayerGroup((0, 1), 8, 16), LayerGroup((1,), 8, 16)]),
            "cover 0..L-1",
        ),
        (
            lambda: BlockLayout(groups=[LayerGroup((0,), 8, 16), LayerGroup((1,), 8, 8)]),
            "same block_tokens",
        ),
        (lambda: LayerGroup((1, 0), 8, 16), "ascending"),
        (lambda: LayerGroup((), 8, 16), "ascending"),
        (lambda: LayerGroup((0,), 8, 16, page_size=5), "must divide"),
        (lambda: LayerGroup((0,), 8, 16, window=4), "window"),
        (lambda: LayerGroup((0,), 8, 16, retention=Retention.WINDOW), "window"),
        (lambda: LayerGroup((0,), 8, 16, page_size=8, retention="state"), "one state"),
        (lambda: LayerGroup((0,), 8, 16, row=RowLayout.gqa(2, 16)), "needs its kv_dtype"),
        (
            lambda: LayerGroup((0,), 8, 16, row=RowLayout.gqa(2, 16), kv_dtype="float32"),
            "row_bytes 8 != the row layout's 256 bytes",
        ),
    ],
)
def test_malformed_layouts(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.parametrize(
    "sets, key",
    [
        (["model.sliding_window=64"], "model.sliding_window"),
        (["model.sliding_window_layers=[1]"], "model.sliding_window"),
        (["model.sliding_window=64", "model.sliding_window_layers=[3]"], "sliding_window_layers"),
        (["model.sliding_window=64", "model.sliding_window_layers=[2, 1]"], "ascending"),
    ],
)
def test_window_config_is_checked(sets, key):
    cfg = config.apply_overrides(config.ExperimentConfig(), sets)
    with pytest.raises(config.ConfigError, match=key):
        config.validate(cfg)


def test_window_config_round_trips():
    cfg = config.apply_overrides(
        config.ExperimentConfig(), ["model.sliding_window=64", "model.sliding_window_layers=[0, 2]"]
    )
    assert (cfg.model.sliding_window, cfg.model.sliding_window_layers) == (64, (0, 2))
    assert config.validate(cfg) is cfg
    assert config.from_json(config.ExperimentConfig, config.to_json(cfg)) == cfg
