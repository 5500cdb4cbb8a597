"""In-process bookkeeping of a block store: sizes, eviction order, pins, owners and retention.

`BlockIndex` holds no I/O; the store asks it which keys to admit, evict or delete and performs
the deletions. It is this process's view: blocks written by another process on a shared root join
it when this process sees them (a lookup or read hit). All methods are atomic (one lock).

Keys that joined by being seen (`touch`), not written here (`admit`) nor found at open, are
*seen* keys: blocks another process wrote and enforces its capacity on. Past `capacity_bytes`,
the least recently used seen keys leave the view (forgotten: nothing is deleted, and their claims,
pins and retention stay); a later hit brings them back. So a process that only reads a shared
store (the router's lookups, a prefill engine's reads) remembers at most its capacity's worth of
blocks, not every block it ever found.

Lifecycle of a key: admitted (bytes reserved before the write) -> touched by lookups and reads
(LRU) -> evicted (capacity), deleted, or released with its last owner. A pinned key is never
evicted, and a delete or release of a pinned key is deferred to its last unpin ("doomed"), which
remembers why it was doomed (`dualpath_jax.kv_events.REMOVAL_REASONS`).

Session retention (`policy="retention"`, docs/kv_events.md "Session retention"): an owner (a
trajectory, i.e. a router session) is *retained* while one of its rounds runs (`retain(owner,
"active")`) and for `ttl_s` after it (`"idle"`, the gap of a tool call); `"ended"` ends that at
once. The keys any retained owner claims are evicted only when no other unpinned key is left, and
then owner by owner: lowest `priority` first, an idle owner's before an active one's, the owner
least recently active first, each owner's chain from its tail.
All other keys (no owner retained: ended, expired, never told) go before them, least recently
used first. So an ended trajectory's blocks, or those of one whose tool call outlasted its TTL,
leave before those of a trajectory still in its tool call, however recently they were used. With
`policy="lru"` `retain` does nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator

POLICIES = ("lru", "retention")
RETAIN_STATES = ("active", "idle", "ended")


@dataclasses.dataclass
class Retention:
    """An owner's retention: `priority` (higher stays longer), a round running (`active`), or
    retained until `until` (the clock's seconds) after its last round."""

    priority: int = 0
    active: bool = False
    until: float = -math.inf
    stamp: int = 0  # when it was last told anything (a counter of `retain` calls)

    def retained(self, now: float) -> bool:
        return self.active or now < self.until

    @property
    def rank(self) -> tuple[int, bool, int]:
        """Eviction order among retained owners: lowest first."""
        return (self.priority, self.active, self.stamp)


class BlockIndex:
    """Index of stored Full Blocks: eviction order, pin counts, per-trajectory ownership and
    session retention (module docstring).

    `capacity_bytes == 0` means unlimited. Sizes are encoded block sizes in bytes. `clock` gives
    the seconds retention TTLs count in (the simulator passes its own).
    """

    def __init__(
        self,
        capacity_bytes: int = 0,
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.clock = clock
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # oldest first
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()  # ditto
        self._used = 0
        self._pins: collections.Counter[str] = collections.Counter()
        self._doomed: dict[str, str] = {}  # pinned key -> why it goes at its last unpin
        self._owners: dict[str, set[str]] = {}
        self._owned: dict[str, dict[str, None]] = {}  # owner -> its keys in claim order
        # Retention: each key's last use (a counter), a heap of (last use, key) over the unheld
        # keys (entries whose key was used again, held or dropped since are skipped), how many
        # retained owners hold each held key, each owner's retention, and the TTLs to expire.
        self._tick = 0
        self._used_at: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self._held: collections.Counter[str] = collections.Counter()
        self._retention: dict[str, Retention] = {}
        self._retained: set[str] = set()
        self._expiry: list[tuple[float, str]] = []
        self._stamp = 0

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

    @property
    def retained_count(self) -> int:
        """Stored keys that some retained owner holds (as of the last expiry check)."""
        with self._lock:
            self._expire(self.clock())
            return sum(1 for k in self._held if k in self._lru)

    def retained(self, owner: str) -> bool:
        with self._lock:
            self._expire(self.clock())
            return owner in self._retained

    def owned_by(self, owner: str) -> set[str]:
        with self._lock:
            return set(self._owned.get(owner, ()))

    def lru_order(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._lru)

    def eviction_order(self) -> list[str]:
        """Unpinned keys in the order `admit` would evict them now."""
        with self._lock:
            self._expire(self.clock())
            free = sorted(
                (k for k in self._lru if not self._held[k] and self._pins[k] == 0),
                key=self._used_at.__getitem__,
            )
            return free + list(dict.fromkeys(self._held_victims(set())))

    def prefix(self, keys: Iterable[str]) -> int:
        """How many leading `keys` are indexed (no touch)."""
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._lru:
                    break
                n += 1
        return n

    # ------------------------------------------------------------------ updates

    def touch(self, keys: Iterable[str], nbytes: int, *, found: bool = False) -> None:
        """Marks `keys` (a chain, prefix first) as used; unknown keys join with size `nbytes`,
        as seen keys (module docstring: past capacity the least recently used seen keys are
        forgotten), or with `found` (keys listed when the store opens) as if written here.

        Keys are touched back to front so a chain's prefix ends most recently used: eviction then
        takes the tail of a chain first, which keeps the surviving prefix useful.
        """
        with self._lock:
            for key in reversed(list(keys)):
                if key in self._lru:
                    self._lru.move_to_end(key)
                    if key in self._seen:
                        self._seen.move_to_end(key)
                    self._use(key)
                else:
                    self._add(key, nbytes)
                    if not found:
                        self._seen[key] = None
            while self.capacity_bytes and self._used > self.capacity_bytes and self._seen:
                self._forget(next(iter(self._seen)))

    def admit(self, keys: list[str], nbytes: int) -> tuple[list[str], list[str]]:
        """Reserves room for new blocks `keys` (chain order), evicting unpinned blocks in
        eviction order (module docstring).

        Returns `(admitted, evicted)`: `admitted` is the longest prefix of the keys not yet
        indexed that fits (the caller writes them, and calls `remove` for any write that
        fails); `evicted` are keys already dropped from the index that the caller must delete.
        """
        with self._lock:
            self._expire(self.clock())
            new = [k for k in dict.fromkeys(keys) if k not in self._lru]
            admitted: list[str] = []
            evicted: list[str] = []
            admitted_set: set[str] = set()  # never a victim of its own batch
            victims = self._victims(admitted_set)
            # Keys found at open (`touch(found=True)`) may have pushed usage over the limit.
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
                self._add(key, nbytes)
                admitted.append(key)
                admitted_set.add(key)
            victims.close()  # puts the keys it set aside back, under the lock
            # Like `touch`, the chain's prefix ends most recently used.
            for key in reversed(admitted):
                self._lru.move_to_end(key)
                self._use(key)
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
            mine = self._owned.setdefault(owner, {})
            held = owner in self._retained
            for key in keys:
                if key in mine:
                    continue
                mine[key] = None
                self._owners.setdefault(key, set()).add(owner)
                if held:
                    self._hold(key)

    def release(self, owner: str) -> list[str]:
        """Ends trajectory `owner`: keys no other owner claims are doomed. Returns keys to delete
        now (pinned ones are deleted at their last unpin)."""
        return self.doom(self._forget_owner(owner), "released")

    def disown(self, owner: str) -> None:
        """Forgets trajectory `owner` and its claims, deleting nothing: its keys stay stored,
        evictable like any other unclaimed key (a session closed without release, or expired).
        Without this the index would remember every closed session's keys for ever."""
        self._forget_owner(owner)

    def _forget_owner(self, owner: str) -> list[str]:
        """Drops `owner`'s retention and claims; returns the keys no owner claims any more."""
        with self._lock:
            self._set_retained(owner, False)
            self._retention.pop(owner, None)
            orphans = []
            for key in self._owned.pop(owner, {}):
                owners = self._owners.get(key)
                if owners is None:
                    continue
                owners.discard(owner)
                if not owners:
                    del self._owners[key]
                    orphans.append(key)
        return orphans

    def claims(self) -> int:
        """(owner, key) claims recorded: bounded by the live trajectories' keys."""
        with self._lock:
            return sum(len(keys) for keys in self._owned.values())

    def retain(self, owner: str, state: str, priority: int = 0, ttl_s: float = 0.0) -> None:
        """Sets trajectory `owner`'s retention: `"active"` (a round runs), `"idle"` (its round
        ended: retained for `ttl_s` more seconds) or `"ended"` (not retained any more). A no-op
        under `policy="lru"`."""
        if state not in RETAIN_STATES:
            raise ValueError(f"retention state must be one of {RETAIN_STATES}, got {state!r}")
        if not ttl_s >= 0:
            raise ValueError(f"retention ttl_s must be >= 0, got {ttl_s}")
        if self.policy != "retention":
            return
        with self._lock:
            now = self.clock()
            self._expire(now)
            if state == "ended":
                self._retention.pop(owner, None)
                self._set_retained(owner, False)
                return
            r = self._retention.setdefault(owner, Retention())
            self._stamp += 1
            r.stamp = self._stamp
            r.priority = priority
            r.active = state == "active"
            if state == "idle":
                r.until = now + ttl_s
                if ttl_s > 0:
                    heapq.heappush(self._expiry, (r.until, owner))
            held = r.retained(now)
            if not held:  # an idle owner without a TTL: nothing to remember
                del self._retention[owner]
            self._set_retained(owner, held)

    # ------------------------------------------------------------------ internals

    def _add(self, key: str, nbytes: int) -> None:
        self._lru[key] = nbytes
        self._used += nbytes
        self._use(key)

    def _use(self, key: str) -> None:
        """`key` was just used: it is the last of the unheld keys to go."""
        self._tick += 1
        self._used_at[key] = self._tick
        if not self._held[key]:
            heapq.heappush(self._heap, (self._tick, key))
            if len(self._heap) > 4 * len(self._lru) + 64:  # mostly stale entries: rebuild
                self._heap = [(t, k) for k, t in self._used_at.items() if not self._held[k]]
                heapq.heapify(self._heap)

    def _hold(self, key: str) -> None:
        self._held[key] += 1

    def _set_retained(self, owner: str, retained: bool) -> None:
        if retained == (owner in self._retained):
            return
        keys = self._owned.get(owner, ())
        if retained:
            self._retained.add(owner)
            for key in keys:
                self._hold(key)
            return
        self._retained.discard(owner)
        for key in keys:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
                if key in self._lru:  # back among the unheld keys, where its last use puts it
                    heapq.heappush(self._heap, (self._used_at[key], key))

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            until, owner = heapq.heappop(self._expiry)
            r = self._retention.get(owner)
            if r is not None and not r.retained(now):
                del self._retention[owner]
                self._set_retained(owner, False)

    def _victims(self, exclude: set[str]) -> Iterator[str]:
        """Unpinned keys not in `exclude` in eviction order, each looked up when asked for (so
        that keys dropped or added meanwhile are seen): the unheld ones, least recently used
        first, then the held ones (`_held_victims`)."""
        aside: list[tuple[int, str]] = []  # pinned or excluded: back on the heap afterwards
        try:
            while self._heap:
                tick, key = self._heap[0]
                if self._used_at.get(key) != tick or self._held[key] or key not in self._lru:
                    heapq.heappop(self._heap)  # stale
                elif self._pins[key] or key in exclude:
                    aside.append(heapq.heappop(self._heap))
                else:
                    yield key  # the caller drops it before asking for the next
        finally:
            for entry in aside:
                heapq.heappush(self._heap, entry)
        yield from self._held_victims(exclude)

    def _held_victims(self, exclude: set[str]) -> Iterator[str]:
        """Stored unpinned held keys not in `exclude`, owner by owner: lowest priority first, an
        idle owner's before an active one's, the owner least recently active first; each owner's
        keys from the tail of its chain (latest claimed first). Keys only that owner holds come
        first; keys other retained owners hold too, only once no such key is left."""
        owners = sorted(self._retained, key=lambda o: self._retention[o].rank)
        for shared in (False, True):
            for owner in owners:
                for key in reversed(list(self._owned.get(owner, ()))):
                    held = self._held[key]
                    if (
                        held
                        and (shared or held == 1)
                        and key in self._lru
                        and self._pins[key] == 0
                        and key not in exclude
                    ):
                        yield key

    def _forget(self, key: str) -> None:
        """Takes a seen key out of the view, deleting nothing: its claims, pins and retention
        stay (a release still dooms it, a hit brings it back)."""
        del self._seen[key]
        self._used -= self._lru.pop(key)
        self._used_at.pop(key, None)  # its heap entries are stale now

    def _drop(self, key: str) -> None:
        nbytes = self._lru.pop(key, None)
        if nbytes is not None:
            self._used -= nbytes
        self._seen.pop(key, None)
        self._used_at.pop(key, None)
        self._held.pop(key, None)
        for owner in self._owners.pop(key, ()):
            mine = self._owned.get(owner)
            if mine is not None:
                mine.pop(key, None)
                if not mine and owner not in self._retained:  # no claims left to remember
                    del self._owned[owner]
