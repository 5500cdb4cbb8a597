"""Paged attention: queries over KV held in pages of `block_tokens` rows, as a Pallas kernel.

KV pages are the store's blocks as they are: `pages[page]` is `[L, page_size, W]`, the KV rows
(`kv_rows.py`) of every layer of `page_size` tokens, which with `page_size = block_tokens` is one
Full Block (and `pages[page, layer]` one Layer Block), so a block read from the store, pulled
from a DE or written by decode sits in one page without any reshuffle. A request's cached tokens
are the first `cached_len` rows of its pages in page-table order; its new tokens' rows are passed
separately (`new_rows`, the layer's output of `project`), so the cached part never has to be
contiguous and the new part needs no page write before attention. Query token `j` of a request
sees every cached token and new tokens `0..j` (causal). Where each KV head's key and value sit in
a row is the row's `kv_rows.RowLayout`.

The kernel (`paged_attention`) is one program per (request, KV head, query block): an online
softmax over the request's live cached pages only (the loop stops at `cached_len`), then over
the causal part of the new rows. Nothing of size `[queries, keys]` is materialized beyond one
page, so memory does not grow with the context or with the longest request of a batch. It is a
portable Pallas kernel: Pallas-Triton on GPU, and `interpret=True` (the default off GPU) runs it
on CPU, where tests check it against `paged_attention_reference`, which gathers the pages into
contiguous rows and runs the dense path (`dense_attention.attend`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dualpath_jax.kernels.dense_attention import attend, prefill_mask
from dualpath_jax.kernels.kv_rows import RowLayout, as_bits, split_kv

Array = jax.Array

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(
    lens_ref,  # [B] cached lengths
    table_ref,  # [B, M] page ids
    layer_ref,  # [1] layer index
    write_ref,  # [B] new rows to write into the pages (write mode), else unused
    q_ref,  # [bq * G, dk] this block's queries, query-major (row r is query r // G)
    pages_ref,  # [P, L, page_size, W]
    new_ref,  # [N, W] this request's new rows
    o_ref,  # [bq * G, dv]
    *pages_out,  # write mode: `pages_ref`'s buffer (aliased)
    layout: RowLayout,
    group: int,
    block_q: int,
    scale: float,
    kv_dtype: jnp.dtype,
):
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if pages_out:
        # In write mode every page access goes through the output ref (the same buffer): the
        # input ref is then unused, which keeps interpret mode from carrying (copying) both.
        pages_ref = pages_out[0]
        _write_rows(write_ref, table_ref, layer_ref, lens_ref, new_ref, pages_ref, layout, block_q)
    cached = lens_ref[b]
    layer = layer_ref[0]
    page_size = pages_ref.shape[2]
    rows = block_q * group
    q = q_ref[...]
    # Split the queries by key segment once (the score is the sum over segments).
    q_parts, start = [], 0
    for _, w in layout.key_segments:
        q_parts.append(q[:, start : start + w])
        start += w
    k0 = h * layout.head_stride
    stride = layout.scale_stride

    def segments(segs, scales):
        if not layout.scaled:
            return [(k0 + o, w, None) for o, w in segs]
        return [(k0 + o, w, i + h * stride) for (o, w), i in zip(segs, scales)]

    keys = segments(layout.key_segments, layout.key_scales)
    values = segments(layout.value_segments, layout.value_scales)

    def dequant(ref_load):
        """ref_load(off, width) -> raw bits `[keys, width]`; returns load(off, w, scale index)
        giving the segment in the compute dtype (times its per-token scale unless the index is
        None)."""

        def load(off, w, i):
            x = jax.lax.bitcast_convert_type(ref_load(off, w), kv_dtype)
            if i is None:
                return x.astype(q.dtype)
            raw = ref_load(layout.scale_offset + 4 * i, 4)
            sc = jax.lax.bitcast_convert_type(raw, jnp.float32)  # [keys]
            return (x.astype(jnp.float32) * sc[:, None]).astype(q.dtype)

        return load

    def scores(load):
        s = None
        for (off, w, i), qp in zip(keys, q_parts):
            part = jax.lax.dot_general(
                qp,
                load(off, w, i),
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            s = part if s is None else s + part
        return s * scale

    def value(load):
        parts = [load(off, w, i) for off, w, i in values]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    def update(carry, s, v):
        acc, m, denom = carry
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * denom + p.sum(axis=1)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return acc * alpha[:, None] + pv, m_new, l_new

    carry = (
        jnp.zeros((rows, layout.value_width), jnp.float32),
        jnp.full((rows,), _NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )

    def cached_page(j, carry):
        page = table_ref[b, j]

        load = dequant(lambda off, w: pages_ref[page, layer, :, pl.ds(off, w)])
        s = scores(load)
        pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(pos < cached, s, _NEG)
        return update(carry, s, value(load))

    carry = jax.lax.fori_loop(0, pl.cdiv(cached, page_size), cached_page, carry)

    q_pos = qi * block_q + jax.lax.broadcasted_iota(jnp.int32, (rows, block_q), 0) // group

    def new_block(j, carry):
        load = dequant(lambda off, w: new_ref[pl.ds(j * block_q, block_q), pl.ds(off, w)])
        s = scores(load)
        k_pos = j * block_q + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(k_pos <= q_pos, s, _NEG)
        return update(carry, s, value(load))

    acc, _, denom = jax.lax.fori_loop(0, qi + 1, new_block, carry)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)


def _write_rows(write_ref, table_ref, layer_ref, lens_ref, new_ref, out_ref, layout, block_q):
    """Writes this program's share of the new rows into their pages: the rows of query block
    `qi` below the request's write count, the columns of KV head `h` only (each program of a
    request writes different columns or rows, so none races another)."""
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size = out_ref.shape[2]
    cached, layer = lens_ref[b], layer_ref[0]
    spans = [(off, w) for off, w, _ in layout.spans(h)]
    if layout.scaled:
        head0 = {i for _, _, i in layout.spans(0) if i >= 0}
        spans += [(layout.scale_offset + 4 * (i + h * layout.scale_stride), 4) for i in head0]
    end = jnp.minimum(write_ref[b] - qi * block_q, block_q)

    def one(j, _):
        t = qi * block_q + j
        pos = cached + t
        page, row = table_ref[b, pos // page_size], pos % page_size
        for off, w in spans:
            out_ref[page, layer, row, pl.ds(off, w)] = new_ref[t, pl.ds(off, w)]
        return 0

    jax.lax.fori_loop(0, jnp.maximum(end, 0), one, 0)


def default_interpret() -> bool:
    """Pallas kernels compile natively on GPU; elsewhere they run in interpret mode."""
    return jax.default_backend() != "gpu"


def paged_attention(
    q: Array,
    pages: Array,
    page_table: Array,
    cached_lens: Array,
    new_rows: Array,
    layout: RowLayout,
    scale: float,
    *,
    layer: Array | int = 0,
    kv_dtype=None,
    write_lens: Array | None = None,
    block_q: int = 64,
    interpret: bool | None = None,
) -> Array | tuple[Array, Array]:
    """Attention of new tokens over their cached pages and themselves.

    q `[B, N, Hq, dk]` (Hq a multiple of `layout.num_kv_heads`), pages `[P, L, page_size, W]`,
    page_table `[B, M]` int32 (request b's cached token t is row `t % page_size` of page
    `page_table[b, t // page_size]`; entries past its pages are ignored), cached_lens `[B]`,
    new_rows `[B, N, W]` (query j's own row is `new_rows[:, j]`) -> `[B, N, Hq, dv]` in q's dtype.
    `layer` picks the layer of `pages` (a traced scalar is fine).

    With `write_lens` `[B]` the kernel also writes request b's first `write_lens[b]` new rows
    into its pages (token j at position `cached_lens[b] + j`, whose pages the table must name)
    and returns `(out, pages)`: the pages are updated in place (aliased), so a decode step that
    donates its pool neither scatters nor copies it. Pages are then returned as bits
    (`kv_rows.bits_dtype`)."""
    b, n, hq, dk = q.shape
    hk = layout.num_kv_heads
    if dk != layout.key_width or hq % hk:
        raise ValueError(f"queries {q.shape} do not match the row layout {layout}")
    if new_rows.shape[:2] != (b, n) or pages.shape[-1] != new_rows.shape[-1]:
        raise ValueError(f"new rows {new_rows.shape} / pages {pages.shape} for queries {q.shape}")
    if kv_dtype is None:
        if jnp.issubdtype(pages.dtype, jnp.unsignedinteger):
            raise ValueError("pages held as bits need their kv_dtype")
        kv_dtype = pages.dtype
    kv_dtype = jnp.dtype(kv_dtype)
    g = hq // hk
    bq = math.gcd(n, block_q)
    nq = n // bq
    interpret = default_interpret() if interpret is None else interpret
    q5 = q.reshape(b, n, hk, g, dk)
    g_real = g
    if not interpret:
        # Compiled (Triton) blocks are powers of two with at least 16 rows for a dot: pad the
        # query group with zero queries (their output is sliced off).
        g = max(1 << (g - 1).bit_length(), -(-16 // bq))
        g = 1 << (g - 1).bit_length()
        q5 = jnp.pad(q5, ((0, 0), (0, 0), (0, 0), (0, g - g_real), (0, 0)))
    # [B, N, Hk, G, dk] -> [B, Hk, N * G, dk]: a query block is contiguous rows of one KV head.
    qh = q5.transpose(0, 2, 1, 3, 4).reshape(b, hk, n * g, dk)
    dv = layout.value_width
    kernel = functools.partial(
        _kernel, layout=layout, group=g, block_q=bq, scale=scale, kv_dtype=kv_dtype
    )
    bits = as_bits(pages)
    whole = pl.BlockSpec(pages.shape, lambda i, j, k: (0, 0, 0, 0))
    out_specs = [pl.BlockSpec((None, None, bq * g, dv), lambda i, j, k: (i, j, k, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, hk, n * g, dv), q.dtype)]
    writing = write_lens is not None
    if writing:
        out_specs.append(whole)
        out_shape.append(jax.ShapeDtypeStruct(bits.shape, bits.dtype))
    outs = pl.pallas_call(
        kernel,
        grid=(b, hk, nq),
        in_specs=[
            pl.BlockSpec(cached_lens.shape, lambda i, j, k: (0,)),
            pl.BlockSpec(page_table.shape, lambda i, j, k: (0, 0)),
            pl.BlockSpec((1,), lambda i, j, k: (0,)),
            pl.BlockSpec((b,), lambda i, j, k: (0,)),
            pl.BlockSpec((None, None, bq * g, dk), lambda i, j, k: (i, j, k, 0)),
            whole,
            pl.BlockSpec((None, n, new_rows.shape[-1]), lambda i, j, k: (i, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={5: 1} if writing else {},
        interpret=interpret,
        name="paged_attention",
    )(
        cached_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32).reshape(1),
        (write_lens if writing else jnp.zeros((b,), jnp.int32)).astype(jnp.int32),
        qh,
        bits,
        as_bits(new_rows.astype(kv_dtype)),
    )
    out = outs[0].reshape(b, hk, n, g, dv)[:, :, :, :g_real]
    out = out.transpose(0, 2, 1, 3, 4).reshape(b, n, hq, dv)
    return (out, outs[1]) if writing else out


def write_pages(
    pages: Array,
    page_table: Array,
    cached_lens: Array,
    new_rows: Array,
    write_lens: Array,
    layer: Array | int = 0,
) -> Array:
    """`pages` (bits) with request b's first `write_lens[b]` new rows written at positions
    `cached_lens[b] + j`: the XLA scatter the dense backends use (the kernel writes its own)."""
    b, n, _ = new_rows.shape
    pos = cached_lens[:, None] + jnp.arange(n)[None, :]
    ps = pages.shape[2]
    page = jnp.take_along_axis(page_table, jnp.minimum(pos // ps, page_table.shape[1] - 1), 1)
    keep = jnp.arange(n)[None, :] < write_lens[:, None]
    page = jnp.where(keep, page, 0)  # rows not written go to the null page 0 ...
    bits = jax.lax.bitcast_convert_type(new_rows, pages.dtype)
    old = pages[page, layer, pos % ps]
    # ... unchanged: a dropped row rewrites what is there.
    return pages.at[page, layer, pos % ps].set(jnp.where(keep[..., None], bits, old))


def gather_pages(pages: Array, page_table: Array, layer: Array | int = 0) -> Array:
    """Request rows `[B, M * page_size, W]` of one layer, in page-table order."""
    rows = pages[page_table, layer]  # [B, M, page_size, W]
    return rows.reshape(rows.shape[0], -1, rows.shape[-1])


def paged_attention_reference(
    q: Array,
    pages: Array,
    page_table: Array,
    cached_lens: Array,
    new_rows: Array,
    layout: RowLayout,
    scale: float,
    *,
    layer: Array | int = 0,
    kv_dtype=None,
    impl: str = "reference",
) -> Array:
    """`paged_attention` by gathering the pages into contiguous rows and attending densely
    (`dense_attention.attend` with `impl`): the oracle of the kernel, and the `reference`/`xla`
    backends' paged path."""
    cached = gather_pages(pages, page_table, layer)
    kv_dtype = jnp.dtype(kv_dtype or new_rows.dtype)

    def bits(x):
        if not jnp.issubdtype(x.dtype, jnp.unsignedinteger) and x.dtype != kv_dtype:
            x = x.astype(kv_dtype)
        return as_bits(x)

    rows = jnp.concatenate([bits(cached), bits(new_rows)], axis=1)
    k, v = split_kv(rows, layout, kv_dtype, q.dtype)
    mask = prefill_mask(cached_lens, None, cached.shape[1], q.shape[1])
    return attend(q, k, v, mask, scale, impl)
