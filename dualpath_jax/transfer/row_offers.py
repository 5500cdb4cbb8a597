"""`RowOffers`: how a prefill engine spanning several processes sends a layer's new KV rows to
the DE: each column piece (whole KV heads) from the process whose device computed it, over that
process's own KV channel, instead of gathered over the mesh onto the leader and sent from its
host.

Every process of the engine runs the same forward (engine/span.py). After each layer each takes
every request's rows as bytes split by columns over the engine's mesh (`RowOffers.split`, one
program every process runs in the same order, no collective when the rows already split so) and
offers the pieces it is home for: piece j's home is the process of the first device, in mesh
order, that holds columns j. The DE learns where each piece is offered from the PE's
registration (`RowOffers.addresses`, carried in `LoadJob.pe_piece_addresses`) and pulls piece j
of chunk k, layer i, under `piece_uuid`; the chunk's meta (from the leader) says how many pieces
there are. Rows that do not split by columns (MLA's one latent head) are one piece, the leader's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from dualpath_jax.config import ModelConfig
from dualpath_jax.model import sharding
from dualpath_jax.transfer.channel import KVChannel, make_uuid

# Key of process r's KV channel address in its engine group's key-value store.
KV_ADDRESS_KEY = "dualpath/span/kv/{rank}"
_PE_SPLIT = 5  # the `part` of a piece's uuid (after loader.Part's)


def piece_uuid(request_id: str, attempt: int, chunk: int, layer: int, piece: int) -> int:
    """The uuid of column piece `piece` of layer `layer` of a request's output chunk `chunk`."""
    return make_uuid(
        request_id, layer, _PE_SPLIT * 100_000_000 + chunk * 1_000 + piece, epoch=attempt
    )


@dataclasses.dataclass(frozen=True)
class RowOffers:
    """A spanning PE's new rows as `pieces` column pieces: `split` lays a request's rows as
    bytes `[N, bytes]` over the mesh, piece j is offered by the process holding `homes[j]`
    (a device), at `addresses[j]` (known to the leader; empty in a follower)."""

    split: NamedSharding
    homes: tuple[jax.Device, ...]
    addresses: tuple[str, ...] = ()

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
        for dev in mesh.devices.flat:
            homes.setdefault(index[dev][1].start or 0, dev)
        devices = tuple(homes[j] for j in range(n))
        where = () if addresses is None else tuple(addresses[d.process_index] for d in devices)
        return cls(split, devices, where)

    @property
    def pieces(self) -> int:
        return len(self.homes)

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
