"""KV rows: where each KV head's key and value sit in a row, and the rows' fp8 scales.

A layer's KV for one token is one row `[W]` in `kv_dtype` (`ModelConfig.kv_width`); pages hold
rows as they are, or as the unsigned integers of their width (`bits_dtype`). Where K and V sit
inside a row is a `RowLayout`: GQA rows are head-major, `[Hk, K | V]`, so KV head `h`'s key is
columns `2h*D .. 2h*D+D` and its value the `D` after it (a slice of a row holds whole heads:
pages shard over KV heads); MLA rows (absorbed form) are `c_kv | k_pe` with one KV head whose key
is the whole row and whose value is the latent. Keys may be split into segments (MLA: 512 + 64)
so every slice a kernel loads is a power of two wide. Scaled rows (fp8 KV with
`ModelConfig.kv_scales`) end in per-token float32 scales (`quantize_rows`, `split_kv`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dualpath_jax.config import KV_SCALE_TILE

Array = jax.Array

SCALE_TILE = KV_SCALE_TILE  # MLA latent columns per fp8 scale


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where each KV head's key and value live in a KV row, and their fp8 scales.

    Key of KV head `h`: the concatenation over `key_segments` `((off, width), ...)` of columns
    `off + h * head_stride .. + width`; value: the same over `value_segments`. Scaled rows
    (`scale_offset >= 0`, fp8 KV with `ModelConfig.kv_scales`) end in one float32 scale per
    token per segment, stored as its 4 bytes: segment k of head h is `data * scale[i]` with
    `i = key_scales[k] + h * scale_stride` (values: `value_scales`), the scale's bytes at row
    elements `scale_offset + 4 * i ..+ 4`."""

    num_kv_heads: int
    key_segments: tuple[tuple[int, int], ...]
    value_segments: tuple[tuple[int, int], ...]
    head_stride: int
    scale_offset: int = -1
    key_scales: tuple[int, ...] = ()
    value_scales: tuple[int, ...] = ()
    scale_stride: int = 0

    @property
    def key_width(self) -> int:
        return sum(w for _, w in self.key_segments)

    @property
    def value_width(self) -> int:
        return sum(w for _, w in self.value_segments)

    @property
    def scaled(self) -> bool:
        return self.scale_offset >= 0

    @property
    def num_scales(self) -> int:
        """Scales per token (every head's)."""
        if not self.scaled:
            return 0
        idx = {i + h * self.scale_stride for h in range(self.num_kv_heads)
               for i in (*self.key_scales, *self.value_scales)}  # fmt: skip
        return len(idx)

    def spans(self, h):
        """`(offset, width, scale index or -1)` of every distinct segment of KV head `h` (a
        traced head is fine: the segments are told apart at head 0)."""
        out = {}
        for segs, scales in ((self.key_segments, self.key_scales),
                             (self.value_segments, self.value_scales)):  # fmt: skip
            for k, (off, w) in enumerate(segs):
                out.setdefault((off, w), scales[k] if self.scaled else -1)
        return [
            (off + h * self.head_stride, w, i + h * self.scale_stride if i >= 0 else -1)
            for (off, w), i in out.items()
        ]

    def head_segments(self, h, start) -> tuple[list, list]:
        """KV head `h`'s key and value segments `(offset, width, scale index or None)`, offsets
        from column `start` (where the head's columns begin in what a kernel loaded; traced
        values are fine)."""

        def segs(segments, scales):
            if not self.scaled:
                return [(start + o, w, None) for o, w in segments]
            return [
                (start + o, w, i + h * self.scale_stride) for (o, w), i in zip(segments, scales)
            ]

        return segs(self.key_segments, self.key_scales), segs(
            self.value_segments, self.value_scales
        )

    @classmethod
    def gqa(cls, num_kv_heads: int, head_dim: int, scaled: bool = False) -> RowLayout:
        """Head-major rows `[Hk, K | V]` (head h's key then its value, `D` each), so a
        contiguous slice of the row holds whole KV heads: KV pages shard over the tensor axis
        by slicing rows (`model/sharding.py`). Scaled: then `2 * Hk` scales (head h's key scale at
        `2h`, its value scale at `2h + 1`)."""
        hk, d = num_kv_heads, head_dim
        if not scaled:
            return cls(hk, ((0, d),), ((d, d),), 2 * d)
        return cls(hk, ((0, d),), ((d, d),), 2 * d, 2 * hk * d, (0,), (1,), 2)

    @property
    def head_major(self) -> bool:
        """Unscaled rows `[Hk, K | V]` with one key and one value segment per head: keys and
        values are a reshape of the rows (`split_kv`'s fast path, sharding-friendly)."""
        d = self.head_stride // 2
        return (
            not self.scaled
            and self.key_segments == ((0, d),)
            and self.value_segments == ((d, d),)
            and d > 0
        )

    @classmethod
    def mla(cls, kv_lora_rank: int, rope_dim: int, scaled: bool = False) -> RowLayout:
        """Rows `c_kv | k_pe`, one KV head whose key is the row and value the latent; scaled:
        one scale per `SCALE_TILE` latent columns and one for the RoPE part."""
        r, dr = kv_lora_rank, rope_dim
        if not scaled:
            return cls(1, ((0, r), (r, dr)), ((0, r),), 0)
        tiles = tuple((o, min(SCALE_TILE, r - o)) for o in range(0, r, SCALE_TILE))
        n = len(tiles)
        return cls(1, (*tiles, (r, dr)), tiles, 0, r + dr, (*range(n), n), tuple(range(n)), 0)

    @classmethod
    def for_model(cls, cfg) -> RowLayout:
        """The layout of a `ModelConfig`'s KV rows (`row_width == cfg.kv_width`)."""
        if cfg.is_mla:
            return cls.mla(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.kv_scales)
        return cls.gqa(cfg.num_kv_heads, cfg.head_dim, cfg.kv_scales)

    @property
    def data_width(self) -> int:
        """Row elements before the scales."""
        ends = [o + w + (self.num_kv_heads - 1) * self.head_stride
                for o, w in (*self.key_segments, *self.value_segments)]  # fmt: skip
        return max(ends)

    @property
    def row_width(self) -> int:
        return self.data_width + 4 * self.num_scales


def quantize_rows(x: Array, layout: RowLayout, kv_dtype) -> Array:
    """Float rows `[..., data_width]` -> scaled fp8 rows `[..., row_width]` in `kv_dtype`: each
    segment of each head divided by its per-token scale (its max magnitude over the dtype's
    largest finite value), the scales' bytes appended."""
    kv_dtype = jnp.dtype(kv_dtype)
    fmax = float(jnp.finfo(kv_dtype).max)
    data = x.astype(jnp.float32)
    out = jnp.zeros(data.shape, jnp.float32)
    scales = [None] * layout.num_scales
    for h in range(layout.num_kv_heads):
        for off, w, i in layout.spans(h):
            seg = data[..., off : off + w]
            amax = jnp.max(jnp.abs(seg), axis=-1, keepdims=True)
            sc = jnp.where(amax > 0, amax / fmax, 1.0)
            out = out.at[..., off : off + w].set(seg / sc)
            scales[i] = sc
    sbytes = jax.lax.bitcast_convert_type(jnp.concatenate(scales, axis=-1), jnp.uint8)
    sbytes = jax.lax.bitcast_convert_type(sbytes.reshape(*x.shape[:-1], -1), kv_dtype)
    return jnp.concatenate([out.astype(kv_dtype), sbytes], axis=-1)


def row_scales(rows: Array, layout: RowLayout) -> Array:
    """The scales `[..., num_scales]` float32 of scaled rows (kv dtype or its bits)."""
    raw = rows[..., layout.scale_offset : layout.scale_offset + 4 * layout.num_scales]
    raw = as_bits(raw).reshape(*rows.shape[:-1], layout.num_scales, 4)
    return jax.lax.bitcast_convert_type(raw, jnp.float32)


def bits_dtype(dtype) -> jnp.dtype:
    """The unsigned integer dtype of `dtype`'s width: what pages are held in."""
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def as_bits(x: Array) -> Array:
    """`x` as the unsigned integers of its width (unchanged if it is already)."""
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return x
    return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))


def split_kv(rows: Array, layout: RowLayout, kv_dtype, dtype) -> tuple[Array, Array]:
    """KV rows `[B, S, W]` (kv dtype or its bits) -> keys `[B, S, Hk, dk]` and values
    `[B, S, Hk, dv]` in `dtype`, dequantized where the layout is scaled."""
    x = jax.lax.bitcast_convert_type(as_bits(rows), kv_dtype)
    if layout.head_major and x.ndim == 3:  # a reshape: keeps KV heads sharded with the rows
        x = x.astype(dtype).reshape(*x.shape[:-1], layout.num_kv_heads, layout.head_stride)
        d = layout.head_stride // 2
        return x[..., :d], x[..., d:]
    if layout.scaled:
        sc = row_scales(rows, layout)
        x = x.astype(jnp.float32)
    else:
        x = x.astype(dtype)

    def head(h, segs, scales):
        parts = []
        for k, (off, w) in enumerate(segs):
            o = off + h * layout.head_stride
            part = x[..., o : o + w]
            if layout.scaled:
                part = (part * sc[..., scales[k] + h * layout.scale_stride, None]).astype(dtype)
            parts.append(part)
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

    hk = layout.num_kv_heads
    k = jnp.stack([head(h, layout.key_segments, layout.key_scales) for h in range(hk)], axis=2)
    v = jnp.stack([head(h, layout.value_segments, layout.value_scales) for h in range(hk)], axis=2)
    return k, v
