"""A prefill batch's cached KV in pages, and the pieces it is assembled from.

`LayerPages` holds one layer's cached KV of a batch in pages of `page_size` tokens with a page
table; `CachedPages` stacks every layer's for one-program prefill. `LayerPages.assemble` builds
them from each request's segments: host rows, `DevicePages` (blocks already on the device, e.g.
pulled from a decode engine) and `DeviceRowRun`s (an earlier chunk's rows kept on the device).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dualpath_jax import copies
from dualpath_jax.config import ModelConfig

Array = jax.Array


def pow2(n: int) -> int:
    """The smallest power of two >= `n` (1 for n <= 1): page counts, table widths and batch
    sizes are padded to these, so few shapes compile."""
    return 1 << max(0, n - 1).bit_length()


def _page_count(needed: int, batch: int, table_width: int, pad_to_table: bool) -> int:
    """Pages of a batch's `LayerPages`: the `needed` ones rounded up to a power of two, or with
    `pad_to_table` as many as the table could name (`batch * table_width` plus the null and
    the scratch page, rounded up): then the page count follows from the table's shape and adds
    no compiled shape of its own. For attention that gathers the pages into dense rows of
    `[batch, table_width * page_size]` anyway (every backend but the paged kernel), where each
    distinct page count was one more layer program to trace, lower and compile."""
    return pow2(batch * table_width + 2) if pad_to_table else pow2(needed)


@dataclasses.dataclass(frozen=True)
class LayerPages:
    """One layer's cached KV of a prefill batch in pages: `pages` `[P, 1, page_size, W]` (page 0
    the null page), `table` `[B, M]` (request b's cached token t is row `t % page_size` of page
    `table[b, t // page_size]`). What `load_layer` may return instead of padded rows."""

    pages: np.ndarray | Array
    table: np.ndarray | Array

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[np.ndarray],
        page_size: int,
        width: int,
        dtype,
        *,
        pad_to_table: bool = False,
    ) -> LayerPages:
        """Each request's cached rows `[c_b, W]` (in token order) into its own pages: whole
        blocks of `page_size` rows become pages as they are; page and table counts are padded
        to powers of two (few shapes; `pad_to_table`: see `_page_count`)."""
        counts = [-(-len(r) // page_size) for r in rows]
        table = np.zeros((len(rows), pow2(max(max(counts), 1))), np.int32)
        total = _page_count(sum(counts) + 1, *table.shape, pad_to_table)
        pages = np.zeros((total, 1, page_size, width), dtype)
        start = 1
        for b, (r, n) in enumerate(zip(rows, counts)):
            if n:
                pages[start : start + n, 0].reshape(n * page_size, width)[: len(r)] = r
                table[b, :n] = np.arange(start, start + n)
                start += n
        return cls(pages, table)

    @classmethod
    def assemble(
        cls,
        segments: Sequence[Sequence[np.ndarray | DevicePages | DeviceRowRun]],
        page_size: int,
        width: int,
        dtype,
        placement: Callable[[Sequence[int]], jax.sharding.Sharding | None] | None = None,
        *,
        pad_to_table: bool = False,
    ) -> LayerPages:
        """Each request's cached rows as consecutive segments in token order: host rows `[n, W]`;
        `DevicePages` already on the device (blocks that arrived over the compute network or
        came out of a pinned buffer; each starts on a page boundary); `DeviceRowRun`, rows an
        earlier forward left on the device (an earlier chunk of the request; any alignment).

        Host rows are packed into pages as `from_rows` packs them and copied to the device in
        one copy (none when there are no host rows); device pages are placed by a jitted
        scatter of whole pages and device rows by one of rows, never through the host. Without
        device segments this is `from_rows` (host pages).

        `placement(shape)`: where KV pages of `shape` live for the forward (a sharded runner's
        `ModelRunner.pages_sharding`: split by KV head over its mesh; None: one device). The
        pages are built there: host pages are copied to it shard by shard, and `DevicePages`
        that arrived on another device (the engine's transfer device, its pinned buffer's) are
        moved to it before they are placed.

        `pad_to_table`: the page count follows from the table's shape (see `_page_count`); the
        host pages are then built at that count (no second program to grow them)."""
        if not any(isinstance(x, DevicePages | DeviceRowRun) for seg in segments for x in seg):
            return cls.from_rows(
                [seg[0] if len(seg) == 1 else _cat(seg, width, dtype) for seg in segments],
                page_size,
                width,
                dtype,
                pad_to_table=pad_to_table,
            )
        # Page ids: 0 the null page, then "row pages" (every page not a DevicePages block: host
        # rows are packed into them on the host, device rows scattered into them), then the
        # DevicePages blocks, then one scratch page that padding lands on.
        plans = [_merge_host_runs(seg, width, dtype) for seg in segments]
        counts = []  # per request: (row pages, device pages, pages in all)
        for plan in plans:
            t = row = dev = 0
            for x in plan:
                if isinstance(x, DevicePages):
                    if t % page_size:
                        raise ValueError("a DevicePages segment must start on a page boundary")
                    dev += x.blocks
                    t += x.blocks * page_size
                else:
                    n = segment_tokens(x, page_size)
                    # pages this run starts (its first page may be shared with the run before)
                    row += -(-(t + n) // page_size) - -(-t // page_size)
                    t += n
            counts.append((row, dev, -(-t // page_size)))
        row_pages = sum(c[0] for c in counts)
        dev_pages = sum(c[1] for c in counts)
        table = np.zeros((len(segments), pow2(max(max(c[2] for c in counts), 1))), np.int32)
        total = _page_count(1 + row_pages + dev_pages + 1, *table.shape, pad_to_table)
        scratch = total - 1
        host_pages = total if pad_to_table else pow2(1 + row_pages)
        host = np.zeros((host_pages, 1, page_size, width), dtype)
        page_scatters, row_scatters = [], []
        any_host = False
        next_row, next_dev = 1, 1 + row_pages
        for b, plan in enumerate(plans):
            t = 0
            for x in plan:
                if isinstance(x, DevicePages):
                    ids = np.full((x.pages.shape[0],), scratch, np.int32)
                    ids[: x.blocks] = np.arange(next_dev, next_dev + x.blocks)
                    page_scatters.append((x.pages, ids))
                    table[b, t // page_size : t // page_size + x.blocks] = ids[: x.blocks]
                    next_dev += x.blocks
                    t += x.blocks * page_size
                    continue
                n = segment_tokens(x, page_size)
                if not n:
                    continue
                for col in range(t // page_size, -(-(t + n) // page_size)):
                    if not table[b, col]:  # a page this run starts
                        table[b, col] = next_row
                        next_row += 1
                pos = np.arange(t, t + n)
                pids, offs = table[b, pos // page_size], pos % page_size
                if isinstance(x, DeviceRowRun):
                    n_pad = x.rows.shape[1]
                    ids = np.full((n_pad,), scratch, np.int32)
                    at = np.zeros((n_pad,), np.int32)
                    ids[:n], at[:n] = pids, offs
                    row_scatters.append((x, ids, at))
                else:
                    host[pids, 0, offs] = x
                    any_host = True
                t += n
        place = placement or (lambda shape: None)
        if any_host:
            pages = copies.to_device(host, "prefill_pages", place(host.shape))
            if host_pages < total:
                pages = grow_pages(pages, total)
        else:  # every segment already on the device: no host pages to copy
            name = jnp.dtype(dtype).name
            at = place((total, 1, page_size, width))
            if at is None:
                pages = _zero_pages(total, page_size, width, name)
            else:
                pages = jnp.zeros((total, 1, page_size, width), name, device=at)
        # index arrays by device_put: `jnp.asarray` of a numpy array compiles a program per shape
        for blocks, ids in page_scatters:
            at = place(blocks.shape)
            if at is not None and blocks.sharding != at:
                blocks = jax.device_put(blocks, at)  # device to device: onto the forward's mesh
            pages = scatter_pages(pages, jax.device_put(ids), blocks)
        for run, ids, at in row_scatters:
            x = _row_of(run.rows, run.b)
            pages = _scatter_rows(pages, jax.device_put(ids), jax.device_put(at), x)
        return cls(pages, copies.to_device(table, "prefill_table"))

    def to_device(self) -> LayerPages:
        return LayerPages(
            copies.to_device(self.pages, "prefill_pages"),
            copies.to_device(self.table, "prefill_table"),
        )


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def bytes_to_pages(data, block_tokens: int, width: int, dtype: str):
    """Layer bytes `[n, bt, W * itemsize]` (or `[n * bt, ...]`) uint8 -> pages `[n, bt, W]` in
    the KV dtype, on the device (a bitcast: no copy through the host)."""
    dt = jnp.dtype(dtype)
    x = data.reshape(-1, block_tokens, width, dt.itemsize)
    return jax.lax.bitcast_convert_type(x[..., 0] if dt.itemsize == 1 else x, dt)


@dataclasses.dataclass(frozen=True)
class DevicePages:
    """A request's cached rows already in device pages `[n, page_size, W]` (kv dtype; `n` may be
    padded past the `blocks` that are real): what `LayerPages.assemble` places without a
    host copy."""

    pages: Array
    blocks: int


@dataclasses.dataclass(frozen=True)
class DeviceRowRun:
    """Request `b`'s first `n` rows of a forward's layer output `rows` `[B, N_pad, W]` on the
    device: an earlier chunk's KV kept there for the request's next forward."""

    rows: Array
    b: int
    n: int


def segment_tokens(x: np.ndarray | DevicePages | DeviceRowRun, page_size: int) -> int:
    """Cached tokens one segment of `LayerPages.assemble` holds."""
    if isinstance(x, DevicePages):
        return x.blocks * page_size
    return x.n if isinstance(x, DeviceRowRun) else len(x)


def _merge_host_runs(seg, width, dtype) -> list:
    """Consecutive host segments joined (device segments stay as they are)."""
    out: list = []
    run: list = []
    for x in seg:
        if isinstance(x, DevicePages | DeviceRowRun):
            if run:
                out.append(_cat(run, width, dtype))
                run = []
            out.append(x)
        else:
            run.append(x)
    if run:
        out.append(_cat(run, width, dtype))
    return out


def _cat(parts, width, dtype) -> np.ndarray:
    parts = [np.asarray(x) for x in parts]
    return np.concatenate(parts) if parts else np.zeros((0, width), dtype)


@functools.partial(jax.jit, static_argnums=1)
def grow_pages(pages, total):
    """pages `[p, 1, ps, W]` -> `[total, 1, ps, W]` (zero pages appended)."""
    return jnp.zeros((total, *pages.shape[1:]), pages.dtype).at[: pages.shape[0]].set(pages)


@jax.jit
def _row_of(rows, b):
    """Request b's rows `[N, W]` of a forward's layer output `[B, N, W]` (one program per
    output shape, whichever request)."""
    return jax.lax.dynamic_index_in_dim(rows, b, keepdims=False)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(pages, ids, at, x):
    """pages `[P, 1, ps, W]` <- rows `x` `[N, W]`, row j at page `ids[j]`, offset `at[j]`
    (padding rows go to the scratch page). One program per page count and row count: the
    request's rows are taken out of its batch first (`_row_of`), so the batch's size does not
    multiply the shapes."""
    return pages.at[ids, 0, at].set(x.astype(pages.dtype))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _zero_pages(total, page_size, width, dtype):
    """`[total, 1, page_size, W]` zero pages made on the device."""
    return jnp.zeros((total, 1, page_size, width), dtype)


@functools.partial(jax.jit, donate_argnums=0)
def scatter_pages(pages, ids, blocks):
    """pages `[P, 1, ps, W]` <- blocks `[n, ps, W]` at page ids `[n]`."""
    return pages.at[ids, 0].set(blocks.astype(pages.dtype))


@dataclasses.dataclass(frozen=True)
class CachedPages:
    """A prefill batch's cached KV of every layer in pages, layer-major: `pages`
    `[L, P, page_size, W]` (page 0 the null page; host, `pinned_host` or device memory) and one
    `table` `[B, M]` for all layers. What `ModelRunner.prefill_program` takes."""

    pages: np.ndarray | Array
    table: np.ndarray | Array

    @classmethod
    def from_layers(cls, layers: Sequence[LayerPages]) -> CachedPages:
        """Per-layer `LayerPages` of one batch (the same table for every layer, as
        `LayerPages.from_rows` builds it from the same row counts) stacked layer-major."""
        table = np.asarray(layers[0].table)
        for lp in layers[1:]:
            if not np.array_equal(np.asarray(lp.table), table):
                raise ValueError("cached pages of one batch need one page table for all layers")
        if any(isinstance(lp.pages, jax.Array) for lp in layers):  # assembled on the device
            return cls(jnp.stack([lp.pages[:, 0] for lp in layers]), table)
        return cls(np.stack([np.asarray(lp.pages)[:, 0] for lp in layers]), table)

    @classmethod
    def empty(cls, cfg: ModelConfig, batch_size: int, page_size: int = 16) -> CachedPages:
        pages = np.zeros((cfg.num_layers, 1, page_size, cfg.kv_width), cfg.kv_dtype)
        return cls(pages, np.zeros((batch_size, 1), np.int32))

    def to_host(self, where: jax.Device | jax.sharding.Sharding | None = None) -> CachedPages:
        """The pages in `pinned_host` memory (page-locked host memory the device copies from
        asynchronously) of a device, or of every device of a sharding (a sharded runner's
        `ModelRunner.pages_sharding`, each device's host memory holding its shard), the table
        on the device(s)."""
        pages_at, table_at = _placements(where, "pinned_host")
        return CachedPages(
            jax.device_put(self.pages, pages_at), jax.device_put(self.table, table_at)
        )

    def to_device(self, where: jax.Device | jax.sharding.Sharding | None = None) -> CachedPages:
        pages_at, table_at = _placements(where, "device")
        return CachedPages(
            jax.device_put(self.pages, pages_at), jax.device_put(self.table, table_at)
        )


def _placements(where, memory_kind: str):
    """(pages sharding in `memory_kind`, table sharding) for `CachedPages.to_host/to_device`."""
    if where is None or isinstance(where, jax.Device):
        device = where or jax.devices()[0]
        return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind), device
    replicated = jax.sharding.NamedSharding(where.mesh, P())
    return where.with_memory_kind(memory_kind), replicated
