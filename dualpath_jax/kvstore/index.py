"""In-process bookkeeping of a block store: sizes, LRU order, pins and trajectory owners.

`BlockIndex` holds no I/O; the store asks it which keys to admit, evict or delete and performs
the deletions. It is this process's view: blocks written by another process on a shared root join
it when this process sees them (a lookup or read hit). All methods are atomic (one lock).

Lifecycle of a key: admitted (bytes reserved before the write) -> touched by lookups and reads
(LRU) -> evicted (capacity), deleted, or released with its last owner. A pinned key is never
evicted, and a delete or release of a pinned key is deferred to its last unpin ("doomed"), which
remembers why it was doomed (`dualpath_jax.kv_events.REMOVAL_REASONS`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable


class BlockIndex:
    """LRU index of stored Full Blocks with pin counts and per-trajectory ownership.

    `capacity_bytes == 0` means unlimited. Sizes are encoded block sizes in bytes.
    """

    def __init__(self, capacity_bytes: int = 0):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # oldest first
        self._used = 0
        self._pins: collections.Counter[str] = collections.Counter()
        self._doomed: dict[str, str] = {}  # pinned key -> why it goes at its last unpin
        self._owners: dict[str, set[str]] = {}
        self._owned: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ queries

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def blocks(self) -> int:
        return len(self._lru)

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def pinned(self, key: str) -> bool:
        return self._pins[key] > 0

    @property
    def pinned_count(self) -> int:
        with self._lock:
            return sum(1 for c in self._pins.values() if c > 0)

    def owned_by(self, owner: str) -> set[str]:
        with self._lock:
            return set(self._owned.get(owner, ()))

    def lru_order(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._lru)

    # ------------------------------------------------------------------ updates

    def touch(self, keys: Iterable[str], nbytes: int) -> None:
        """Marks `keys` (a chain, prefix first) as used; unknown keys join with size `nbytes`.

        Keys are touched back to front so a chain's prefix ends most recently used: eviction then
        takes the tail of a chain first, which keeps the surviving prefix useful.
        """
        with self._lock:
            for key in reversed(list(keys)):
                if key in self._lru:
                    self._lru.move_to_end(key)
                else:
                    self._lru[key] = nbytes
                    self._used += nbytes

    def admit(self, keys: list[str], nbytes: int) -> tuple[list[str], list[str]]:
        """Reserves room for new blocks `keys` (chain order), evicting unpinned LRU blocks.

        Returns `(admitted, evicted)`: `admitted` is the longest prefix of the keys not yet
        indexed that fits (the caller writes them, and calls `remove` for any write that
        fails); `evicted` are keys already dropped from the index that the caller must delete.
        """
        with self._lock:
            new = [k for k in dict.fromkeys(keys) if k not in self._lru]
            admitted: list[str] = []
            evicted: list[str] = []
            victims = (k for k in list(self._lru) if self._pins[k] == 0)
            # Blocks found on a shared root (`touch`) may have pushed usage over the limit.
            while self.capacity_bytes and self._used > self.capacity_bytes:
                victim = next(victims, None)
                if victim is None:
                    break
                self._drop(victim)
                evicted.append(victim)
            for key in new:
                if self.capacity_bytes:
                    while self._used + nbytes > self.capacity_bytes:
                        victim = next(victims, None)
                        if victim is None:
                            break
                        self._drop(victim)
                        evicted.append(victim)
                    if self._used + nbytes > self.capacity_bytes:
                        break
                self._lru[key] = nbytes
                self._used += nbytes
                admitted.append(key)
            # `victims` is lazy over a snapshot; a just-admitted key is never in it. Like `touch`,
            # the chain's prefix ends most recently used.
            for key in reversed(admitted):
                self._lru.move_to_end(key)
            return admitted, evicted

    def remove(self, keys: Iterable[str]) -> None:
        """Forgets keys (deleted, failed writes, found missing or corrupt)."""
        with self._lock:
            for key in keys:
                self._drop(key)

    def pin(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._pins[key] += 1

    def unpin(self, keys: Iterable[str]) -> list[str]:
        """Drops one pin per key; returns doomed keys whose last pin went (delete them now)."""
        return [key for key, _ in self.unpin_doomed(keys)]

    def unpin_doomed(self, keys: Iterable[str]) -> list[tuple[str, str]]:
        """`unpin`, each returned key with the reason it was doomed for (`doom`'s `reason`)."""
        ready = []
        with self._lock:
            for key in keys:
                if self._pins[key] <= 0:
                    raise ValueError(f"unpin of block {key} that is not pinned")
                self._pins[key] -= 1
                if self._pins[key] == 0:
                    del self._pins[key]
                    if key in self._doomed:
                        reason = self._doomed.pop(key)
                        self._drop(key)
                        ready.append((key, reason))
        return ready

    def doom(self, keys: Iterable[str], reason: str = "deleted") -> list[str]:
        """Schedules deletion: returns the unpinned keys (delete now); pinned ones wait, with
        `reason`, for their last unpin."""
        ready = []
        with self._lock:
            for key in dict.fromkeys(keys):
                if self._pins[key] > 0:
                    self._doomed.setdefault(key, reason)
                else:
                    self._drop(key)
                    ready.append(key)
        return ready

    def claim(self, owner: str, keys: Iterable[str]) -> None:
        """Records that trajectory `owner` uses `keys` (it wrote them or reads them)."""
        with self._lock:
            mine = self._owned.setdefault(owner, set())
            for key in keys:
                mine.add(key)
                self._owners.setdefault(key, set()).add(owner)

    def release(self, owner: str) -> list[str]:
        """Ends trajectory `owner`: keys no other owner claims are doomed. Returns keys to delete
        now (pinned ones are deleted at their last unpin)."""
        with self._lock:
            keys = self._owned.pop(owner, set())
            orphans = []
            for key in keys:
                owners = self._owners.get(key)
                if owners is None:
                    continue
                owners.discard(owner)
                if not owners:
                    del self._owners[key]
                    orphans.append(key)
        return self.doom(orphans, "released")

    def _drop(self, key: str) -> None:
        nbytes = self._lru.pop(key, None)
        if nbytes is not None:
            self._used -= nbytes
        for owner in self._owners.pop(key, ()):
            self._owned.get(owner, set()).discard(key)
