"""`PrefillLoad`: the PE half of one request's load (loader.py has the protocol): read the PE's
blocks into the PE buffer, stream each layer's hit to the device just before the layer runs
(`HitLayer`), and send the DE the rows it lacks after each layer of each forward chunk."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np

from dualpath_jax import copies
from dualpath_jax.kvstore.buffers import BufferReservation
from dualpath_jax.model.cached_kv import DevicePages, bytes_to_pages
from dualpath_jax.model.layout import bytes_to_kv_rows, kv_rows_to_bytes, np_dtype
from dualpath_jax.transfer import links, paths
from dualpath_jax.transfer.loader import LoaderContext, LoadJob, Part, column_pieces, padded_blocks
from dualpath_jax.transfer.readiness import LayerReadiness
from dualpath_jax.transfer.row_offers import HitPieces, hit_meta, hit_piece_uuid


def _block_rows(res: BufferReservation, first: int, count: int, layer: int, bt: int) -> np.ndarray:
    """Layer `layer` of reserved blocks `[first, first + count)` as bytes `[count * bt, bytes]`."""
    if count == 0:
        return np.zeros((0, res.block(0).shape[-1] if len(res) else 0), np.uint8)
    return np.concatenate([res.block(first + j)[layer] for j in range(count)], axis=0)


@dataclasses.dataclass(frozen=True)
class DeviceRows:
    """Request `b`'s first `n` new KV rows in a forward's layer output `rows` `[B, N_pad, W]`
    (on the device): what `PrefillLoad.send_layer` offers to the DE without a host copy."""

    rows: jax.Array
    b: int
    n: int


def _row_bytes_of(rows, b):
    x = jax.lax.dynamic_index_in_dim(rows, b, keepdims=False)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], -1)


@jax.jit
def _row_bytes(rows, b):
    """rows `[B, N, W]` -> request b's rows as bytes `[N, W * itemsize]` uint8, on the device
    (one compiled program per batch shape, whichever request)."""
    return _row_bytes_of(rows, b)


@functools.partial(jax.jit, static_argnums=2)
def row_bytes_split(rows, b, split):
    """`_row_bytes` laid out as `split` says (its columns over the mesh: whole KV heads). On a
    mesh over several processes every process runs it, in the same order."""
    return jax.lax.with_sharding_constraint(_row_bytes_of(rows, b), split)


@dataclasses.dataclass(frozen=True)
class SplitRows:
    """A request's first `n` new rows as bytes laid out by `RowOffers.split` over a mesh that
    spans processes (`row_bytes_split`): this process offers the pieces it is home for."""

    x: jax.Array
    n: int


def _column_pieces(x: jax.Array) -> list[jax.Array]:
    """The column pieces of `x` (split by columns over a mesh), in column order: one
    single-device array per split, each where it was computed (a replica's; no copy)."""
    shards = [s for s in x.addressable_shards if s.replica_id == 0]
    shards.sort(key=lambda s: s.index[1].start or 0)
    return [s.data for s in shards]


@dataclasses.dataclass(frozen=True)
class HitLayer:
    """One layer of a request's effective hit, as the PE's forward takes it: the PE-read
    blocks' rows from the PE buffer (`host` `[p * bt, W]`, KV dtype) and the DE-read blocks as
    they arrived over the compute network, already on the device (`device`, None if none; on
    a PE spanning processes, this process's pieces of them, `HitPieces`, until the layer runs)."""

    host: np.ndarray
    device: DevicePages | HitPieces | None = None
    # The PE-read blocks already in device memory (a pinned PE buffer copies them there inside
    # a compiled program; spanning processes, this process's pieces of them); `host` is then
    # empty.
    pe_device: DevicePages | HitPieces | None = None

    @property
    def tokens(self) -> int:
        parts = (self.pe_device, self.device)
        dev = sum(d.blocks * d.pages.shape[1] for d in parts if d is not None)
        return self.host.shape[0] + dev

    def segments(self) -> list[np.ndarray | DevicePages]:
        """The hit's segments in token order (for `LayerPages.assemble`)."""
        out: list[np.ndarray | DevicePages] = [self.host] if len(self.host) else []
        return out + [d for d in (self.pe_device, self.device) if d is not None]

    def to_numpy(self) -> np.ndarray:
        """All rows `[tokens, W]` on the host (a device-to-host copy of the device parts)."""
        parts = [self.host]
        for d in (self.pe_device, self.device):
            if d is not None:
                dev = copies.to_host(d.pages, "hit_check")[: d.blocks]
                parts.append(dev.reshape(-1, dev.shape[-1]))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class PrefillLoad:
    """The PE half of one request's load.

    Lifecycle: `start()` -> `hit_blocks()` (waits for the reads) -> `stream()` -> per forward
    chunk: `begin_chunk(t0, t1, last)`, then per layer `readiness.wait(i)` (first chunk only),
    compute, `consumed()`, `send_layer(i, rows)` -> `flush()` -> `close()`.
    """

    def __init__(self, ctx: LoaderContext, job: LoadJob, lookahead: int = 2):
        self.ctx, self.job = ctx, job
        self.readiness = LayerReadiness(ctx.cfg.num_layers, f"{job.request_id}@{job.pe_engine}")
        self._reads: futures.Future[int] | None = None
        self._res: BufferReservation | None = None
        self._consumed = threading.Semaphore(lookahead)
        self._closed = False
        self._abort = threading.Event()  # set by close(): ends this load's waiting pulls
        self._chunk = 0
        self._piece = 0
        self._prefix = 0
        self._sends: list[futures.Future[None]] = []
        # Layer -> the PE-read blocks' bytes already copied to the device for the forward,
        # kept for their send to the DE after the layer ran (one copy serves both).
        self._pe_pages: dict[int, jax.Array] = {}
        self._hit_piece: tuple[int, int] | None = None  # (piece, tokens): sent layer by layer
        self.pe_read_bytes = 0
        self.held_blocks = 0  # of its blocks, taken from the engine's prefetch memory
        self.read_s = 0.0  # its store reads' time
        self.de_read_blocks = 0
        self._no_rows = np.zeros((0, ctx.cfg.kv_width), np_dtype(ctx.cfg.kv_dtype))

    # 1-2: reads ------------------------------------------------------------------------------

    def start(self) -> PrefillLoad:
        self._reads = self.ctx.pool.submit(self._read)
        return self

    def _read(self) -> int:
        ctx, job = self.ctx, self.job
        p = job.pe_blocks
        pe_hits = 0
        if p:
            self._res = ctx.buffer.reserve(p, owner=job.request_id, timeout_s=ctx.timeout_s)
            t0 = time.monotonic()  # after the buffer is free: the reads' own time, as the DE's
            keys = job.keys[job.lead : job.lead + p]
            pe_hits, self.held_blocks = ctx.read_hit(job, keys, self._res, 0, job.pe_node)
            self.pe_read_bytes = (pe_hits - self.held_blocks) * ctx.layout.nbytes
            self.read_s = time.monotonic() - t0
        de_hits = 0
        if job.de_blocks:
            (arr,) = ctx.channel.pull(
                job.de_address,
                job.uuid(Part.DE_HITS),
                [((1,), np.int32)],
                ctx.timeout_s,
                abort=self._abort,
            )
            de_hits = int(np.asarray(arr)[0])
        self.de_read_blocks = de_hits
        return pe_hits if pe_hits < p else p + de_hits

    def reads_done(self) -> bool:
        return self._reads is not None and self._reads.done()

    def hit_blocks(self) -> int:
        """Effective hit in blocks loaded after the job's lead (a prefix of the blocks read);
        blocks past it are recomputed."""
        assert self._reads is not None, "start() first"
        return self._reads.result(self.ctx.timeout_s)

    # 3: layer streaming --------------------------------------------------------------------

    def stream(self) -> None:
        """Starts streaming layers into `readiness` (at most `lookahead` layers ahead of the
        prefill loop, which calls `consumed()` after each layer)."""
        self.ctx.pool.submit(self._stream)

    def consumed(self) -> None:
        self._consumed.release()

    def _drop_de_layers(self) -> None:
        ctx, job = self.ctx, self.job
        if self._apart:  # every piece, to whichever process it would go
            lay, n = ctx.layout, self._de_pieces
            spec = [((padded_blocks(self.de_read_blocks), lay.block_tokens,
                      lay.bytes_per_token_per_layer // n), np.uint8)]  # fmt: skip
            for i in range(ctx.cfg.num_layers):
                for j, ranks in enumerate(ctx.row_offers.holders):
                    for rank in ranks:
                        uuid = hit_piece_uuid(job.request_id, job.attempt, i, j, rank)
                        ctx.channel.pull(
                            job.de_address, uuid, spec, ctx.timeout_s, abort=self._abort
                        )
            return
        spec = self._de_layer_spec()
        for i in range(ctx.cfg.num_layers):
            ctx.channel.pull(
                job.de_address,
                job.uuid(Part.DE_LAYER, layer=i),
                spec,
                ctx.timeout_s,
                abort=self._abort,
            )

    def _de_layer_spec(self):
        """What the DE offers a layer of its hit as: one array, or the PE's column pieces."""
        ctx, lay = self.ctx, self.ctx.layout
        blocks = padded_blocks(self.de_read_blocks)
        if self._de_pieces > 1:
            return ctx.page_piece_specs(blocks)
        return [((blocks, lay.block_tokens, lay.bytes_per_token_per_layer), np.uint8)]

    @property
    def _apart(self) -> bool:
        """This PE spans processes: the DE offers each hit piece to each process that holds it
        (`RowOffers.holders`), and each pulls its own."""
        return self.ctx.row_offers is not None

    @property
    def _de_pieces(self) -> int:
        """Column pieces of the DE's offers: the PE's own split when the job names it."""
        n = self.job.pe_pieces
        own = self.ctx.row_offers.pieces if self._apart else self.ctx.row_pieces
        if n > 1 and n != own:
            raise ValueError(
                f"request {self.job.request_id}: the DE offers {n} pieces, this PE splits its KV"
                f" rows into {own}"
            )
        return n

    def _stream(self) -> None:
        ctx, job = self.ctx, self.job
        try:
            h = self.hit_blocks()
            bt = ctx.layout.block_tokens
            p_used = min(job.pe_blocks, h)
            d_used = h - p_used
            if self.de_read_blocks and not d_used:  # the PE side missed first: drop the DE's offers
                self._drop_de_layers()
            for i in range(ctx.cfg.num_layers):
                if h == 0:  # nothing cached: every layer is ready at once
                    self.readiness.set_ready(i, None)
                    continue
                self._consumed.acquire()
                if self._closed:
                    return
                host, pe_device = self._no_rows, None
                if p_used:
                    if self._apart:
                        # Spanning processes: this process's pieces, the others offered theirs
                        # from the device (they pull them when the layer runs).
                        n = padded_blocks(p_used)
                        data = self._res.layer_pages(
                            0, p_used, i, pad_to=n, purpose="pe_buffer_pages"
                        )
                        meta = hit_meta(ctx.channel.address, job.request_id, job.attempt, i, n,
                                        p_used, "pe")  # fmt: skip
                        offers = ctx.row_offers
                        mine = offers.share_hit(
                            ctx.channel, meta, column_pieces(data, offers.pieces)
                        )
                        pe_device = HitPieces(mine, p_used, meta)
                        self._pe_pages[i] = data  # (for their send to the DE, `_send`)
                    elif ctx.buffer.pinned is not None:
                        # Pinned PE buffer: one in-program copy of the layer's blocks to the
                        # device, padded to a power of two (few compiled shapes).
                        data = self._res.layer_pages(
                            0, p_used, i, pad_to=padded_blocks(p_used), purpose="pe_buffer_pages"
                        )
                        pages = bytes_to_pages(data, bt, ctx.cfg.kv_width, ctx.cfg.kv_dtype)
                        pe_device = DevicePages(pages, p_used)
                        self._pe_pages[i] = data
                    else:
                        rows = _block_rows(self._res, 0, p_used, i, bt)
                        host = bytes_to_kv_rows(rows, ctx.cfg)
                    ctx.charge(
                        job,
                        paths.h2d_path(job.pe_engine, job.pe_node),
                        p_used * bt * ctx.layout.bytes_per_token_per_layer,
                        links.TrafficClass.HIGH,
                    )
                device = None
                if d_used and self._apart:
                    # Spanning processes: this process's pieces; the others pull theirs when
                    # the layer runs, and the pieces become one array over the mesh then.
                    lay = ctx.layout
                    meta = hit_meta(job.de_address, job.request_id, job.attempt, i,
                                    padded_blocks(self.de_read_blocks), d_used)  # fmt: skip
                    got = ctx.row_offers.pull_hit(
                        ctx.channel, meta, lay.block_tokens, lay.bytes_per_token_per_layer,
                        ctx.timeout_s, self._abort,
                    )  # fmt: skip
                    self._charge_de_layer(d_used)
                    device = HitPieces(got, d_used, meta)
                elif d_used:
                    # The DE's blocks stay on the device they were pulled to: bitcast to KV
                    # rows there, placed into the layer's pages by the forward's page assembly.
                    got = ctx.channel.pull(
                        job.de_address,
                        job.uuid(Part.DE_LAYER, layer=i),
                        self._de_layer_spec(),
                        ctx.timeout_s,
                        abort=self._abort,
                    )
                    # One piece per column split, each on a device that computes with it.
                    arr = ctx.join_pieces(got) if len(got) > 1 else got[0]
                    self._charge_de_layer(d_used)
                    pages = bytes_to_pages(arr, bt, ctx.cfg.kv_width, ctx.cfg.kv_dtype)
                    device = DevicePages(pages, d_used)
                self.readiness.set_ready(i, HitLayer(host, device, pe_device))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the waiter
            self.readiness.set_error(e)

    def _charge_de_layer(self, blocks: int) -> None:
        ctx, job = self.ctx, self.job
        path = paths.engine_to_engine_path(
            job.de_engine, job.pe_engine, job.de_node, job.pe_node, False, True
        )
        nbytes = blocks * ctx.layout.block_tokens * ctx.layout.bytes_per_token_per_layer
        ctx.charge(job, path, nbytes, links.TrafficClass.HIGH)

    # 4: PE -> DE --------------------------------------------------------------------------

    def begin_chunk(self, t0: int, t1: int, last: bool, n_pad: int | None = None) -> None:
        """Announces that the next forward computes prompt tokens `[t0, t1)` of this request
        (`last`: its final chunk). Layer rows follow through `send_layer`: host rows
        `[t1 - t0, W]`, or `DeviceRows` of a layer output padded to `n_pad` rows."""
        ctx, job = self.ctx, self.job
        bt = ctx.layout.block_tokens
        start = job.lead * bt if self.hit_blocks() else 0  # where the PE-read rows start
        hit_tokens = min(job.pe_blocks, self.hit_blocks()) * bt
        self._prefix = 0
        if self._chunk == 0 and hit_tokens:
            if not start and t0 == hit_tokens:
                self._prefix = hit_tokens  # the PE-read hit rows travel with this chunk's rows
            else:  # split path or a lead: the hit rows are not contiguous with these rows;
                # each layer of them goes with this chunk's (`send_layer`)
                k = self._offer_meta(start, start + hit_tokens, False, hit_tokens, 0)
                self._hit_piece = (k, hit_tokens)
        n_pad = t1 - t0 if n_pad is None else n_pad
        self._piece = self._offer_meta(t0 - self._prefix, t1, last, self._prefix, n_pad)

    @property
    def chunk(self) -> int:
        """The index of the current output chunk (what its uuids carry)."""
        return self._piece

    def send_layer(self, layer: int, rows: np.ndarray | DeviceRows | SplitRows) -> None:
        """Layer `layer`'s KV rows of the current chunk, sent asynchronously: host rows
        `[t1 - t0, W]`, `DeviceRows` (offered from the device as they are: no host copy), or
        `SplitRows` (spanning processes: this process's pieces; the others offer theirs)."""
        piece, prefix = self._piece, self._prefix
        if self._hit_piece is not None:
            k, n = self._hit_piece
            self._sends.append(self.ctx.pool.submit(self._send, k, layer, None, n))
            if layer == self.ctx.cfg.num_layers - 1:
                self._hit_piece = None
        self._sends.append(self.ctx.pool.submit(self._send, piece, layer, rows, prefix))

    def _offer_meta(self, t0: int, t1: int, last: bool, prefix: int, n_pad: int) -> int:
        """Piece meta `[t0, t1, last, prefix, n_pad, splits]`: the piece holds tokens
        `[t0, t1)`, its first `prefix` rows from the PE buffer (one array), the rest as the first
        rows of `n_pad` rows, sent as `splits` arrays of equal column ranges (KV heads)."""
        k = self._chunk
        self._chunk += 1
        offers = self.ctx.row_offers
        splits = offers.pieces if offers is not None else self.ctx.row_pieces
        meta = np.array([t0, t1, int(last), prefix, n_pad, splits], np.int32)
        self.ctx.channel.offer(self.job.uuid(Part.PE_PIECE, k), [meta])
        return k

    def _send(
        self, piece: int, layer: int, rows: np.ndarray | DeviceRows | SplitRows | None, prefix: int
    ) -> None:
        ctx, job = self.ctx, self.job
        bt, width = ctx.layout.block_tokens, ctx.layout.bytes_per_token_per_layer
        arrays: list = []
        nbytes = 0
        if prefix:  # padded to a power of two of blocks (few compiled shapes); the DE drops it
            n = prefix // bt
            data = self._pe_pages.pop(layer, None)  # (the forward's copy, if it made one)
            if data is None or data.shape[0] != padded_blocks(n):
                data = self._res.layer_pages(
                    0, n, layer, pad_to=padded_blocks(n), purpose="pe_prefix_send"
                )
            arrays.append(data)
            nbytes += prefix * width
        split = ctx.row_split
        if isinstance(rows, DeviceRows):
            if split is None:
                arrays.append(_row_bytes(rows.rows, rows.b))
            else:  # each split from the device that holds it
                arrays += _column_pieces(row_bytes_split(rows.rows, rows.b, split))
            nbytes += rows.n * width
        elif isinstance(rows, SplitRows):  # this process's pieces, at their own uuids
            ctx.row_offers.offer(ctx.channel, job.request_id, job.attempt, piece, layer, rows.x)
            nbytes += rows.n * width
        elif rows is not None:
            data = kv_rows_to_bytes(copies.to_host(rows, "new_rows"))
            arrays += np.split(data, ctx.row_pieces, axis=1)
            nbytes += data.nbytes
        path = paths.engine_to_engine_path(
            job.pe_engine, job.de_engine, job.pe_node, job.de_node, True, False
        )
        ctx.charge(job, path, nbytes, links.TrafficClass.HIGH)
        if arrays:  # (split pieces alone went out at their own uuids)
            ctx.channel.offer(job.uuid(Part.PE_LAYER, piece, layer), arrays)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every layer sent so far has been offered; raises a send's error."""
        for f in self._sends:
            f.result(timeout_s if timeout_s is not None else self.ctx.timeout_s)
        self._sends.clear()

    def close(self) -> None:
        self._closed = True
        self._pe_pages.clear()
        self._abort.set()
        self.readiness.cancel()
        for _ in range(self.ctx.cfg.num_layers):  # wake a streamer waiting for the prefill loop
            self._consumed.release()
        if self._res is not None:
            self._res.release()
            self._res = None
