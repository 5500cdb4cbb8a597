"""The BlockStore interface and its value objects (results, stats, errors).

A BlockStore keeps Full Blocks under hash-chain keys (`identity.block_keys`). Every operation
takes a batch of keys in chain order (prefix first) and returns a `concurrent.futures.Future`, so
an engine overlaps storage I/O with compute; implementations: `store.TensorStoreBlockStore`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from concurrent import futures

import numpy as np

from dualpath_jax.kvstore.codec import BlockFormat


class StoreError(RuntimeError):
    """A block store operation failed (I/O error, timeout); the message names the key."""


class StoreUnavailable(StoreError):
    """The store cannot be used at all (root missing and not creatable, not a directory, ...)."""


@dataclasses.dataclass(frozen=True)
class BlockReadResult:
    """Outcome of a batched read: blocks `[0, hits)` were read and verified.

    `blocks[i]` is `[n_layers_read, block_tokens, bytes]` uint8 (a view into the caller's `out`,
    or a read-only view of the fetched bytes). Keys `[hits:]` are misses; `miss_reason` says why
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
    """

    fmt: BlockFormat

    @abc.abstractmethod
    def lookup(self, keys: Sequence[str]) -> futures.Future[int]:
        """Number of leading keys stored (the prefix hit), checking headers only."""

    @abc.abstractmethod
    def read_full(
        self, keys: Sequence[str], out: np.ndarray | Sequence[np.ndarray] | None = None
    ) -> futures.Future[BlockReadResult]:
        """Reads Full Blocks `[n_layers, bt, bytes]`; `out[i]` receives block i when given."""

    @abc.abstractmethod
    def read_layers(
        self,
        keys: Sequence[str],
        layers: tuple[int, int],
        out: np.ndarray | Sequence[np.ndarray] | None = None,
    ) -> futures.Future[BlockReadResult]:
        """Reads the Layer Blocks `[start, stop)` of each block by byte range."""

    @abc.abstractmethod
    def write_full(
        self,
        keys: Sequence[str],
        blocks: np.ndarray | Sequence[np.ndarray],
        owner: str | None = None,
    ) -> futures.Future[WriteReport]:
        """Stores Full Blocks `[n, n_layers, bt, bytes]`; idempotent per key; `owner` claims them."""

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
