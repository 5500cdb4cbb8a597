"""The paged attention kernel in its TPU form (Pallas Mosaic TPU): what `paged_attention` runs
when its program is lowered for a TPU.

Same contract and pages as `paged_attention.py` (pages `[P, L, page_size, W]` of KV rows held as
bits, a page table per request, new rows passed separately, optional in-place writes), but
shaped for a TPU's memory: the pool and the new rows stay in HBM (`pl.ANY`) and the kernel
copies what it reads into VMEM itself with DMAs, so nothing the size of the pool is staged.
Program (request b, KV head h, block of query rows) streams the request's live pages of one
layer in blocks of `pages_per_block` pages copied side by side into one VMEM tile (one dot per
block), double-buffered (the copies of block i + 1 run while block i is attended), and reads
only its head's columns of each row (`_window`); then the causal part of the new rows in
blocks. Page tables, lengths and the layer are scalar-prefetched into SMEM. Every size is static
at trace time (block sizes come from the shapes, never from the device), so the kernel lowers
for `tpu` on any host. In write mode (decode) the program of KV head 0 copies each new row into
its page, HBM to HBM (the pages are aliased in and out; what the other programs read lies below
`cached_lens`, apart from what is written).

Decode (one new token per request) splits a request's pages over `kv_splits` programs
(split-KV, as the GPU form): each attends a share of the live pages and writes its unnormalized
partial softmax, combined after the call; the split axis leads the grid and is `parallel`, so
the TensorCores of a megacore chip share one long sequence.

Queries arrive as in the GPU form: per KV head, query-major rows `[N * G, w]` split by key
segment (MLA's 512 + 64). Interpreted on CPU by the tests against the dense oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualpath_jax.kernels.kv_rows import RowLayout
from dualpath_jax.kernels.online_softmax import (
    NEG,
    SCALARS,
    OnlineSoftmax,
    out_shapes,
    scalar_operands,
    store,
)

Array = jax.Array

_MAX_ROWS = 256  # query rows per program
_NEW_BLOCK = 128  # new keys per step of the causal part


def _div(x, d: int):
    """`x // d` for non-negative `x`: a truncating division (`floor_divide` lowers through a
    sign, whose Mosaic rule asks for the device kind)."""
    return jax.lax.div(x, jnp.asarray(d, jnp.int32))


def _window(layout: RowLayout) -> tuple[int, int] | None:
    """(stride, width) of the columns KV head h reads: `[h * stride, h * stride + width)` when a
    head's key and value are one contiguous run of whole lane tiles in the row (head-major GQA);
    None: the program reads whole rows (MLA's single head; scaled rows, whose head spans are
    not whole lane tiles)."""
    if layout.num_kv_heads == 1 or not layout.head_major:
        return None
    return layout.head_stride, layout.head_stride


def _kernel(
    lens_ref,  # SMEM [B] cached lengths
    table_ref,  # SMEM [B, M] page ids
    layer_ref,  # SMEM [1]
    write_ref,  # SMEM [B] rows to write (write mode)
    nlen_ref,  # SMEM [B] real new tokens (queries past them are padding)
    *refs,
    layout: RowLayout,
    rows: int,
    group: int,
    block_new: int,
    scale: float,
    kv_dtype,
    writing: bool,
    splits: int,
    pages_per_block: int,
):
    nseg = len(layout.key_segments)
    q_refs = refs[:nseg]
    pages_hbm, new_hbm = refs[nseg : nseg + 2]
    outs = refs[nseg + 2 : nseg + 2 + (1 if splits == 1 else 3)]
    rest = refs[nseg + 2 + len(outs) :]
    if writing:
        pages_hbm, rest = rest[0], rest[1:]  # every page access through the aliased output
    kv_buf, new_buf, sems = rest
    if splits == 1:
        split = 0
        b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:  # the split axis leads
        split, b, h, qi = (pl.program_id(i) for i in range(4))
    cached, nq, layer = lens_ref[b], nlen_ref[b], layer_ref[0]
    real = qi * rows < nq * group  # the block holds a real query: else it attends nothing
    ppb = pages_per_block
    page_size = kv_buf.shape[1] // ppb
    win = _window(layout)
    if win is None:  # MLA: one head at column 0; scaled GQA: head h's columns of whole rows
        col0, width = 0, pages_hbm.shape[-1]
        k0 = 0 if layout.num_kv_heads == 1 else pl.multiple_of(h * layout.head_stride, 8)
    else:
        col0, width, k0 = pl.multiple_of(h * win[0], win[0]), win[1], 0
    q_parts = [r[...] for r in q_refs]
    dtype = q_parts[0].dtype

    if writing:

        @pl.when((h == 0) & (split == 0))
        def _write():
            def one(t, carry):
                pos = cached + t
                page, row = table_ref[b, _div(pos, page_size)], jax.lax.rem(pos, page_size)
                pltpu.sync_copy(
                    new_hbm.at[b, pl.ds(t, 1)], pages_hbm.at[page, layer, pl.ds(row, 1)]
                )
                return carry

            lo = _div(qi * rows + group - 1, group)
            hi = jnp.minimum(_div((qi + 1) * rows + group - 1, group), write_ref[b])
            jax.lax.fori_loop(lo, jnp.maximum(hi, lo), one, jnp.int32(0))

    keys, values = layout.head_segments(h, k0)

    def loader(ref):
        """load(off, w, scale column) of rows in VMEM `ref` `[keys, width]` (bits): the segment
        in the compute dtype, times its per-token scale (assembled from its 4 bytes; the head's
        scale picked from the static columns by a masked sum, its column being traced)."""

        def load(off, w, col):
            x = jax.lax.bitcast_convert_type(ref[:, pl.ds(off, w)], kv_dtype)
            if col is None:
                return x.astype(dtype)
            sc = None
            for c in layout.scale_columns:
                word = None
                for k in range(4):
                    byte = ref[:, pl.ds(c + k, 1)].astype(jnp.uint32) << (8 * k)
                    word = byte if word is None else word | byte
                one = jax.lax.bitcast_convert_type(word, jnp.float32)  # [keys, 1]
                one = jnp.where(col == c, one, 0.0)
                sc = one if sc is None else sc + one
            return (x.astype(jnp.float32) * sc).astype(dtype)

        return load

    # Mosaic's matmul lowering mistypes a one-key product (decode's own row): broadcast it
    soft = OnlineSoftmax(keys, values, q_parts, scale, dtype, lambda a, b_: b_.shape[0] == 1)

    live = _div(cached + page_size - 1, page_size)
    per = -(-table_ref.shape[1] // splits)  # this split's pages: [first, last)
    first = jnp.minimum(split * per, live)
    last = jnp.where(real, jnp.minimum(first + per, live), first)

    def block_copies(i, slot):
        """The copies of block i's pages side by side into buffer `slot`, on one semaphore; a
        block running past the split copies its last page again (its rows are masked)."""
        copies = []
        for k in range(ppb):
            page = table_ref[b, jnp.minimum(first + i * ppb + k, last - 1)]
            copies.append(
                pltpu.make_async_copy(
                    pages_hbm.at[page, layer, :, pl.ds(col0, width)],
                    kv_buf.at[slot, pl.ds(k * page_size, page_size)],
                    sems.at[slot],
                )
            )
        return copies

    steps = _div(last - first + ppb - 1, ppb)
    end = jnp.minimum(cached, last * page_size)  # past it: a later split's rows, or none

    @pl.when(steps > 0)
    def _first():
        for c in block_copies(0, 0):
            c.start()

    def cached_block(i, carry):
        slot = jax.lax.rem(i, 2)

        @pl.when(i + 1 < steps)
        def _next():
            for c in block_copies(i + 1, 1 - slot):
                c.start()

        for c in block_copies(i, slot):
            c.wait()
        load = loader(kv_buf.at[slot])
        s = soft.scores(load)
        pos = (first + i * ppb) * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        return soft.update(carry, jnp.where(pos < end, s, NEG), load)

    carry = jax.lax.fori_loop(0, steps, cached_block, soft.init(rows))

    q_pos = _div(qi * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, block_new), 0), group)

    def new_block(j, carry):
        pltpu.sync_copy(new_hbm.at[b, pl.ds(j * block_new, block_new), pl.ds(col0, width)], new_buf)
        load = loader(new_buf)
        s = soft.scores(load)
        k_pos = j * block_new + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        return soft.update(carry, jnp.where(k_pos <= q_pos, s, NEG), load)

    last_query = jnp.minimum(_div((qi + 1) * rows - 1, group), nq - 1)
    last_split = (split == splits - 1) & real  # the causal part is the last split's
    steps = jnp.where(last_split, _div(last_query, block_new) + 1, 0)
    carry = jax.lax.fori_loop(0, steps, new_block, carry)
    keep = _div(qi * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group) < nq
    store(outs, carry, keep, splits > 1)


def paged_attention_tpu(
    q_segs: list[Array],
    bits: Array,
    table: Array,
    lens: Array,
    new_bits: Array,
    layer: Array,
    write_lens: Array | None,
    new_lens: Array,
    *,
    layout: RowLayout,
    group: int,
    scale: float,
    kv_dtype,
    kv_splits: int = 1,
    pages_per_block: int = 1,
    interpret: bool = False,
) -> tuple[Array | tuple[Array, Array, Array], Array | None]:
    """The kernel over queries `q_segs` (per key segment `[B, Hk, N * G, w]`, query-major rows),
    pages `bits` `[P, L, page_size, W]`, `table` `[B, M]`, `lens` `[B]`, new rows `new_bits`
    `[B, N, W]` (bits), `layer` `[1]`, the real new tokens `new_lens` `[B]` (padding queries
    attend nothing and get zeros) -> (output `[B, Hk, N * G, dv]` in the queries' dtype,
    the written pages or None). With `kv_splits` > 1 the output is the splits' partials: the
    f32 accumulators `[S, B, Hk, N * G, dv]`, their running maxima and sums `[S, ..., 1]`.
    Each step of a program attends `pages_per_block` pages, copied side by side into one
    tile."""
    b, hk, nrows, _ = q_segs[0].shape
    n = new_bits.shape[1]
    page_size = bits.shape[2]
    dv = layout.value_width
    rows = nrows if nrows <= _MAX_ROWS else _largest_divisor(nrows, _MAX_ROWS, 8)
    block_new = n if n <= _NEW_BLOCK else _largest_divisor(n, _NEW_BLOCK, 8)
    win = _window(layout)
    width = bits.shape[-1] if win is None else win[1]
    writing = write_lens is not None

    splits = kv_splits
    lead = splits > 1  # the grid: (split, b, h, row block), else (b, h, row block)

    def rows_spec(w):
        if lead:
            return pl.BlockSpec((None, None, rows, w), lambda t, i, j, k, *_: (i, j, k, 0))
        return pl.BlockSpec((None, None, rows, w), lambda i, j, k, *_: (i, j, k, 0))

    def part(w):  # a split's share of the partials
        return pl.BlockSpec((None, None, None, rows, w), lambda t, i, j, k, *_: (t, i, j, k, 0))

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_specs = [part(dv), part(1), part(1)] if lead else [rows_spec(dv)]
    out_shape = out_shapes(splits, (b, hk, nrows), dv, q_segs[0].dtype)
    if writing:
        out_specs.append(hbm)
        out_shape.append(jax.ShapeDtypeStruct(bits.shape, bits.dtype))
    nseg = len(q_segs)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=((splits,) if lead else ()) + (b, hk, nrows // rows),
        in_specs=[*(rows_spec(x.shape[-1]) for x in q_segs), hbm, hbm],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((2, pages_per_block * page_size, width), bits.dtype),
            pltpu.VMEM((block_new, width), bits.dtype),
            pltpu.SemaphoreType.DMA((2,)),
        ],
    )
    kernel = functools.partial(
        _kernel,
        layout=layout,
        rows=rows,
        group=group,
        block_new=block_new,
        scale=scale,
        kv_dtype=kv_dtype,
        writing=writing,
        splits=splits,
        pages_per_block=pages_per_block,
    )
    semantics = ("parallel",) + ("arbitrary",) * 3 if lead else ("arbitrary",) * 3
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        # operands: the scalars, the query segments, the pages, the new rows
        input_output_aliases={SCALARS + nseg: len(out_shape) - 1} if writing else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=interpret,
        name="paged_attention_tpu",
    )(*scalar_operands(lens, table, layer, write_lens, new_lens), *q_segs, bits, new_bits)
    out = outs[0] if not lead else tuple(outs[:3])
    return out, (outs[-1] if writing else None)


def _largest_divisor(n: int, at_most: int, multiple: int) -> int:
    """The largest divisor of `n` that is at most `at_most` and a multiple of `multiple` (a
    block's sublane rule), else `n` itself."""
    for d in range(at_most - at_most % multiple, 0, -multiple):
        if n % d == 0:
            return d
    return n
