"""A decode step's attention over its pages, without the Pallas kernel (the `reference` and
`xla` backends): one query per request over the rows of its pages, its own row written there
already (`layers.attend_kv` writes, then reads).

`paged_decode_reference` gathers every page of the table into contiguous rows and attends
densely (`dense_attention.attend`): the oracle, and the `xla` backend's path (cuDNN's fused
attention where it can). `paged_decode_chunked` (the `reference` backend's) runs an online
softmax over `chunk_pages` pages at a time (a `lax.scan`): a chunk's keys and values stay in the
cache while they are used, where the whole gather streams every row of the batch through memory
three times (gathered, split per head, transposed for the dots). On a CPU that makes a step over
4 requests of 1,800 tokens about twice as fast, over 8 about four times (bench/decode_rows.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dualpath_jax.kernels.dense_attention import attend
from dualpath_jax.kernels.kv_rows import RowLayout, split_kv
from dualpath_jax.kernels.paged_attention import gather_pages

Array = jax.Array

CHUNK_PAGES = 16  # pages per step of `paged_decode_chunked` (256 tokens of 16-token pages)


def paged_decode_reference(
    q: Array,
    pages: Array,
    page_table: Array,
    lens: Array,
    layout: RowLayout,
    scale: float,
    *,
    layer: Array | int = 0,
    kv_dtype=None,
    written: Array | None = None,
    impl: str = "reference",
) -> Array:
    """One query per request (a decode step) over its pages after the step wrote its row at
    position `lens` (`written` `[B]`: 1 where it did, the default; 0: the request is idle, its
    output is zeros): `paged_attention_reference` without the copy of the pages' rows that
    appends the new ones (they are in the pages already), so a step reads its KV once."""
    rows = gather_pages(pages, page_table, layer)  # [B, T, W]
    kv_dtype = jnp.dtype(kv_dtype or q.dtype)
    k, v = split_kv(rows, layout, kv_dtype, q.dtype)
    written = jnp.ones_like(lens) if written is None else written
    mask = jnp.arange(rows.shape[1])[None, None, :] < (lens + written)[:, None, None]
    out = attend(q, k, v, mask, scale, impl)
    return jnp.where((written > 0)[:, None, None, None], out, 0).astype(out.dtype)


def paged_decode_chunked(
    q: Array,
    pages: Array,
    page_table: Array,
    lens: Array,
    layout: RowLayout,
    scale: float,
    *,
    layer: Array | int = 0,
    kv_dtype=None,
    written: Array | None = None,
    chunk_pages: int = CHUNK_PAGES,
) -> Array:
    """`paged_decode_reference` (`reference` backend) as an online softmax over `chunk_pages`
    pages of the table at a time (a divisor of its width: the widths are powers of two).
    Scores and softmax in float32, the probabilities in the values' dtype for their dot, as
    `attend`; equal to it up to float rounding."""
    b, m = page_table.shape
    _, n, hq, dk = q.shape
    hk = layout.num_kv_heads
    chunk = math.gcd(m, max(1, chunk_pages))
    kv_dtype = jnp.dtype(kv_dtype or q.dtype)
    written = jnp.ones_like(lens) if written is None else written
    live = (lens + written)[:, None, None, None]  # [B, 1, 1, 1]: positions < live are seen
    qg = q.reshape(b, hk, hq // hk, dk)
    tables = page_table.reshape(b, m // chunk, chunk).transpose(1, 0, 2)  # [steps, B, chunk]

    def step(carry, xs):
        top, den, acc = carry
        table, first = xs
        k, v = split_kv(gather_pages(pages, table, layer), layout, kv_dtype, q.dtype)
        s = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
        pos = first + jnp.arange(s.shape[-1])
        s = jnp.where(pos < live, s, -jnp.inf)
        new_top = jnp.maximum(top, s.max(-1))
        base = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # nothing seen yet: no shift
        p = jnp.exp(s - base[..., None])
        fade = jnp.exp(top - base)  # exp(-inf) = 0 while nothing was seen
        pv = jnp.einsum("bkgs,bskd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return (new_top, den * fade + p.sum(-1), acc * fade[..., None] + pv), None

    dv = layout.value_width
    init = (
        jnp.full((b, hk, hq // hk), -jnp.inf, jnp.float32),
        jnp.zeros((b, hk, hq // hk), jnp.float32),
        jnp.zeros((b, hk, hq // hk, dv), jnp.float32),
    )
    firsts = jnp.arange(m // chunk, dtype=jnp.int32) * chunk * pages.shape[2]
    (_, den, acc), _ = jax.lax.scan(step, init, (tables, firsts))
    out = (acc / jnp.where(den > 0, den, 1.0)[..., None]).reshape(b, n, hq, dv)
    return jnp.where((written > 0)[:, None, None, None], out, 0).astype(q.dtype)
