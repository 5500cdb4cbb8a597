"""`PrefetchMemory`: an engine's tool-gap prefetch memory (the real cluster's side of
`sched.prefetch`; the router's side is router/prefetch.py). A DE's or a PE's, by the side the
policy reads.

During a tool call the router may tell an engine to read a session's leading hit blocks from the
store (`start`). One reader thread reads them a block at a time, in the order asked, into
memory of its own (a budget of `budget_bytes`, reserved when a prefetch starts), and only while
no round of the engine is reading the store (`critical()` brackets those reads): a round's
reads wait for at most the one block on the wire, the priority the simulator's `Background`
gives them. Each block read is charged to the node's storage links at LOW (`charge`).

The next turn's load (its DE or PE half) takes the blocks (`take`, by session and keys: a block
is used only if it is the key the load wants, so a prefetch of another chain or an older
context is never misread), copies them into its buffer and reads only the rest from the store. Reading ends
when every block is read, a block is missing from the store, the prefetch is taken or dropped;
the reader then reports `done(session, epoch, blocks, read_s)` (not for a dropped or taken one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import numpy as np

from dualpath_jax.kvstore.api import BlockStore, HostDestination
from dualpath_jax.kvstore.buffers import buffer_blocks
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.transfer import links, paths

log = logging.getLogger(__name__)


def prefetch_budget_bytes(cfg, layout: BlockLayout) -> float:
    """One engine's prefetch memory (an `ExperimentConfig`'s): `scheduler.prefetch_bytes_per_engine`,
    by default as much as its host buffer. The router plans within it too."""
    return cfg.scheduler.prefetch_bytes_per_engine or buffer_blocks(cfg, layout) * layout.nbytes


Done = Callable[[str, int, int, float], object]  # (session, epoch, blocks, read_s)


@dataclasses.dataclass(eq=False)
class _Entry:
    session: str
    epoch: int
    keys: tuple[str, ...]  # as many as its reservation holds
    blocks: list[np.ndarray] = dataclasses.field(default_factory=list)
    stopped: bool = False  # taken or dropped: the reader leaves it


class PrefetchMemory:
    """One engine's prefetch memory; thread-safe. `timeout_s` bounds one block's store read."""

    def __init__(
        self,
        store: BlockStore,
        layout: BlockLayout,
        budget_bytes: float,
        *,
        charge: Callable[[int], object] | None = None,
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.layout = store, layout
        self.budget_blocks = max(0, int(budget_bytes // layout.nbytes))
        self.charge = charge
        self.timeout_s = timeout_s
        self.clock = clock
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._critical = 0
        self._reader = futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.read_blocks = 0  # blocks read (for stats)
        self.used_blocks = 0  # blocks handed to loads

    @classmethod
    def for_engine(cls, cfg, node: int, layout: BlockLayout, store: BlockStore, traffic):
        """An engine's memory (`prefetch_budget_bytes`), its reads charged to its node's storage
        read links at LOW (`traffic`: the engine's `TrafficManager`, None: not charged)."""
        path = paths.store_read_path(f"node{node}")

        def charge(nbytes: int) -> None:
            traffic.transfer(path, nbytes, links.TrafficClass.LOW)

        return cls(
            store,
            layout,
            prefetch_budget_bytes(cfg, layout),
            charge=charge if traffic is not None else None,
            timeout_s=cfg.cluster.transfer_timeout_s,
        )

    # ------------------------------------------------------------------ the router's orders

    def reserved_blocks(self) -> int:
        with self._cond:
            return sum(len(e.keys) for e in self._entries.values())

    def start(self, session: str, keys: Sequence[str], epoch: int, done: Done) -> int:
        """Starts prefetch `epoch` of `session` (replacing one it had): as many of `keys` as
        the budget has room for. Returns that number (0: nothing to read, `done` at once)."""
        with self._cond:
            old = self._entries.pop(session, None)
            if old is not None:
                old.stopped = True
            free = self.budget_blocks - sum(len(e.keys) for e in self._entries.values())
            entry = _Entry(session, epoch, tuple(keys[: max(0, free)]))
            if entry.keys:
                self._entries[session] = entry
        if not entry.keys:
            done(session, epoch, 0, 0.0)
            return 0
        self._reader.submit(self._read, entry, done)
        return len(entry.keys)

    def drop(self, session: str, epoch: int | None = None) -> None:
        """Forgets `session`'s prefetch (only epoch `epoch` if given): reading stops, memory frees."""
        with self._cond:
            e = self._entries.get(session)
            if e is not None and (epoch is None or e.epoch == epoch):
                del self._entries[session]
                e.stopped = True
                self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            for e in self._entries.values():
                e.stopped = True
            self._entries.clear()
            self._cond.notify_all()

    def close(self) -> None:
        self.clear()
        self._reader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ a round's load

    def take(self, session: str, keys: Sequence[str]) -> list[np.ndarray]:
        """The blocks of `session`'s prefetch that are the leading `keys`, in order (reading
        stops; the rest of its memory is freed). [] when it has none of them."""
        with self._cond:
            e = self._entries.pop(session, None)
            if e is None:
                return []
            e.stopped = True
            self._cond.notify_all()
            out: list[np.ndarray] = []
            for want, have, block in zip(keys, e.keys, e.blocks):
                if want != have:
                    break
                out.append(block)
            self.used_blocks += len(out)
            return out

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A round's store reads run inside: no prefetch block starts meanwhile."""
        with self._cond:
            self._critical += 1
        try:
            yield
        finally:
            with self._cond:
                self._critical -= 1
                self._cond.notify_all()

    # ------------------------------------------------------------------ the reader

    def _read(self, e: _Entry, done: Done) -> None:
        t0 = self.clock()
        n = 0
        try:
            for key in e.keys:
                with self._cond:
                    while self._critical and not e.stopped:
                        self._cond.wait()
                    if e.stopped:
                        return
                block = np.empty(self.layout.shape, np.uint8)
                got = self.store.read_full([key], HostDestination([block])).result(self.timeout_s)
                if not got.hits:
                    break  # evicted meanwhile: the load reads what follows (or recomputes)
                if self.charge is not None:
                    self.charge(self.layout.nbytes)
                with self._cond:
                    if e.stopped:
                        return
                    e.blocks.append(block)
                    self.read_blocks += 1
                n += 1
        except Exception as exc:  # noqa: BLE001 - a failed prefetch only costs its benefit
            log.warning("prefetch of %s stopped after %d blocks: %s", e.session, n, exc)
        with self._cond:
            if e.stopped:
                return
            # what was not read frees its reservation
            e.keys = e.keys[: len(e.blocks)]
        done(e.session, e.epoch, len(e.blocks), self.clock() - t0)
