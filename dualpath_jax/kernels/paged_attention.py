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

The kernel (`paged_attention`) is one program per (request, KV head, block of query rows,
KV split): an online softmax over the request's live cached pages only (the loop stops at
`cached_len`), a few pages of one layer per step (`pages_per_compute_block`, each page its own
dots under one softmax update), then over the causal part of the new rows. Nothing of size
`[queries, keys]` is materialized beyond one step's pages, so memory does not grow with the
context or with the longest request of a batch. With several KV splits (decode on GPU)
each program reads a share of the pages and the partial softmaxes are combined after. It is a
portable Pallas kernel: Pallas-Triton on GPU (every block a power of two, dots of at least 16,
fp8 scales assembled from their bytes), and interpret mode elsewhere, where tests check it
against `paged_attention_reference`, which gathers the pages into contiguous rows and runs the
dense path (`dense_attention.attend`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dualpath_jax.kernels.dense_attention import QUERY_BLOCK, attend, attend_blocks, prefill_mask
from dualpath_jax.kernels.kv_rows import RowLayout, as_bits, split_kv
from dualpath_jax.kernels.online_softmax import (
    NEG,
    SCALARS,
    OnlineSoftmax,
    combine,
    out_shapes,
    scalar_operands,
    store,
)
from dualpath_jax.kernels.paged_attention_tpu import paged_attention_tpu

Array = jax.Array

# Compiled (Triton) blocks: every loaded or computed array is a power of two in each dimension,
# and a dot needs at least 16 rows, columns and contraction.
_MIN_DOT = 16
_COMPILED_ROWS = 64  # query rows per compiled program
_MAX_SPLITS = 8  # KV splits of a decode program
_PAGES_PER_SPLIT = 4  # ... each reading at least this many pages
_BLOCK_KEYS = 128  # cached keys per step of a program (whole pages: at least one) ...
_TPU_BLOCK_KEYS = 512  # ... and in the TPU form


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static shapes of one call: `group` query heads per KV head (padded when compiled),
    `block_rows` query rows (query-major: row r is query r // group) per program, `block_new`
    new keys per step of the causal part, `splits` programs per (request, KV head, row block)
    over the cached pages (split-KV), `pages_per_block` cached pages per step, `compiled` for
    the Triton shapes."""

    group: int
    block_rows: int
    block_new: int
    splits: int
    pages_per_block: int
    compiled: bool


def _kernel(
    lens_ref,  # [B] cached lengths
    table_ref,  # [B, M] page ids
    layer_ref,  # [1] layer index
    write_ref,  # [B] new rows to write into the pages (write mode), else unused
    nlen_ref,  # [B] real new tokens (queries past them are padding)
    *refs,
    layout: RowLayout,
    plan: _Plan,
    scale: float,
    kv_dtype: jnp.dtype,
    writing: bool,
):
    """One program: (request b, KV head h, row block qi, split s). Inputs after the scalars:
    one query ref per key segment `[block_rows, w]`, the pages `[P, L, page_size, W]`, this
    request's new rows `[N, W]`; outputs: the output `[block_rows, dv]` (normalized) or, split,
    the f32 accumulator and its running max and sum `[block_rows]`; in write mode last the
    pages (aliased with the input)."""
    nseg = len(layout.key_segments)
    q_refs, (pages_ref, new_ref), outs = refs[:nseg], refs[nseg : nseg + 2], refs[nseg + 2 :]
    if writing:
        pages_ref = outs[-1]  # every page access through the aliased output (one buffer)
        outs = outs[:-1]
    b, h, qi, s = (pl.program_id(i) for i in range(4))
    if writing:
        _write_rows(write_ref, table_ref, layer_ref, lens_ref, new_ref, pages_ref, layout, plan)
    cached, nq = lens_ref[b], nlen_ref[b]
    layer = layer_ref[0]
    page_size = pages_ref.shape[2]
    rows, group, bn = plan.block_rows, plan.group, plan.block_new
    real = qi * rows < nq * group  # the block holds a real query: else it attends nothing
    q_parts = [r[...] for r in q_refs]
    dtype = q_parts[0].dtype
    keys, values = layout.head_segments(h, h * layout.head_stride)

    def dequant(ref_load):
        """ref_load(off, width) -> raw bits `[keys, width]`; returns load(off, w, scale column)
        giving the segment in the compute dtype, times its per-token scale unless the column is
        None. A scale is 4 one-byte elements (fp8 rows), put together as a uint32 with shifts
        and bitcast to float32: a same-width bitcast every GPU compiler lowers."""

        def load(off, w, col):
            x = jax.lax.bitcast_convert_type(ref_load(off, w), kv_dtype)
            if col is None:
                return x.astype(dtype)
            word = None
            for k in range(4):
                byte = ref_load(col + k, 1).astype(jnp.uint32) << (8 * k)
                word = byte if word is None else word | byte
            sc = jax.lax.bitcast_convert_type(word, jnp.float32)  # [keys, 1]
            return (x.astype(jnp.float32) * sc).astype(dtype)

        return load

    def small(a, b_):  # Triton needs 16 rows, columns and contraction for a dot
        return plan.compiled and min(*a.shape, *b_.shape) < _MIN_DOT

    soft = OnlineSoftmax(keys, values, q_parts, scale, dtype, small)
    carry = soft.init(rows)

    live = pl.cdiv(cached, page_size)
    per = pl.cdiv(table_ref.shape[1], plan.splits)
    first = jnp.minimum(s * per, live)
    last = jnp.where(real, jnp.minimum(first + per, live), first)  # this split's: [first, last)
    end = jnp.minimum(cached, last * page_size)  # past it: a later split's rows, or none

    def cached_block(i, carry):
        # `pages_per_block` pages, each its own dots under one softmax update; a block running
        # past the split reads its last page again, every row of it masked.
        blocks = []
        for k in range(plan.pages_per_block):
            j = first + i * plan.pages_per_block + k
            page = table_ref[b, jnp.minimum(j, last - 1)]
            load = dequant(lambda off, w, page=page: pages_ref[page, layer, :, pl.ds(off, w)])
            sc = soft.scores(load)
            pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
            blocks.append((jnp.where(pos < end, sc, NEG), load))
        return soft.update_blocks(carry, blocks)

    steps = pl.cdiv(last - first, plan.pages_per_block)
    carry = jax.lax.fori_loop(0, steps, cached_block, carry)

    # The causal part (the last split's): query of row r is qi * rows // group + r // group.
    q_pos = (qi * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, bn), 0)) // group

    def new_block(j, carry):
        load = dequant(lambda off, w: new_ref[pl.ds(j * bn, bn), pl.ds(off, w)])
        sc = soft.scores(load)
        k_pos = j * bn + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
        return soft.update(carry, jnp.where(k_pos <= q_pos, sc, NEG), load)

    last_query = jnp.minimum(((qi + 1) * rows - 1) // group, nq - 1)
    steps = jnp.where((s == plan.splits - 1) & real, last_query // bn + 1, 0)
    carry = jax.lax.fori_loop(0, steps, new_block, carry)
    keep = (qi * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) // group < nq
    store(outs, carry, keep, plan.splits > 1)


def _write_rows(write_ref, table_ref, layer_ref, lens_ref, new_ref, out_ref, layout, plan):
    """Writes this program's share of the new rows into their pages: in split 0, the rows of
    the new tokens whose queries are in row block `qi` (their first row), below the request's
    write count, the columns of KV head `h` only (each program of a request writes different
    columns or rows, so none races another; the pages read are all below `cached`)."""
    b, h, qi, s = (pl.program_id(i) for i in range(4))
    page_size = out_ref.shape[2]
    cached, layer = lens_ref[b], layer_ref[0]
    spans = [(off, w) for off, w, _ in layout.spans(h)]
    spans += [(layout.scale_column(h, j), 4) for j in range(layout.scales_per_head)]
    # Token t is written by the row block holding its query's first row: t * group // rows.
    lo = pl.cdiv(qi * plan.block_rows, plan.group)
    hi = jnp.minimum(pl.cdiv((qi + 1) * plan.block_rows, plan.group), write_ref[b])
    hi = jnp.where(s == 0, hi, lo)

    def one(t, carry):
        pos = cached + t
        page, row = table_ref[b, pos // page_size], pos % page_size
        for off, w in spans:
            out_ref[page, layer, row, pl.ds(off, w)] = new_ref[t, pl.ds(off, w)]
        return carry

    jax.lax.fori_loop(lo, jnp.maximum(hi, lo), one, jnp.int32(0))


def _plan(
    n: int, g: int, num_pages: int, page_size: int, block_q: int, kv_splits: int | None,
    pages_per_block: int | None, compiled: bool,
) -> _Plan:  # fmt: skip
    """The static shapes of a call with `n` new tokens, `g` queries per KV head and `num_pages`
    page-table columns of `page_size` rows (see `_Plan`)."""
    bn = math.gcd(n, block_q)
    if not compiled:
        splits = kv_splits or 1
        ppb = _pages_per_block(num_pages, page_size, splits, pages_per_block, _BLOCK_KEYS)
        return _Plan(g, bn * g, bn, splits, ppb, False)
    # Pad the group to a power of two, so row blocks are powers of two of at least 16 rows.
    g_pad = 1 << (max(g, _MIN_DOT // math.gcd(n, _MIN_DOT)) - 1).bit_length()
    rows = math.gcd(n * g_pad, _COMPILED_ROWS)
    # decode: spread one request's pages over programs (flash-decoding)
    splits = _decode_splits(n, num_pages, kv_splits)
    ppb = _pages_per_block(num_pages, page_size, splits, pages_per_block, _BLOCK_KEYS)
    return _Plan(g_pad, rows, bn, splits, ppb, True)


def _pages_per_block(
    num_pages: int, page_size: int, splits: int, requested: int | None, block_keys: int
) -> int:
    """Cached pages a program attends per step: `requested`, or by default as many whole pages
    as make `block_keys` keys (at least one), never more than a split's share of the table."""
    if requested is not None:
        return max(1, min(requested, -(-num_pages // splits)))
    return max(1, min(block_keys // page_size, -(-num_pages // splits)))


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
    new_lens: Array | None = None,
    block_q: int = 64,
    kv_splits: int | None = None,
    pages_per_compute_block: int | None = None,
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
    (`kv_rows.bits_dtype`).

    `new_lens` `[B]` (default N) makes the batch ragged: request b has `new_lens[b]` real new
    tokens and the rest of its N are padding, which attends nothing (a block of padding
    queries skips the request's pages and rows) and gets zeros. One call then serves requests
    of different lengths, prefill chunks and decode tokens alike, at the cost of their real
    tokens; the arrays keep the padded shape.

    `kv_splits` programs share one request's cached pages (split-KV, their partial softmaxes
    combined after): default 1, and on GPU and TPU for one new token per request (decode) up
    to 8. `pages_per_compute_block` cached pages are attended per step of a program: by
    default as many as make 128 keys on GPU (separate dots under one softmax update) and 512
    on TPU (one tile, the pages copied side by side), at least one page.
    `interpret=None` decides per platform the program is lowered for (`lax.platform_dependent`):
    Pallas-Triton on GPU (chosen explicitly, not by JAX's default GPU backend), the Mosaic form
    on TPU (`paged_attention_tpu.py`), interpret mode elsewhere; True forces interpret mode,
    False the Triton form."""
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
    if kv_splits is not None and kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    if pages_per_compute_block is not None and pages_per_compute_block < 1:
        raise ValueError(f"pages_per_compute_block must be >= 1, got {pages_per_compute_block}")
    kv_dtype = jnp.dtype(kv_dtype)
    call = functools.partial(
        _paged_attention,
        layout=layout,
        scale=scale,
        kv_dtype=kv_dtype,
        block_q=block_q,
        kv_splits=kv_splits,
        pages_per_block=pages_per_compute_block,
    )
    args = (
        q,
        as_bits(pages),
        page_table.astype(jnp.int32),
        cached_lens.astype(jnp.int32),
        new_rows,
        jnp.asarray(layer, jnp.int32).reshape(1),
        None if write_lens is None else write_lens.astype(jnp.int32),
        jnp.full((b,), n, jnp.int32) if new_lens is None else new_lens.astype(jnp.int32),
    )
    if interpret is not None:
        return call(*args, compiled=not interpret, interpret=interpret)
    tpu = functools.partial(
        _paged_attention_tpu, layout=layout, scale=scale, kv_dtype=kv_dtype, kv_splits=kv_splits,
        pages_per_block=pages_per_compute_block,
    )  # fmt: skip
    return jax.lax.platform_dependent(
        *args,
        cuda=functools.partial(call, compiled=True, interpret=False),
        rocm=functools.partial(call, compiled=True, interpret=False),
        tpu=functools.partial(tpu, interpret=False),
        default=functools.partial(call, compiled=False, interpret=True),
    )


def _query_rows(q: Array, layout: RowLayout, group: int) -> list[Array]:
    """Queries `[B, N, Hq, dk]` -> per key segment `[B, Hk, N * group, w]`: a KV head's queries,
    query-major (row r is query r // group), the group padded with zero queries to `group`;
    split by key segment so each is a power of two wide (MLA's 512 + 64, never 576)."""
    b, n, hq, dk = q.shape
    hk = layout.num_kv_heads
    q5 = q.reshape(b, n, hk, hq // hk, dk)
    if group > hq // hk:
        q5 = jnp.pad(q5, ((0, 0), (0, 0), (0, 0), (0, group - hq // hk), (0, 0)))
    qh = q5.transpose(0, 2, 1, 3, 4).reshape(b, hk, n * group, dk)
    segs, start = [], 0
    for _, w in layout.key_segments:
        segs.append(qh[..., start : start + w])
        start += w
    return segs


def _head_output(out: Array, q: Array, layout: RowLayout, group: int) -> Array:
    """`[B, Hk, N * group, dv]` -> `[B, N, Hq, dv]` (the padding queries dropped)."""
    b, n, hq, _ = q.shape
    hk, dv = layout.num_kv_heads, layout.value_width
    out = out.reshape(b, hk, n, group, dv)[:, :, :, : hq // hk]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, n, hq, dv)


def _decode_splits(n: int, num_pages: int, kv_splits: int | None) -> int:
    """KV splits of a call with `n` new tokens per request over `num_pages` page-table columns:
    `kv_splits`, or by default for decode (one new token) up to `_MAX_SPLITS`, each reading at
    least `_PAGES_PER_SPLIT` pages; 1 otherwise."""
    if kv_splits is not None:
        return kv_splits
    return max(1, min(_MAX_SPLITS, num_pages // _PAGES_PER_SPLIT)) if n == 1 else 1


def _paged_attention_tpu(
    q, bits, table, lens, new_rows, layer, write_lens, new_lens, *, layout, scale, kv_dtype,
    interpret, kv_splits=None, pages_per_block=None,
):  # fmt: skip
    """The TPU form (`paged_attention_tpu.py`) behind the same contract."""
    g = q.shape[2] // layout.num_kv_heads
    splits = _decode_splits(q.shape[1], table.shape[1], kv_splits)
    ppb = _pages_per_block(table.shape[1], bits.shape[2], splits, pages_per_block, _TPU_BLOCK_KEYS)
    out, pages = paged_attention_tpu(
        _query_rows(q, layout, g), bits, table, lens, as_bits(new_rows.astype(kv_dtype)),
        layer, write_lens, new_lens, layout=layout, group=g, scale=scale, kv_dtype=kv_dtype,
        kv_splits=splits, pages_per_block=ppb, interpret=interpret,
    )  # fmt: skip
    if splits > 1:
        out = combine(out, q.dtype)
    out = _head_output(out, q, layout, g)
    return (out, pages) if write_lens is not None else out


def _paged_attention(
    q, bits, table, lens, new_rows, layer, write_lens, new_lens, *, layout, scale, kv_dtype,
    block_q, kv_splits, compiled, interpret, pages_per_block=None,
):  # fmt: skip
    b, n, hq, dk = q.shape
    hk, dv = layout.num_kv_heads, layout.value_width
    g = hq // hk
    plan = _plan(n, g, table.shape[1], bits.shape[2], block_q, kv_splits, pages_per_block, compiled)
    q_segs = _query_rows(q, layout, plan.group)  # a row block: rows of one KV head
    nr, s = n * plan.group // plan.block_rows, plan.splits
    grid = (b, hk, nr, s)

    def rows_spec(w):  # query rows (or output rows) of one program
        return pl.BlockSpec((None, None, plan.block_rows, w), lambda i, j, k, t: (i, j, k, 0))

    def scalar(shape):  # the whole array in every program
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    # The pool is not blocked: compiled, it stays where it is (`pl.ANY`: under Triton a pointer
    # into HBM) and the kernel loads a step's pages of one layer itself; interpreted, one view.
    whole = pl.BlockSpec(memory_space=pl.ANY) if compiled else scalar(bits.shape)
    writing = write_lens is not None
    out_shape = out_shapes(s, (b, hk, n * plan.group), dv, q.dtype)
    if s == 1:
        out_specs = [rows_spec(dv)]
    else:

        def part(w):  # split t's share
            return pl.BlockSpec(
                (None, None, None, plan.block_rows, w), lambda i, j, k, t: (t, i, j, k, 0)
            )

        out_specs = [part(dv), part(1), part(1)]
    if writing:
        out_specs.append(whole)
        out_shape.append(jax.ShapeDtypeStruct(bits.shape, bits.dtype))
    nseg = len(q_segs)
    params = None
    if compiled:
        params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    outs = pl.pallas_call(
        functools.partial(
            _kernel, layout=layout, plan=plan, scale=scale, kv_dtype=kv_dtype, writing=writing
        ),
        grid=grid,
        in_specs=[
            scalar(lens.shape),
            scalar(table.shape),
            scalar((1,)),
            scalar((b,)),
            scalar((b,)),
            *(rows_spec(x.shape[-1]) for x in q_segs),
            whole,
            pl.BlockSpec((None, n, new_rows.shape[-1]), lambda i, j, k, t: (i, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={SCALARS + nseg: len(out_shape) - 1} if writing else {},
        interpret=interpret,
        compiler_params=params,
        name="paged_attention",
    )(
        *scalar_operands(lens, table, layer, write_lens, new_lens),
        *q_segs,
        bits,
        as_bits(new_rows.astype(kv_dtype)),
    )
    out = outs[0] if s == 1 else combine(outs[:3], q.dtype)
    out = _head_output(out, q, layout, plan.group)
    return (out, outs[-1]) if writing else out


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
    new_lens: Array | None = None,
    impl: str = "reference",
) -> Array:
    """`paged_attention` by gathering the pages into contiguous rows and attending densely
    (`dense_attention.attend` with `impl`): the oracle of the kernel, and the `reference`/`xla`
    backends' paged path. Padding queries (past `new_lens`) give zeros: with `reference` and
    more than `QUERY_BLOCK` queries a block of them at a time, the blocks of padding skipped
    (`attend_blocks`); otherwise computed, then zeroed."""
    cached = gather_pages(pages, page_table, layer)
    kv_dtype = jnp.dtype(kv_dtype or new_rows.dtype)

    def bits(x):
        if not jnp.issubdtype(x.dtype, jnp.unsignedinteger) and x.dtype != kv_dtype:
            x = x.astype(kv_dtype)
        return as_bits(x)

    rows = jnp.concatenate([bits(cached), bits(new_rows)], axis=1)
    k, v = split_kv(rows, layout, kv_dtype, q.dtype)
    n = q.shape[1]
    if new_lens is not None and impl == "reference" and n > QUERY_BLOCK and n % QUERY_BLOCK == 0:
        out = attend_blocks(q, k, v, cached_lens, cached.shape[1], new_lens, scale)
    else:
        out = attend(q, k, v, prefill_mask(cached_lens, None, cached.shape[1], n), scale, impl)
    if new_lens is None:
        return out
    real = jnp.arange(q.shape[1])[None, :] < new_lens[:, None]
    return jnp.where(real[:, :, None, None], out, 0).astype(out.dtype)
