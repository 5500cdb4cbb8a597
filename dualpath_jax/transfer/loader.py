"""DualPathLoader: moves one request's KV along the paper's data paths (docs/architecture.md, paper Fig. 4).

A request's hit is `n` Full Blocks in chain order. The Assignment splits them: the first `k`
(`LoadJob.lead`, load or recompute) are recomputed by the PE and not read, then `p` are read on
the PE's node (PE read path) and `d` on the DE's node (DE read path); the SPLIT path has both
`p` and `d` non-zero. Below, block indices count from the lead (`[0, p)` are hit blocks
`[k, k + p)`). Two halves run in two engine processes and meet on a `KVChannel`:

PE half (`prefill_load.PrefillLoad`, in the prefill engine):
  1. store -> PE buffer: read blocks `[0, p)` as Full Blocks (SNIC of the PE node, LOW class).
  2. learn how many of the DE's blocks verified (a tiny message from the DE half) and fix the
     effective hit `h` (a prefix: a corrupt or missing block ends it; the rest is recomputed).
  3. per layer, just before the layer runs: PE buffer -> device (H2D) for blocks `[0, min(p, h))`
     and DE buffer -> PE device over the compute network for blocks `[p, h)` (HIGH class); the
     readiness value is a `HitLayer`: the PE-read rows on the host, the DE-read blocks as device
     pages where the pull put them (they never go through the PE's host memory). On a PE whose
     mesh splits the KV heads the DE offers each layer in the PE's column pieces
     (`LoadJob.pe_pieces`), and each is pulled straight to a device that holds those heads (on
     a PE spanning processes, by the process that holds them: `row_offers.RowOffers`).
  4. after each layer of each forward chunk: PE device -> DE buffer of the rows the DE lacks: the
     PE-read hit rows (first piece) and the computed rows, a recomputed lead's and the new
     tokens', each piece at its prompt position (HIGH class). On a mesh whose
     devices split the KV heads (`LoaderContext.mesh`), the new rows go as one array per split,
     each offered from the device that computed those heads (no gather onto one device); the
     chunk's meta says how many. A PE spanning processes offers each piece from its own
     process, at its own uuid (`row_offers.RowOffers`, `LoadJob.pe_piece_addresses`).

DE half (`decode_load.DecodeLoad`, in the decode engine):
  1. reserve the DE buffer for the whole prompt; store -> DE buffer: blocks `[p, p + d)`.
  2. tell the PE half how many verified; offer each layer's Layer Blocks of them to the PE.
  3. receive the PE's pieces layer by layer into the DE buffer, merging with its own hit blocks.
  4. `prompt_kv()` returns the full prompt KV rows `[L, T, W]` for the decode slot (H2D).

Oracle mode moves the same bytes (so tokens stay exact) but charges no link and never waits on
one, like the paper's Oracle baseline. uuids are derived from (request, part, chunk, layer) so
both halves agree without a round trip; a pull may be issued before the matching offer.

This module holds what the halves share: `LoadJob` (what one request's load moves, and its
uuids), `Part` (what a uuid carries) and `LoaderContext` (one engine's dependencies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from collections.abc import Sequence
from concurrent import futures

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as PS

from dualpath_jax.config import ModelConfig
from dualpath_jax.kvstore.api import BlockStore, buffer_destination
from dualpath_jax.kvstore.buffers import BufferReservation, HostBufferPool
from dualpath_jax.model import sharding
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.transfer import links, paths
from dualpath_jax.transfer.channel import KVChannel, make_uuid
from dualpath_jax.transfer.prefetch_memory import PrefetchMemory
from dualpath_jax.transfer.row_offers import RowOffers
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
    # A PE spanning processes offers each column piece of its new rows from the process that
    # computed it, at these addresses (`row_offers.RowOffers`); empty: all at `pe_address`.
    pe_piece_addresses: tuple[str, ...] = ()
    # ... and which of its processes hold each piece: the DE offers each its DE-read pieces.
    pe_piece_holders: tuple[tuple[int, ...], ...] = ()
    lead: int = 0
    session: str = ""  # its session: a load takes its blocks from that session's prefetch

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
    # The engine's tool-gap prefetch memory (None: no prefetch; transfer/prefetch_memory.py).
    prefetch: PrefetchMemory | None = None
    # A PE spanning processes: each process offers its own column pieces of the new rows.
    row_offers: RowOffers | None = None

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

    def read_hit(
        self, job: LoadJob, keys: Sequence[str], res: BufferReservation, first: int, node: str
    ) -> tuple[int, int]:
        """Reads one side's hit blocks `keys` into the engine's buffer, reserved blocks
        `[first, first + len(keys))` of `res`: the leading ones a tool-gap prefetch of the
        job's session holds from memory, the rest from the store straight into the buffer's
        slots (`api.buffer_destination`), charged to `node`'s storage links at LOW (and, with a
        prefetch memory, with no prefetch block starting meanwhile). Returns `(hits, held)`:
        the leading blocks now in the buffer (a missing block ends them) and how many of those
        came from memory."""
        held = self.prefetch.take(job.session, keys) if self.prefetch and job.session else []
        for i, block in enumerate(held):
            res.block(first + i)[...] = block
        h = len(held)
        if h == len(keys):
            return h, h
        dest = buffer_destination(res, first + h)
        with self.prefetch.critical() if self.prefetch else contextlib.nullcontext():
            got = self.store.read_full(keys[h:], dest).result(self.timeout_s)
        self.charge(
            job, paths.store_read_path(node), got.hits * self.layout.nbytes, links.TrafficClass.LOW
        )
        return h + got.hits, h

    def rows_nbytes(self, tokens: int) -> int:
        return tokens * self.layout.bytes_per_token_per_layer

    @functools.cached_property
    def row_split(self) -> NamedSharding | None:
        """How a request's new KV rows as bytes `[N, bytes]` split into pieces to send: by
        columns, as the engine's KV rows split their width (whole KV heads per device) over the
        mesh; None when they do not split (one device, MLA, too few heads)."""
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
        return sharding.join_column_pieces(pieces, pieces[0].shape, len(pieces), self.page_split)


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


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_blocks(n: int) -> int:
    """Blocks a layer of `n` hit blocks is padded to on a device (a DE_LAYER offer for `n`
    verified blocks, the pinned PE buffer's pages): a power of two (few shapes on the PE's
    device; the padding is zeros), 0 for none."""
    return _pow2(n) if n else 0
