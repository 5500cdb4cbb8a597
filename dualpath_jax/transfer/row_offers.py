"""`RowOffers`: how a prefill engine spanning several processes sends a layer's new KV rows to
the DE: each column piece (whole KV heads) from the process whose device computed it, over that
process's own KV channel, instead of gathered over the mesh onto the leader and sent from its
host.

Every process of the engine runs the same forward (engines/span.py). After each layer each takes
every request's rows as bytes split by columns over the engine's mesh (`RowOffers.split`, one
program every process runs in the same order, no collective when the rows already split so) and
offers the pieces it is home for: piece j's home is the process of the first device, in mesh
order, that holds columns j. The DE learns where each piece is offered from the PE's
registration (`RowOffers.addresses`, carried in `LoadJob.pe_piece_addresses`) and pulls piece j
of chunk k, layer i, under `piece_uuid`; the chunk's meta (from the leader) says how many pieces
there are. Rows that do not split by columns (MLA's one latent head) are one piece, the leader's.

The other way, hit blocks to the PE: the DE offers each DE-read layer's column pieces once for
every process whose devices hold that piece (`RowOffers.holders`, registered with the piece
count; a piece replicated over processes, as MLA's one latent head or a `data` axis across
them, is offered to each), at their own uuids (`hit_piece_uuid`), and the leader offers the
pieces of its PE-read blocks the same way from its device (`share_hit`); every process pulls
its pieces straight onto a device that computes with them (`pull_hit`), copies a piece to its
other local devices that hold it, and the processes join them into one array over the mesh, in
step (`hit_pages`). Nothing goes through the leader's host.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as PS

from dualpath_jax.config import ModelConfig
from dualpath_jax.model import sharding
from dualpath_jax.model.cached_kv import DevicePages, bytes_to_pages
from dualpath_jax.transfer.channel import KVChannel, make_uuid

# Key of process r's KV channel address in its engine group's key-value store.
KV_ADDRESS_KEY = "dualpath/span/kv/{rank}"
_PE_SPLIT, _DE_SPLIT = 5, 6  # the `part` of a piece's uuid (after loader.Part's)


def piece_uuid(request_id: str, attempt: int, chunk: int, layer: int, piece: int) -> int:
    """The uuid of column piece `piece` of layer `layer` of a request's output chunk `chunk`."""
    return make_uuid(
        request_id, layer, _PE_SPLIT * 100_000_000 + chunk * 1_000 + piece, epoch=attempt
    )


def hit_piece_uuid(
    request_id: str, attempt: int, layer: int, piece: int, process: int, kind: str = "de"
) -> int:
    """The uuid of column piece `piece` of layer `layer` of a request's hit, as offered to
    process `process` of the PE: its DE-read blocks (`kind` "de", from the DE) or its PE-read
    ones ("pe", from the PE's leader, whose buffer they were read into)."""
    part = _DE_SPLIT * 100_000_000 + (kind == "pe") * 10_000_000 + process * 1_000 + piece
    return make_uuid(request_id, layer, part, epoch=attempt)


@dataclasses.dataclass(frozen=True)
class HitPieces:
    """One layer of a request's hit (DE-read or PE-read) as one process of a spanning PE holds
    it: `arrays[j]`, the bytes `[n, bt, width / pieces]` of column piece j on the first of its
    devices that holds j, for the pieces its devices hold; `blocks` of the `n` are real. `meta`
    names the offers (`hit_meta`), so that the other processes pull theirs."""

    arrays: dict[int, jax.Array]
    blocks: int
    meta: dict


@dataclasses.dataclass(frozen=True)
class SpanPages(DevicePages):
    """A hit layer as pages over a mesh that spans processes (`RowOffers.hit_pages`): the
    followers are told `meta`, not sent the rows."""

    meta: dict = dataclasses.field(default_factory=dict)


def hit_meta(
    address: str, request_id: str, attempt: int, layer: int, n: int, blocks: int, kind: str = "de"
) -> dict:
    """What a process needs to pull its pieces of a hit layer: where, which (`kind`, as
    `hit_piece_uuid`), how many blocks (`n` offered, the first `blocks` real)."""
    return {
        "address": address, "request": request_id, "attempt": attempt, "layer": layer, "n": n,
        "blocks": blocks, "kind": kind,
    }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RowOffers:
    """A spanning PE's new rows as `pieces` column pieces: `split` lays a request's rows as
    bytes `[N, bytes]` over the mesh, piece j is offered by the process holding `homes[j]`
    (a device), at `addresses[j]` (known to the leader; empty in a follower). `holders[j]`: the
    processes whose devices hold piece j (each pulls it of a DE-read hit)."""

    split: NamedSharding
    homes: tuple[jax.Device, ...]
    addresses: tuple[str, ...] = ()
    holders: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def for_mesh(
        cls, cfg: ModelConfig, mesh: Mesh, addresses: Mapping[int, str] | None = None
    ) -> RowOffers:
        """The offers of an engine with model `cfg` on `mesh`; `addresses`: each process's KV
        channel address by process index (the leader's view)."""
        spec = sharding.kv_rows_sharding(cfg, mesh, (1, 1, cfg.kv_width)).spec
        axis = spec[2] if len(spec) > 2 else None
        split = NamedSharding(mesh, PS(None, axis))
        n = mesh.shape[axis] if axis else 1
        index = split.devices_indices_map((1, n))
        homes: dict[int, jax.Device] = {}
        holders: dict[int, set[int]] = {}
        for dev in mesh.devices.flat:
            homes.setdefault(index[dev][1].start or 0, dev)
            holders.setdefault(index[dev][1].start or 0, set()).add(dev.process_index)
        devices = tuple(homes[j] for j in range(n))
        where = () if addresses is None else tuple(addresses[d.process_index] for d in devices)
        return cls(split, devices, where, tuple(tuple(sorted(holders[j])) for j in range(n)))

    @property
    def pieces(self) -> int:
        return len(self.homes)

    @property
    def page_split(self) -> NamedSharding:
        """A hit layer's bytes `[n, bt, bytes]` split as the rows are (by columns)."""
        return NamedSharding(self.split.mesh, PS(None, None, self.split.spec[1]))

    def pull_hit(
        self,
        channel: KVChannel,
        meta: dict,
        bt: int,
        width: int,
        timeout_s: float,
        abort: threading.Event | None = None,
    ) -> dict[int, jax.Array]:
        """Pulls the pieces of hit layer `meta` this process's devices hold, each onto the first
        of them: piece j -> bytes `[n, bt, width / pieces]`."""
        me, w = jax.process_index(), width // self.pieces
        out = {}
        for j, dev in sorted(self.first_local().items()):
            spec = jax.ShapeDtypeStruct(
                (meta["n"], bt, w), np.uint8, sharding=SingleDeviceSharding(dev)
            )
            uuid = hit_piece_uuid(
                meta["request"], meta["attempt"], meta["layer"], j, me, meta["kind"]
            )
            (out[j],) = channel.pull(meta["address"], uuid, [spec], timeout_s, abort=abort)
        return out

    def first_local(self) -> dict[int, jax.Device]:
        """Piece j -> the first device of this process (mesh order) that holds it."""
        index = self.split.devices_indices_map((1, self.pieces))
        first: dict[int, jax.Device] = {}
        for dev in self.split.mesh.devices.flat:
            if dev.process_index == jax.process_index():
                first.setdefault(index[dev][1].start or 0, dev)
        return first

    def share_hit(
        self, channel: KVChannel, meta: dict, pieces: list[jax.Array]
    ) -> dict[int, jax.Array]:
        """The leader's side of its own (PE-read) hit layer: each column piece offered to the
        other processes that hold it (`kind` "pe"), and this process's pieces placed on its
        first devices holding them (what `pull_hit` gives the others)."""
        me = jax.process_index()
        for j, ranks in enumerate(self.holders):
            for rank in ranks:
                if rank != me:
                    uuid = hit_piece_uuid(
                        meta["request"], meta["attempt"], meta["layer"], j, rank, "pe"
                    )
                    channel.offer(uuid, [pieces[j]])
        return {j: jax.device_put(pieces[j], dev) for j, dev in self.first_local().items()}

    def hit_pages(self, hit: HitPieces, kv_width: int, kv_dtype: str) -> SpanPages:
        """The pages `[n, bt, W]` (KV dtype) over the mesh of a hit layer whose pieces each
        process pulled (every process calls it, in the same order)."""
        piece_shape = next(iter(hit.arrays.values())).shape
        arr = sharding.join_column_pieces(hit.arrays, piece_shape, self.pieces, self.page_split)
        pages = bytes_to_pages(arr, piece_shape[1], kv_width, kv_dtype)
        return SpanPages(pages, hit.blocks, hit.meta)

    def offer(
        self, channel: KVChannel, request_id: str, attempt: int, chunk: int, layer: int, x
    ) -> int:
        """Offers the pieces of `x` (a request's rows as bytes, laid out by `split`) this
        process is home for; returns how many."""
        mine = {s.device: s.data for s in x.addressable_shards}
        n = 0
        for j, dev in enumerate(self.homes):
            if dev in mine:
                channel.offer(piece_uuid(request_id, attempt, chunk, layer, j), [mine[dev]])
                n += 1
        return n
