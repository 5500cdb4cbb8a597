"""KV rows: where each KV head's key and value sit in a row, and the rows' fp8 scales.

A layer's KV for one token is one row `[W]` in `kv_dtype` (`ModelConfig.kv_width`); pages hold
rows as they are, or as the unsigned integers of their width (`bits_dtype`). Where K and V sit
inside a row is a `RowLayout`: GQA rows are head-major, `[Hk, K | V]`, so KV head `h`'s key is
columns `2h*D .. 2h*D+D` and its value the `D` after it (a slice of a row holds whole heads:
pages shard over KV heads); MLA rows (absorbed form) are `c_kv | k_pe` with one KV head whose key
is the whole row and whose value is the latent. Keys may be split into segments (MLA: 512 + 64)
so every slice a kernel loads is a power of two wide. Scaled rows (fp8 KV with
`ModelConfig.kv_scales`) carry per-token float32 scales inside each head's columns, after its
data (`quantize_rows`, `split_kv`): a slice of whole heads keeps its scales.
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

    KV head `h` owns the columns `h * head_stride .. (h + 1) * head_stride` (the heads' spans
    tile the row). Its key: the concatenation over `key_segments` `((off, width), ...)` of the
    columns `h * head_stride + off .. + width`; its value: the same over `value_segments`.
    Scaled rows (`scale_offset >= 0`, fp8 KV with `ModelConfig.kv_scales`) keep each head's
    float32 per-token scales inside its span, after its data: scale `j` of head `h` is the 4
    one-byte elements at `h * head_stride + scale_offset + 4 * j`, and key segment `k` is `data
    * scale[key_scales[k]]` (values: `value_scales`). So a run of whole heads' columns is itself
    a row of that many heads (`with_heads`): pages split over KV heads with their scales."""

    num_kv_heads: int
    key_segments: tuple[tuple[int, int], ...]
    value_segments: tuple[tuple[int, int], ...]
    head_stride: int
    scale_offset: int = -1
    key_scales: tuple[int, ...] = ()
    value_scales: tuple[int, ...] = ()

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
    def scales_per_head(self) -> int:
        return len({*self.key_scales, *self.value_scales}) if self.scaled else 0

    @property
    def num_scales(self) -> int:
        """Scales per token (every head's)."""
        return self.scales_per_head * self.num_kv_heads

    def scale_column(self, h, j: int):
        """The first of the 4 elements holding head `h`'s scale `j` (a traced head is fine)."""
        return h * self.head_stride + self.scale_offset + 4 * j

    @property
    def scale_columns(self) -> list[int]:
        """Every scale's first column, head by head."""
        return [self.scale_column(h, j) for h in range(self.num_kv_heads)
                for j in range(self.scales_per_head)]  # fmt: skip

    def _distinct(self) -> dict[tuple[int, int], int]:
        """`(offset, width) -> scale index or -1` of a head's distinct data segments."""
        out: dict[tuple[int, int], int] = {}
        for segs, scales in ((self.key_segments, self.key_scales),
                             (self.value_segments, self.value_scales)):  # fmt: skip
            for k, seg in enumerate(segs):
                out.setdefault(seg, scales[k] if self.scaled else -1)
        return out

    def spans(self, h):
        """`(offset, width, scale column or -1)` of every distinct data segment of KV head `h`
        (a traced head is fine: the segments are told apart at head 0)."""
        return [
            (off + h * self.head_stride, w, self.scale_column(h, j) if j >= 0 else -1)
            for (off, w), j in self._distinct().items()
        ]

    def head_segments(self, h, start) -> tuple[list, list]:
        """KV head `h`'s key and value segments `(offset, width, scale column or None)`, the
        columns counted from `start` (where the head's span begins in what a kernel loaded;
        traced values are fine)."""

        def segs(segments, scales):
            if not self.scaled:
                return [(start + o, w, None) for o, w in segments]
            return [
                (start + o, w, start + self.scale_column(0, j))
                for (o, w), j in zip(segments, scales)
            ]

        return segs(self.key_segments, self.key_scales), segs(
            self.value_segments, self.value_scales
        )

    def with_heads(self, n: int) -> RowLayout:
        """The layout of a run of `n` whole heads' columns (a device's share of split rows)."""
        return dataclasses.replace(self, num_kv_heads=n)

    @classmethod
    def gqa(cls, num_kv_heads: int, head_dim: int, scaled: bool = False) -> RowLayout:
        """Head-major rows `[Hk, K | V]` (head h's key then its value, `D` each), so a
        contiguous slice of the row holds whole KV heads: KV pages shard over the tensor axis
        by slicing rows (`model/sharding.py`). Scaled: `[Hk, K | V | k scale | v scale]`."""
        hk, d = num_kv_heads, head_dim
        if not scaled:
            return cls(hk, ((0, d),), ((d, d),), 2 * d)
        return cls(hk, ((0, d),), ((d, d),), 2 * d + 8, 2 * d, (0,), (1,))

    @property
    def head_major(self) -> bool:
        """Unscaled rows `[Hk, K | V]` with one key and one value segment per head: keys and
        values are a reshape of the rows."""
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
        one scale per `SCALE_TILE` latent columns and one for the RoPE part, after the data."""
        r, dr = kv_lora_rank, rope_dim
        if not scaled:
            return cls(1, ((0, r), (r, dr)), ((0, r),), r + dr)
        tiles = tuple((o, min(SCALE_TILE, r - o)) for o in range(0, r, SCALE_TILE))
        n = len(tiles)
        width = r + dr + 4 * (n + 1)
        return cls(1, (*tiles, (r, dr)), tiles, width, r + dr, (*range(n), n), tuple(range(n)))

    @classmethod
    def for_model(cls, cfg) -> RowLayout:
        """The layout of a `ModelConfig`'s KV rows (`row_width == cfg.kv_width`)."""
        if cfg.is_mla:
            return cls.mla(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.kv_scales)
        return cls.gqa(cfg.num_kv_heads, cfg.head_dim, cfg.kv_scales)

    @property
    def unscaled(self) -> RowLayout:
        """The layout of the same data without scales (what `quantize_rows` quantizes)."""
        if not self.scaled:
            return self
        return RowLayout(self.num_kv_heads, self.key_segments, self.value_segments,
                         self.scale_offset)  # fmt: skip

    @property
    def data_width(self) -> int:
        """Elements of a row without its scales (the float rows `quantize_rows` takes)."""
        return self.unscaled.row_width

    @property
    def row_width(self) -> int:
        return self.num_kv_heads * self.head_stride


def _per_head(x: Array, heads: int) -> Array:
    """Rows `[..., W]` -> `[..., heads, W / heads]` (a reshape: keeps KV heads sharded)."""
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def quantize_rows(x: Array, layout: RowLayout, kv_dtype) -> Array:
    """Float rows `[..., data_width]` (`layout.unscaled`) -> scaled fp8 rows `[..., row_width]`
    in `kv_dtype`: each segment of each head divided by its per-token scale (its max magnitude
    over the dtype's largest finite value), the head's scales' bytes after its data."""
    kv_dtype = jnp.dtype(kv_dtype)
    fmax = float(jnp.finfo(kv_dtype).max)
    heads = _per_head(x.astype(jnp.float32), layout.num_kv_heads)
    parts, scales, end = [], [None] * layout.scales_per_head, 0
    for (off, w), j in sorted(layout._distinct().items()):
        if off != end:
            raise ValueError(f"{layout}: the segments do not cover a head's data in order")
        seg = heads[..., off : off + w]
        amax = jnp.max(jnp.abs(seg), axis=-1, keepdims=True)
        sc = jnp.where(amax > 0, amax / fmax, 1.0)
        parts.append((seg / sc).astype(kv_dtype))
        scales[j], end = sc, off + w
    sbytes = jax.lax.bitcast_convert_type(jnp.concatenate(scales, axis=-1), jnp.uint8)
    sbytes = jax.lax.bitcast_convert_type(sbytes.reshape(*heads.shape[:-1], -1), kv_dtype)
    out = jnp.concatenate([*parts, sbytes], axis=-1)
    return out.reshape(*x.shape[:-1], layout.row_width)


def head_scales(rows: Array, layout: RowLayout) -> Array:
    """The scales `[..., num_kv_heads, scales_per_head]` float32 of scaled rows (kv dtype or
    its bits)."""
    heads = _per_head(as_bits(rows), layout.num_kv_heads)
    raw = heads[..., layout.scale_offset : layout.scale_offset + 4 * layout.scales_per_head]
    raw = raw.reshape(*heads.shape[:-1], layout.scales_per_head, 4)
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
    """KV rows `[..., W]` (kv dtype or its bits) -> keys `[..., Hk, dk]` and values
    `[..., Hk, dv]` in `dtype`, dequantized where the layout is scaled. The rows are viewed per
    head (a reshape), so rows split by KV head give keys and values split the same way."""
    x = _per_head(jax.lax.bitcast_convert_type(as_bits(rows), kv_dtype), layout.num_kv_heads)
    if layout.scaled:
        sc = head_scales(rows, layout)
        x = x.astype(jnp.float32)
    else:
        x = x.astype(dtype)

    def part(segs, scales):
        parts = []
        for k, (off, w) in enumerate(segs):
            seg = x[..., off : off + w]
            if layout.scaled:
                seg = (seg * sc[..., scales[k], None]).astype(dtype)
            parts.append(seg)
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

    return part(layout.key_segments, layout.key_scales), part(
        layout.value_segments, layout.value_scales
    )
