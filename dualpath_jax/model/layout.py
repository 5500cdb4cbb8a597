"""KV sizes and the Layer Block / Full Block byte layout (docs/architecture.md).

A layer's cached KV is held as *KV rows*: `[T, W]` in `kv_dtype`, one row per token, where
`W = ModelConfig.kv_width` (GQA: K then V, each `[num_kv_heads, head_dim]` flattened; MLA: the
normalized latent `c_kv` then the RoPE'd shared key `k_pe`). The byte layout is the rows viewed as
uint8, so no conversion happens between the model and the store:

- Full Block:  `[num_layers, block_tokens, bytes_per_token_per_layer]` uint8 (storage unit)
- Layer Block: `[1, block_tokens, bytes_per_token_per_layer]` uint8 (streaming unit)

Concatenating a block's layer blocks along axis 0 gives its full block.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from dualpath_jax.config import ModelConfig

# FlashMLA's FP8 KV format per token per layer: 512 FP8 latent + 4 FP32 scales + 64 BF16 RoPE.
_FLASHMLA_TILE = 128


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for a config dtype name (bfloat16 and float8 via ml_dtypes)."""
    try:
        return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


def kv_bytes_per_token_per_layer(cfg: ModelConfig, kv_format: str | None = None) -> int:
    """Bytes of cached KV for one token in one layer.

    `kv_format` is a dtype name (default `cfg.kv_dtype`) or `"fp8_flashmla"` for the MLA FP8
    layout with per-tile FP32 scales and a BF16 RoPE part (656 B for DeepSeek-V3's 512 + 64).
    """
    kv_format = kv_format or cfg.kv_dtype
    if kv_format == "fp8_flashmla":
        if not cfg.is_mla:
            raise ValueError("fp8_flashmla applies to MLA models only")
        tiles = -(-cfg.kv_lora_rank // _FLASHMLA_TILE)
        return cfg.kv_lora_rank + 4 * tiles + 2 * cfg.qk_rope_head_dim
    return cfg.kv_width * np_dtype(kv_format).itemsize


def kv_bytes_per_token(cfg: ModelConfig, kv_format: str | None = None) -> int:
    """Bytes of cached KV for one token across all layers."""
    return cfg.num_layers * kv_bytes_per_token_per_layer(cfg, kv_format)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Shape of a Full Block: `[num_layers, block_tokens, bytes_per_token_per_layer]` uint8."""

    num_layers: int
    block_tokens: int
    bytes_per_token_per_layer: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_tokens: int) -> BlockLayout:
        return cls(cfg.num_layers, block_tokens, kv_bytes_per_token_per_layer(cfg))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_layers, self.block_tokens, self.bytes_per_token_per_layer)

    @property
    def layer_nbytes(self) -> int:
        return self.block_tokens * self.bytes_per_token_per_layer

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def layer_offset(self, layer: int) -> int:
        """Byte offset of a layer inside a Full Block payload."""
        if not 0 <= layer <= self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers}]")
        return layer * self.layer_nbytes


def kv_rows_to_bytes(rows: np.ndarray) -> np.ndarray:
    """`[..., T, W]` KV rows -> `[..., T, W * itemsize]` uint8 (a view when contiguous)."""
    rows = np.ascontiguousarray(rows)
    return rows.view(np.uint8).reshape(*rows.shape[:-1], rows.shape[-1] * rows.dtype.itemsize)


def bytes_to_kv_rows(data: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`[..., T, bytes]` uint8 -> `[..., T, W]` KV rows in `cfg.kv_dtype`."""
    dt = np_dtype(cfg.kv_dtype)
    expected = cfg.kv_width * dt.itemsize
    if data.dtype != np.uint8 or data.shape[-1] != expected:
        raise ValueError(
            f"KV bytes of shape {data.shape} dtype {data.dtype}: expected uint8 with last axis {expected}"
        )
    return np.ascontiguousarray(data).view(dt).reshape(*data.shape[:-1], cfg.kv_width)


def kv_to_full_blocks(kv: np.ndarray, block_tokens: int) -> np.ndarray:
    """All layers' KV rows `[L, T, W]` (T a multiple of block_tokens) -> `[n, L, bt, bytes]` uint8."""
    n_layers, t, _ = kv.shape
    if t % block_tokens:
        raise ValueError(f"{t} tokens is not a whole number of {block_tokens}-token blocks")
    b = kv_rows_to_bytes(kv)  # [L, T, bytes]
    n = t // block_tokens
    return np.ascontiguousarray(b.reshape(n_layers, n, block_tokens, -1).transpose(1, 0, 2, 3))


def full_blocks_to_kv(blocks: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`[n, L, bt, bytes]` uint8 Full Blocks -> KV rows `[L, n * bt, W]`."""
    n, n_layers, bt, nbytes = blocks.shape
    if n_layers != cfg.num_layers:
        raise ValueError(f"blocks have {n_layers} layers, model has {cfg.num_layers}")
    flat = blocks.transpose(1, 0, 2, 3).reshape(n_layers, n * bt, nbytes)
    return bytes_to_kv_rows(flat, cfg)


def layer_block(full_block: np.ndarray, layer: int) -> np.ndarray:
    """The Layer Block `[1, bt, bytes]` of one layer of a Full Block `[L, bt, bytes]` (a view)."""
    return full_block[layer : layer + 1]


def layer_blocks_to_full(layer_blocks: list[np.ndarray]) -> np.ndarray:
    """Concatenates a block's Layer Blocks (in layer order) into its Full Block."""
    return np.concatenate(layer_blocks, axis=0)
