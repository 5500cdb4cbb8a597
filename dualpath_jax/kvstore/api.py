"""The BlockStore interface and its value objects (read destinations, results, stats, errors).

A BlockStore keeps Full Blocks under hash-chain keys (`identity.block_keys`). Every operation
takes a batch of keys in chain order (prefix first) and returns a `concurrent.futures.Future`, so
an engine overlaps storage I/O with compute; implementations: `store.TensorStoreBlockStore`
(and `testing.faulty.FaultyStore`, which wraps one).

A read says where its blocks land: a `ReadDestination`. `HostDestination` is numpy arrays (or
none: the store makes them); `PinnedDestination` is slots of a PE/DE buffer reservation in
`pinned_host` memory (`buffers.HostBufferPool`), read in place, so the bytes sit where
`BufferReservation.layer_pages` copies them to the device from; `DeviceDestination` is device
pages, for a device-direct (GPUDirect-like) backend. Each store says which kinds it reads into
(`BlockStore.read_destinations`) and refuses the others at the call (`UnsupportedDestination`).

The public read and write methods live on `BlockStore` alone: they check their arguments
(keys, layer range, destination kind and shapes, block shapes) and hand an implementation a
checked `BlockRead` (`_submit_read`) or checked blocks (`_submit_write`), so every store takes
the same arguments and reports the same argument errors.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import ClassVar

import jax
import numpy as np

from dualpath_jax.kvstore.buffers import BufferReservation
from dualpath_jax.kvstore.codec import BlockFormat
from dualpath_jax.kvstore.identity import check_key
from dualpath_jax.model.layout import BlockLayout


class StoreError(RuntimeError):
    """A block store operation failed (I/O error, timeout); the message names the key."""


class StoreUnavailable(StoreError):
    """The store cannot be used at all (root missing and not creatable, not a directory, ...)."""


class UnsupportedDestination(NotImplementedError):
    """A read asked a store for a destination kind it does not read into (not in its
    `read_destinations`); raised at the call, before any I/O."""


class DestinationKind(enum.Enum):
    """Where a store read lands."""

    HOST = "host"  # numpy arrays
    PINNED = "pinned"  # slots of a pinned_host buffer reservation (the PE or DE buffer)
    DEVICE = "device"  # device pages


@dataclasses.dataclass(frozen=True, eq=False)
class HostDestination:
    """Host numpy arrays: block i lands in `arrays[i]`, writable uint8, either the layers read
    `[stop - start, block_tokens, bytes]` or a whole Full Block `[n_layers, block_tokens, bytes]`
    whose layers `[start, stop)` the read fills (leaving the others as they are); a stacked array
    `[n, ...]` gives one per block. None: the store makes the arrays (or hands out read-only
    views of the bytes it fetched)."""

    arrays: np.ndarray | Sequence[np.ndarray] | None = None
    kind: ClassVar[DestinationKind] = DestinationKind.HOST

    def resolve(
        self, n: int, layers: tuple[int, int], layout: BlockLayout
    ) -> list[np.ndarray] | None:
        """The arrays blocks `[0, n)` of a read of `layers` land in (None: the store makes
        them); ValueError when there are fewer or one is not writable uint8 of either shape."""
        if self.arrays is None:
            return None
        if len(self.arrays) < n:
            raise ValueError(f"the destination holds {len(self.arrays)} blocks, {n} keys given")
        start, stop = layers
        shape = (stop - start, layout.block_tokens, layout.bytes_per_token_per_layer)
        out = []
        for i in range(n):
            o = self.arrays[i]
            if o.dtype != np.uint8 or not o.flags.writeable or o.shape not in (shape, layout.shape):
                raise ValueError(
                    f"destination blocks must be writable uint8 {shape} or {layout.shape}, got "
                    f"{o.dtype} {o.shape}" + ("" if o.flags.writeable else " (read-only)")
                )
            out.append(o if o.shape == shape else o[start:stop])
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class PinnedDestination:
    """Slots of a host buffer reservation in `pinned_host` memory (the PE or DE buffer,
    `buffers.BufferReservation`): block i lands in reserved block `first + i`; a read of layers
    `[start, stop)` fills those layers of it and leaves the slot's others as they are. The slots
    are writable numpy views of the pool's pinned slab, so a store that reads into host memory
    reads into them in place. The reservation must stay held until the read resolves."""

    reservation: BufferReservation
    first: int = 0
    kind: ClassVar[DestinationKind] = DestinationKind.PINNED

    def __post_init__(self) -> None:
        if not self.reservation.pinned:
            raise ValueError(
                f"reservation of {self.reservation.owner!r} is in a pageable buffer, not "
                "pinned_host memory: read into buffer_destination(reservation) instead"
            )

    def resolve(self, n: int, layers: tuple[int, int], layout: BlockLayout) -> list[np.ndarray]:
        """Views of the slots blocks `[0, n)` of a read of `layers` land in; ValueError when the
        reservation holds too few blocks after `first` or blocks of another layout."""
        res = self.reservation
        if not 0 <= self.first <= self.first + n <= len(res):
            raise ValueError(
                f"blocks [{self.first}, {self.first + n}) of a reservation of {len(res)}"
            )
        if res.layout.shape != layout.shape:
            raise ValueError(
                f"the buffer holds blocks {res.layout.shape}, the store {layout.shape}"
            )
        start, stop = layers
        return [res.block(self.first + i)[start:stop] for i in range(n)]


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceDestination:
    """Device pages: block i's Layer Blocks land in page `page_ids[i]` of `pages` `[n_layers,
    n_pages, block_tokens, bytes]` uint8 on one device (a read of layers `[start, stop)` fills
    `pages[start:stop, page_ids[i]]`), for a backend that reads storage straight into device
    memory (GPUDirect-like). JAX arrays are immutable, so such a backend donates `pages` and
    hands the written array back. No store here reads into device memory: each refuses it."""

    pages: jax.Array
    page_ids: tuple[int, ...]
    kind: ClassVar[DestinationKind] = DestinationKind.DEVICE

    def __post_init__(self) -> None:
        if self.pages.ndim != 4 or self.pages.dtype != np.uint8:
            raise ValueError(
                f"device pages must be uint8 [n_layers, n_pages, block_tokens, bytes], got "
                f"{self.pages.dtype} {self.pages.shape}"
            )
        bad = [p for p in self.page_ids if not 0 <= p < self.pages.shape[1]]
        if bad:
            raise ValueError(f"page ids {bad} are not pages of {self.pages.shape[1]}")

    def resolve(self, n: int, layers: tuple[int, int], layout: BlockLayout) -> None:
        """Checks the pages against a read of `n` blocks' `layers` (no host views: None)."""
        if len(self.page_ids) < n:
            raise ValueError(f"the destination names {len(self.page_ids)} pages, {n} keys given")
        pages = self.pages.shape
        if (pages[0], *pages[2:]) != layout.shape:
            raise ValueError(f"device pages {pages} do not hold blocks {layout.shape}")


ReadDestination = HostDestination | PinnedDestination | DeviceDestination


def buffer_destination(
    reservation: BufferReservation, first: int = 0
) -> PinnedDestination | HostDestination:
    """Reserved blocks `[first, ...)` of a PE/DE buffer as a read destination: its pinned slots,
    or, in a pageable buffer (a device without pinned_host memory), the same slots as host
    arrays; either way block i lands in reserved block `first + i` (a layer read in its layers)."""
    if reservation.pinned:
        return PinnedDestination(reservation, first)
    return HostDestination(reservation.blocks()[first:])


@dataclasses.dataclass(frozen=True, eq=False)
class BlockRead:
    """One checked batched read, what a store's `_submit_read` receives: `keys` (valid, chain
    order), `layers` (`(start, stop)` of a Layer Block read, None: Full Blocks), `dest`, and
    `out`: block i's writable host view `[n_layers_read, block_tokens, bytes]` uint8 for a host
    or pinned destination with arrays (None: the store makes the arrays, or `dest` is not host
    memory)."""

    keys: list[str]
    layers: tuple[int, int] | None
    dest: ReadDestination
    out: list[np.ndarray] | None


@dataclasses.dataclass(frozen=True)
class BlockReadResult:
    """Outcome of a batched read: blocks `[0, hits)` were read and verified.

    `blocks[i]` is `[n_layers_read, block_tokens, bytes]` uint8 (the array or slot the read's
    destination named for it, or a read-only view of the fetched bytes). Keys `[hits:]` are misses; `miss_reason` says why
    the first of them missed ("" when every key hit).
    """

    hits: int
    blocks: tuple[np.ndarray, ...]
    miss_reason: str = ""

    def stack(self) -> np.ndarray:
        """The hit blocks as one `[hits, n_layers_read, block_tokens, bytes]` array (a copy)."""
        return np.stack(self.blocks) if self.blocks else np.zeros((0, 0, 0, 0), np.uint8)


@dataclasses.dataclass(frozen=True)
class WriteReport:
    """Outcome of `write_full`: each key was written, already stored, or rejected (no room)."""

    written: int
    existed: int
    rejected: int


@dataclasses.dataclass(frozen=True)
class StoreStats:
    """Counters of one store instance (this process's view)."""

    blocks: int
    bytes: int
    capacity_bytes: int
    pinned: int
    lookups: int
    lookup_hits: int
    reads: int
    layer_reads: int
    read_bytes: int
    writes: int
    write_bytes: int
    write_existed: int
    write_rejected: int
    deletes: int
    evictions: int
    misses: int
    checksum_failures: int
    retained: int = 0  # stored blocks some retained session holds (index.py)


class BlockStore(abc.ABC):
    """Storage of Full Blocks under hash-chain keys. Every batch is in chain order.

    Lifecycle: open -> (lookup / read / write / delete / pin ...)* -> close. A store is used from
    any thread; each returned future completes on the store's I/O threads.

    An implementation sets `fmt` and `read_destinations` and implements the abstract methods;
    `read_full`, `read_layers` and `write_full` check their arguments here and call its
    `_submit_read` / `_submit_write`.
    """

    fmt: BlockFormat
    # The destination kinds this store reads into; a read into another raises
    # UnsupportedDestination at the call.
    read_destinations: frozenset[DestinationKind]

    @abc.abstractmethod
    def lookup(self, keys: Sequence[str]) -> futures.Future[int]:
        """Number of leading keys stored (the prefix hit), checking headers only."""

    def read_full(
        self, keys: Sequence[str], dest: ReadDestination | None = None
    ) -> futures.Future[BlockReadResult]:
        """Reads Full Blocks `[n_layers, bt, bytes]` into `dest` (None: new host arrays)."""
        return self._submit_read(self._check_read(keys, None, dest))

    def read_layers(
        self, keys: Sequence[str], layers: tuple[int, int], dest: ReadDestination | None = None
    ) -> futures.Future[BlockReadResult]:
        """Reads the Layer Blocks `[start, stop)` of each block by byte range into `dest`
        (None: new host arrays `[stop - start, bt, bytes]`)."""
        start, stop = layers
        self.fmt.layer_byte_range(start, stop)  # IndexError for a range outside the block
        return self._submit_read(self._check_read(keys, (start, stop), dest))

    def _check_read(
        self, keys: Sequence[str], layers: tuple[int, int] | None, dest: ReadDestination | None
    ) -> BlockRead:
        keys = [check_key(k) for k in keys]
        dest = HostDestination() if dest is None else dest
        if dest.kind not in self.read_destinations:
            have = ", ".join(sorted(k.value for k in self.read_destinations))
            raise UnsupportedDestination(
                f"{dest.kind.value} destinations are not supported by this store "
                f"({type(self).__name__} reads into: {have})"
            )
        span = (0, self.fmt.layout.num_layers) if layers is None else layers
        return BlockRead(keys, layers, dest, dest.resolve(len(keys), span, self.fmt.layout))

    @abc.abstractmethod
    def _submit_read(self, read: BlockRead) -> futures.Future[BlockReadResult]:
        """Starts a checked read (`read_full`, `read_layers`); resolves to its result, whose
        `blocks[i]` is `read.out[i]` when given."""

    def write_full(
        self,
        keys: Sequence[str],
        blocks: np.ndarray | Sequence[np.ndarray],
        owner: str | None = None,
    ) -> futures.Future[WriteReport]:
        """Stores Full Blocks `[n, n_layers, bt, bytes]`; idempotent per key; `owner` claims them."""
        keys = [check_key(k) for k in keys]
        if len(blocks) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        shape = self.fmt.layout.shape
        for b in blocks:
            if b.shape != shape or b.dtype != np.uint8:
                raise ValueError(f"Full Blocks must be uint8 {shape}, got {b.dtype} {b.shape}")
        return self._submit_write(keys, blocks, owner)

    @abc.abstractmethod
    def _submit_write(
        self, keys: list[str], blocks: np.ndarray | Sequence[np.ndarray], owner: str | None
    ) -> futures.Future[WriteReport]:
        """Starts a checked `write_full`; `owner` claims the keys at the call, whatever the
        write's outcome."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> futures.Future[int]:
        """Deletes blocks (pinned ones at their last unpin); resolves to the number deleted now."""

    @abc.abstractmethod
    def pin(self, keys: Sequence[str]) -> None:
        """Protects blocks from eviction and deletion until the matching `unpin`."""

    @abc.abstractmethod
    def unpin(self, keys: Sequence[str]) -> futures.Future[int]:
        """Drops one pin per key; deferred deletions run now (resolves to their count)."""

    @abc.abstractmethod
    def claim(self, owner: str, keys: Sequence[str]) -> None:
        """Records that trajectory `owner` uses `keys`, so `release(owner)` considers them."""

    @abc.abstractmethod
    def release(self, owner: str) -> futures.Future[int]:
        """Ends trajectory `owner`: deletes the blocks no other live trajectory claims."""

    @abc.abstractmethod
    def disown(self, owner: str) -> None:
        """Forgets trajectory `owner` (its claims and retention) and keeps its blocks: a session
        closed without release, or expired."""

    @abc.abstractmethod
    def retain(self, owner: str, state: str, priority: int = 0, ttl_s: float = 0.0) -> None:
        """Session retention of trajectory `owner`'s claimed blocks (`index.BlockIndex.retain`):
        `"active"` while a round runs, `"idle"` for `ttl_s` seconds after it, `"ended"`."""

    @abc.abstractmethod
    def stats(self) -> StoreStats: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[str]) -> Iterator[None]:
        """Pins `keys` for the duration of a `with` block (an in-flight request's hit blocks);
        deletions deferred by the pins are done when the block exits."""
        keys = list(keys)
        self.pin(keys)
        try:
            yield
        finally:
            self.unpin(keys).result()

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
