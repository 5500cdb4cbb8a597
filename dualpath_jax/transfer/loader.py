"""DualPathLoader: moves one request's KV along the paper's data paths (docs/architecture.md, paper Fig. 4).

A request's hit is `n` Full Blocks in chain order. The Assignment splits them: the first `k`
(`LoadJob.lead`, load or recompute) are recomputed by the PE and not read, then `p` are read on
the PE's node (PE read path) and `d` on the DE's node (DE read path); the SPLIT path has both
`p` and `d` non-zero. Below, block indices count from the lead (`[0, p)` are hit blocks
`[k, k + p)`). Two halves run in two engine processes and meet on a `KVChannel`:

PE half (`PrefillLoad`, in the prefill engine):
  1. store -> PE buffer: read blocks `[0, p)` as Full Blocks (SNIC of the PE node, LOW class).
  2. learn how many of the DE's blocks verified (a tiny message from the DE half) and fix the
     effective hit `h` (a prefix: a corrupt or missing block ends it; the rest is recomputed).
  3. per layer, just before the layer runs: PE buffer -> device (H2D) for blocks `[0, min(p, h))`
     and DE buffer -> PE device over the compute network for blocks `[p, h)` (HIGH class); the
     readiness value is a `HitLayer`: the PE-read rows on the host, the DE-read blocks as device
     pages where the pull put them (they never go through the PE's host memory). On a PE whose
     mesh splits the KV heads the DE offers each layer in the PE's column pieces
     (`LoadJob.pe_pieces`), and each is pulled straight to a device that holds those heads.
  4. after each layer of each forward chunk: PE device -> DE buffer of the rows the DE lacks: the
     PE-read hit rows (first piece) and the computed rows, a recomputed lead's and the new
     tokens', each piece at its prompt position (HIGH class). On a mesh whose
     devices split the KV heads (`LoaderContext.mesh`), the new rows go as one array per split,
     each offered from the device that computed those heads (no gather onto one device); the
     chunk's meta says how many.

DE half (`DecodeLoad`, in the decode engine):
  1. reserve the DE buffer for the whole prompt; store -> DE buffer: blocks `[p, p + d)`.
  2. tell the PE half how many verified; offer each layer's Layer Blocks of them to the PE.
  3. receive the PE's pieces layer by layer into the DE buffer, merging with its own hit blocks.
  4. `prompt_kv()` returns the full prompt KV rows `[L, T, W]` for the decode slot (H2D).

Oracle mode moves the same bytes (so tokens stay exact) but charges no link and never waits on
one, like the paper's Oracle baseline. uuids are derived from (request, part, chunk, layer) so
both halves agree without a round trip; a pull may be issued before the matching offer.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as PS

from dualpath_jax import copies
from dualpath_jax.config import ModelConfig
from dualpath_jax.kvstore.buffers import BufferReservation, HostBufferPool
from dualpath_jax.kvstore.store import BlockStore
from dualpath_jax.model import sharding
from dualpath_jax.model.cached_kv import DevicePages
from dualpath_jax.model.layout import BlockLayout, bytes_to_kv_rows, kv_rows_to_bytes, np_dtype
from dualpath_jax.transfer import links, paths
from dualpath_jax.transfer.channel import KVChannel, make_uuid
from dualpath_jax.transfer.readiness import LayerReadiness
from dualpath_jax.transfer.traffic import TrafficManager


class Part(enum.IntEnum):
    """What a uuid carries (the `part` of `make_uuid`)."""

    DE_HITS = 1  # DE half -> PE half: [verified DE blocks]
    DE_LAYER = 2  # DE half -> PE half: one layer's rows of the DE-read hit blocks
    PE_PIECE = 3  # PE half -> DE half: [t0, t1, last] of output piece `chunk`
    PE_LAYER = 4  # PE half -> DE half: one layer's rows of output piece `chunk`


@dataclasses.dataclass(frozen=True)
class LoadJob:
    """What both halves need to know about one request's KV movement.

    `keys`: the hit blocks' keys (chain order); `lead`: how many leading ones the PE recomputes
    rather than reads (load or recompute); `pe_blocks`/`de_blocks`: how many of the rest each
    side reads, the PE's first (`lead + pe_blocks + de_blocks <= len(keys)`); `prompt_tokens`:
    the prompt length; engines and nodes name the links to charge; addresses are the two
    halves' channel addresses.
    """

    request_id: str
    keys: tuple[str, ...]
    pe_blocks: int
    de_blocks: int
    prompt_tokens: int
    pe_engine: str
    pe_node: str
    de_engine: str
    de_node: str
    pe_address: str
    de_address: str
    oracle: bool = False
    attempt: int = 0  # bumped when a request is retried, so stale offers are never pulled
    pe_pieces: int = 1  # column pieces of the PE's KV rows: the DE offers its hit layers in them
    lead: int = 0

    def __post_init__(self) -> None:
        if (
            self.pe_blocks < 0
            or self.de_blocks < 0
            or self.lead < 0
            or self.lead + self.pe_blocks + self.de_blocks > len(self.keys)
        ):
            raise ValueError(
                f"{self.request_id}: {self.lead} recomputed + {self.pe_blocks} + {self.de_blocks}"
                f" read blocks for {len(self.keys)} keys"
            )

    def uuid(self, part: Part, chunk: int = 0, layer: int = 0) -> int:
        return make_uuid(self.request_id, layer, int(part) * 100_000 + chunk, epoch=self.attempt)


@dataclasses.dataclass
class LoaderContext:
    """Per-engine dependencies shared by every load of that engine."""

    cfg: ModelConfig
    layout: BlockLayout
    store: BlockStore
    buffer: HostBufferPool
    channel: KVChannel
    traffic: TrafficManager | None
    pool: futures.Executor
    timeout_s: float = 60.0
    owners: frozenset[str] | None = None  # links this process charges (None: every link)
    # How long a DE waits for its PE to begin a chunk of the request (the PE's own queue);
    # `timeout_s` bounds each transfer once it has begun. 0: `timeout_s`.
    start_timeout_s: float = 0.0
    # The engine's mesh (None: one device). A PE on a mesh that splits the KV heads sends each
    # layer's new rows as one piece per split (`row_split`).
    mesh: Mesh | None = None

    def charge(
        self, job: LoadJob, path: Sequence[links.LinkId], nbytes: int, cls: links.TrafficClass
    ) -> None:
        """Charges (and, when emulated, waits for) the links of `path` this process owns: each
        process charges its own engine's and node's links, so a copy is counted once per link."""
        if self.traffic is None or job.oracle or not nbytes:
            return
        mine = [x for x in path if self.owners is None or x.owner in self.owners]
        if mine:
            self.traffic.transfer(mine, nbytes, cls)

    def rows_nbytes(self, tokens: int) -> int:
        return tokens * self.layout.bytes_per_token_per_layer

    @functools.cached_property
    def row_split(self) -> NamedSharding | None:
        """How a request's new KV rows as bytes `[N, bytes]` split into pieces to send: by
        columns, as the engine's KV rows split their width (whole KV heads per device) over the
        mesh; None when they do not split (one device, MLA, scaled rows, too few heads)."""
        if self.mesh is None:
            return None
        spec = sharding.kv_rows_sharding(self.cfg, self.mesh, (1, 1, self.cfg.kv_width)).spec
        axis = spec[2] if len(spec) > 2 else None
        return NamedSharding(self.mesh, PS(None, axis)) if axis else None

    @property
    def row_pieces(self) -> int:
        """Pieces a layer's new rows travel in (1 without a split)."""
        split = self.row_split
        return 1 if split is None else split.mesh.shape[split.spec[1]]

    @functools.cached_property
    def page_split(self) -> NamedSharding | None:
        """How a layer's hit pages as bytes `[blocks, bt, bytes]` split over the mesh: by
        columns, like the rows (`row_split`)."""
        split = self.row_split
        return None if split is None else NamedSharding(split.mesh, PS(None, None, split.spec[1]))

    def page_piece_specs(self, blocks: int) -> list[jax.ShapeDtypeStruct]:
        """One spec per column piece of a hit layer of `blocks` blocks, each on the first device
        that holds those columns: the DE's pieces land where the PE computes with them."""
        split, n = self.page_split, self.row_pieces
        lay = self.layout
        shape = (blocks, lay.block_tokens, lay.bytes_per_token_per_layer)
        width = shape[2] // n
        where: dict[int, jax.Device] = {}
        for dev, idx in split.devices_indices_map(shape).items():
            where.setdefault((idx[2].start or 0) // width, dev)
        return [
            jax.ShapeDtypeStruct(
                (blocks, lay.block_tokens, width), np.uint8, sharding=SingleDeviceSharding(where[j])
            )
            for j in range(n)
        ]

    def join_pieces(self, pieces: Sequence[jax.Array]) -> jax.Array:
        """The column pieces of a hit layer (`page_piece_specs`) as one array split over the
        mesh (`page_split`); devices that replicate a piece get a device-to-device copy."""
        split = self.page_split
        blocks, bt, width = pieces[0].shape
        shape = (blocks, bt, width * len(pieces))
        arrays = []
        for dev, idx in split.addressable_devices_indices_map(shape).items():
            piece = pieces[(idx[2].start or 0) // width]
            arrays.append(piece if piece.devices() == {dev} else jax.device_put(piece, dev))
        return jax.make_array_from_single_device_arrays(shape, split, arrays)


def column_pieces(blocks: jax.Array, n: int) -> list[jax.Array]:
    """`[blocks, bt, bytes]` as `n` arrays of `bytes / n` columns each (whole KV heads: the
    rows are head-major), on the device of `blocks`."""
    width = blocks.shape[-1]
    if n <= 1:
        return [blocks]
    if width % n:
        raise ValueError(f"{width} bytes a row do not split into {n} equal pieces")
    w = width // n
    return [blocks[..., j * w : (j + 1) * w] for j in range(n)]


def _block_rows(res: BufferReservation, first: int, count: int, layer: int, bt: int) -> np.ndarray:
    """Layer `layer` of reserved blocks `[first, first + count)` as bytes `[count * bt, bytes]`."""
    if count == 0:
        return np.zeros((0, res.block(0).shape[-1] if len(res) else 0), np.uint8)
    return np.concatenate([res.block(first + j)[layer] for j in range(count)], axis=0)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _padded_blocks(n: int) -> int:
    """Blocks a DE_LAYER offer carries for `n` verified blocks: a power of two (few shapes on
    the PE's device; the padding is zeros)."""
    return _pow2(n) if n else 0


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _bytes_to_pages(data, block_tokens: int, width: int, dtype: str):
    """Layer bytes `[n, bt, W * itemsize]` (or `[n * bt, ...]`) uint8 -> pages `[n, bt, W]` in
    the KV dtype, on the device (a bitcast: no copy through the host)."""
    dt = jnp.dtype(dtype)
    x = data.reshape(-1, block_tokens, width, dt.itemsize)
    return jax.lax.bitcast_convert_type(x[..., 0] if dt.itemsize == 1 else x, dt)


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
def _row_bytes_split(rows, b, split):
    """`_row_bytes` laid out as `split` says (its columns over the mesh: whole KV heads)."""
    return jax.lax.with_sharding_constraint(_row_bytes_of(rows, b), split)


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
    they arrived over the compute network, already on the device (`device`, None if none)."""

    host: np.ndarray
    device: DevicePages | None = None
    # The PE-read blocks already in device memory (a pinned PE buffer copies them there inside
    # a compiled program); `host` is then empty.
    pe_device: DevicePages | None = None

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
        self.pe_read_bytes = 0
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
            out = [self._res.block(j) for j in range(p)]
            keys = job.keys[job.lead : job.lead + p]
            got = ctx.store.read_full(keys, out=out).result(ctx.timeout_s)
            pe_hits = got.hits
            self.pe_read_bytes = pe_hits * ctx.layout.nbytes
            ctx.charge(
                job, paths.store_read_path(job.pe_node), self.pe_read_bytes, links.TrafficClass.LOW
            )
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
        blocks = _padded_blocks(self.de_read_blocks)
        if self._de_pieces > 1:
            return ctx.page_piece_specs(blocks)
        return [((blocks, lay.block_tokens, lay.bytes_per_token_per_layer), np.uint8)]

    @property
    def _de_pieces(self) -> int:
        """Column pieces of the DE's offers: the PE's own split when the job names it."""
        n = self.job.pe_pieces
        if n > 1 and n != self.ctx.row_pieces:
            raise ValueError(
                f"request {self.job.request_id}: the DE offers {n} pieces, this PE splits its KV"
                f" rows into {self.ctx.row_pieces}"
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
                    if ctx.buffer.pinned is not None:
                        # Pinned PE buffer: one in-program copy of the layer's blocks to the
                        # device, padded to a power of two (few compiled shapes).
                        data = self._res.layer_pages(
                            0, p_used, i, pad_to=_pow2(p_used), purpose="pe_buffer_pages"
                        )
                        pages = _bytes_to_pages(data, bt, ctx.cfg.kv_width, ctx.cfg.kv_dtype)
                        pe_device = DevicePages(pages, p_used)
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
                if d_used:
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
                    ctx.charge(
                        job,
                        paths.engine_to_engine_path(
                            job.de_engine, job.pe_engine, job.de_node, job.pe_node, False, True
                        ),
                        d_used * bt * ctx.layout.bytes_per_token_per_layer,
                        links.TrafficClass.HIGH,
                    )
                    pages = _bytes_to_pages(arr, bt, ctx.cfg.kv_width, ctx.cfg.kv_dtype)
                    device = DevicePages(pages, d_used)
                self.readiness.set_ready(i, HitLayer(host, device, pe_device))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the waiter
            self.readiness.set_error(e)

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
            else:  # split path or a lead: the hit rows are not contiguous with these rows
                self._offer_piece(start, start + hit_tokens, False, lambda i: None)
        n_pad = t1 - t0 if n_pad is None else n_pad
        self._piece = self._offer_meta(t0 - self._prefix, t1, last, self._prefix, n_pad)

    def send_layer(self, layer: int, rows: np.ndarray | DeviceRows) -> None:
        """Layer `layer`'s KV rows of the current chunk, sent asynchronously: host rows
        `[t1 - t0, W]`, or `DeviceRows` (offered from the device as they are: no host copy)."""
        piece, prefix = self._piece, self._prefix
        self._sends.append(self.ctx.pool.submit(self._send, piece, layer, rows, prefix))

    def _offer_meta(self, t0: int, t1: int, last: bool, prefix: int, n_pad: int) -> int:
        """Piece meta `[t0, t1, last, prefix, n_pad, splits]`: the piece holds tokens
        `[t0, t1)`, its first `prefix` rows from the PE buffer (one array), the rest as the first
        rows of `n_pad` rows, sent as `splits` arrays of equal column ranges (KV heads)."""
        k = self._chunk
        self._chunk += 1
        splits = self.ctx.row_pieces
        meta = np.array([t0, t1, int(last), prefix, n_pad, splits], np.int32)
        self.ctx.channel.offer(self.job.uuid(Part.PE_PIECE, k), [meta])
        return k

    def _offer_piece(
        self, t0: int, t1: int, last: bool, rows_of: Callable[[int], np.ndarray | None]
    ) -> None:
        k = self._offer_meta(t0, t1, last, t1 - t0, 0)
        for i in range(self.ctx.cfg.num_layers):
            self._send(k, i, rows_of(i), t1 - t0)

    def _send(
        self, piece: int, layer: int, rows: np.ndarray | DeviceRows | None, prefix: int
    ) -> None:
        ctx, job = self.ctx, self.job
        bt, width = ctx.layout.block_tokens, ctx.layout.bytes_per_token_per_layer
        arrays: list = []
        nbytes = 0
        if prefix:
            arrays.append(self._res.layer_pages(0, prefix // bt, layer, purpose="pe_prefix_send"))
            nbytes += prefix * width
        split = ctx.row_split
        if isinstance(rows, DeviceRows):
            if split is None:
                arrays.append(_row_bytes(rows.rows, rows.b))
            else:  # each split from the device that holds it
                arrays += _column_pieces(_row_bytes_split(rows.rows, rows.b, split))
            nbytes += rows.n * width
        elif rows is not None:
            data = kv_rows_to_bytes(copies.to_host(rows, "new_rows"))
            arrays += np.split(data, ctx.row_pieces, axis=1)
            nbytes += data.nbytes
        path = paths.engine_to_engine_path(
            job.pe_engine, job.de_engine, job.pe_node, job.de_node, True, False
        )
        ctx.charge(job, path, nbytes, links.TrafficClass.HIGH)
        ctx.channel.offer(job.uuid(Part.PE_LAYER, piece, layer), arrays)

    def flush(self, timeout_s: float | None = None) -> None:
        """Waits until every layer sent so far has been offered; raises a send's error."""
        for f in self._sends:
            f.result(timeout_s if timeout_s is not None else self.ctx.timeout_s)
        self._sends.clear()

    def close(self) -> None:
        self._closed = True
        self._abort.set()
        self.readiness.cancel()
        for _ in range(self.ctx.cfg.num_layers):  # wake a streamer waiting for the prefill loop
            self._consumed.release()
        if self._res is not None:
            self._res.release()
            self._res = None


class DecodeLoad:
    """The DE half of one request's load. Lifecycle: `start()` -> `wait()` (the prompt KV is
    complete in the DE buffer) -> `prompt_kv()` -> `close()` (frees the DE buffer)."""

    def __init__(self, ctx: LoaderContext, job: LoadJob):
        self.ctx, self.job = ctx, job
        bt = ctx.layout.block_tokens
        self.n_blocks = -(-job.prompt_tokens // bt)
        self._abort = threading.Event()  # set by close(): ends this load's waiting pulls
        self._res: BufferReservation | None = None
        self._done: futures.Future[None] | None = None
        self.de_hits = 0
        self.de_read_bytes = 0
        self.on_read_done: Callable[[], None] | None = (
            None  # e.g. the node's read queue bookkeeping
        )

    def start(self) -> DecodeLoad:
        self._res = self.ctx.buffer.reserve(
            self.n_blocks, owner=self.job.request_id, timeout_s=self.ctx.timeout_s
        )
        self._done = self.ctx.pool.submit(self._run)
        return self

    def _run(self) -> None:
        ctx, job = self.ctx, self.job
        bt, p, d = ctx.layout.block_tokens, job.pe_blocks, job.de_blocks
        res = self._res
        first = job.lead + p  # the DE's blocks sit at their prompt positions in its buffer
        if d:
            out = [res.block(first + j) for j in range(d)]
            got = ctx.store.read_full(job.keys[first : first + d], out=out).result(ctx.timeout_s)
            self.de_hits = got.hits
            self.de_read_bytes = got.hits * ctx.layout.nbytes
            ctx.charge(
                job, paths.store_read_path(job.de_node), self.de_read_bytes, links.TrafficClass.LOW
            )
            if self.on_read_done is not None:
                self.on_read_done()
            ctx.channel.offer(job.uuid(Part.DE_HITS), [np.array([self.de_hits], np.int32)])
            if self.de_hits:
                path = paths.engine_to_engine_path(
                    job.de_engine, job.pe_engine, job.de_node, job.pe_node, False, True
                )
                padded = _padded_blocks(self.de_hits)
                nbytes = self.de_hits * bt * ctx.layout.bytes_per_token_per_layer
                for i in range(ctx.cfg.num_layers):
                    blocks = res.layer_pages(first, self.de_hits, i, padded, purpose="de_offer")
                    ctx.charge(job, path, nbytes, links.TrafficClass.HIGH)
                    pieces = column_pieces(blocks, job.pe_pieces)
                    ctx.channel.offer(job.uuid(Part.DE_LAYER, layer=i), pieces)
        # Receive the PE's pieces into the DE buffer.
        k, last = 0, False
        width = ctx.layout.bytes_per_token_per_layer
        while not last:
            # The PE offers a chunk's meta when it begins the chunk: waiting for it is waiting
            # in the PE's queue, which under load can take longer than any one transfer.
            (meta,) = ctx.channel.pull(
                job.pe_address,
                job.uuid(Part.PE_PIECE, k),
                [((6,), np.int32)],
                ctx.start_timeout_s or ctx.timeout_s,
                abort=self._abort,
            )
            t0, t1, last_flag, prefix, n_pad, splits = (int(x) for x in np.asarray(meta))
            last = bool(last_flag)
            new = t1 - t0 - prefix
            specs = [((prefix // bt, bt, width), np.uint8)] if prefix else []
            specs += [((n_pad, width // splits), np.uint8)] * splits if new else []
            path = paths.engine_to_engine_path(
                job.pe_engine, job.de_engine, job.pe_node, job.de_node, True, False
            )
            for i in range(ctx.cfg.num_layers):
                arrays = ctx.channel.pull(
                    job.pe_address,
                    job.uuid(Part.PE_LAYER, k, i),
                    specs,
                    ctx.timeout_s,
                    abort=self._abort,
                )
                # Into the DE buffer (host memory); the new rows' padding is dropped.
                parts = [copies.to_host(a, "de_buffer") for a in arrays]
                if prefix:
                    parts[0] = parts[0].reshape(prefix, width)
                if new:  # the column splits side by side, the padding dropped
                    cols = parts[len(parts) - splits :]
                    joined = cols[0] if splits == 1 else np.concatenate(cols, axis=1)
                    parts[len(parts) - splits :] = [joined[:new]]
                data = np.concatenate(parts) if len(parts) > 1 else parts[0]
                ctx.charge(job, path, data.nbytes, links.TrafficClass.HIGH)
                self._write_rows(i, t0, data)
            k += 1

    def _write_rows(self, layer: int, t0: int, data: np.ndarray) -> None:
        bt = self.ctx.layout.block_tokens
        t = t0
        while t < t0 + data.shape[0]:
            b, off = divmod(t, bt)
            n = min(bt - off, t0 + data.shape[0] - t)
            self._res.block(b)[layer, off : off + n] = data[t - t0 : t - t0 + n]
            t += n

    def done(self) -> bool:
        return self._done is not None and self._done.done()

    def wait(self, timeout_s: float | None = None) -> None:
        assert self._done is not None, "start() first"
        self._done.result(timeout_s if timeout_s is not None else self.ctx.timeout_s)

    def prompt_blocks(self) -> np.ndarray:
        """The prompt's KV as Full Blocks `[n, L, bt, bytes]` uint8 (a copy out of the DE
        buffer; the last block may be partly filled)."""
        return np.stack(self._res.blocks())

    def prompt_kv(self) -> np.ndarray:
        """The full prompt's KV rows `[L, prompt_tokens, W]` (a copy out of the DE buffer)."""
        blocks = self.prompt_blocks()  # [n, L, bt, bytes]
        flat = blocks.transpose(1, 0, 2, 3).reshape(self.ctx.cfg.num_layers, -1, blocks.shape[-1])
        return bytes_to_kv_rows(flat[:, : self.job.prompt_tokens], self.ctx.cfg)

    def close(self) -> None:
        self._abort.set()
        if self._res is not None:
            self._res.release()
            self._res = None
