"""TensorStoreBlockStore: the BlockStore (api.py) on a tensorstore kvstore (docs/architecture.md).

One key per Full Block (`identity.key_path`: `ab/abcd...`), its value the codec's bytes. The
I/Os of a batch run concurrently, at most `StoreConfig.io_concurrency` in flight, and each waits
at most `StoreConfig.timeout_s`. Writes, deletes, listing and lookups go through tensorstore;
reads of a `file` store are positional reads straight into the read's destination (filereader.py),
reads of every other store are tensorstore byte-range reads decoded into it.

Failure semantics (the caller recomputes whatever is not a hit):
- a missing block ends the hit run there; so does a corrupt, truncated or mismatching block,
  which is also counted (`checksum_failures`) and removed from the store when it is still the
  same generation, so the next write of that key replaces it;
- an unusable root (not creatable, not a directory, not writable) raises `StoreUnavailable` at
  open; an I/O error or timeout during an operation sets `StoreError` on its future;
- writes are conditional on the key being absent and atomic (the file driver writes a temporary
  file, fsyncs it if `StoreConfig.fsync`, and renames it), so a reader never sees half a block and
  two processes writing one key leave one valid block.

KV events (dualpath_jax/kv_events.py): with `on_events`, the store reports the blocks each write
created (`BlockStored`) and each block it deleted (`BlockRemoved`: evicted, deleted, released,
corrupt), after the I/O finished and before the operation's future resolves, one call at a time
in the order this process finished them. Nothing is reported for a block whose I/O failed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import numpy as np
import tensorstore as ts

from dualpath_jax.config import ModelConfig, StoreConfig
from dualpath_jax.kv_events import BlockRemoved, BlockStored, KVEvent
from dualpath_jax.kvstore import tensorstore_io
from dualpath_jax.kvstore.api import (
    BlockRead,
    BlockReadResult,
    BlockStore,
    DestinationKind,
    StoreError,
    StoreStats,
    StoreUnavailable,
    WriteReport,
)
from dualpath_jax.kvstore.capacity import DiskUsage, store_capacity
from dualpath_jax.kvstore.codec import (
    HEADER_BYTES,
    BlockDecodeError,
    BlockFormat,
    check_header,
    decode_block,
    decode_layers,
    encode_block,
)
from dualpath_jax.kvstore.filereader import read_block_file
from dualpath_jax.kvstore.identity import check_key, key_from_path, key_path, model_fingerprint
from dualpath_jax.kvstore.index import BlockIndex
from dualpath_jax.model.layout import BlockLayout

log = logging.getLogger(__name__)


class TensorStoreBlockStore(BlockStore):
    """A BlockStore on a tensorstore kvstore: `file` (default), `memory`, or any kvstore spec
    (gcs, s3, ocdbt, ...) passed through unchanged.

    Block sizes come from `fmt`; capacity (`StoreConfig.capacity_bytes`, or by default a
    fraction of the disk: `capacity.store_capacity`, logged at open, `disk_usage` as
    `shutil.disk_usage`) is enforced on this process's view, evicting least recently used
    unpinned blocks; keys found at open (`list`) join that view as the oldest. Blocks other
    processes wrote, seen by lookups and reads, are only remembered up to that capacity
    (`BlockIndex`: the least recently used are forgotten, never deleted).

    `on_events(events)` (optional) receives this store's KV events (module docstring); it runs on
    the store's threads, one call at a time, and must neither block for long nor call the store.

    Reads land in host memory: numpy arrays, or the pinned slots of a PE/DE buffer, which are
    host memory too (a file store's positional reads and a memory store's decode write straight
    into them). Device pages are refused (`api.UnsupportedDestination`).
    """

    read_destinations = frozenset({DestinationKind.HOST, DestinationKind.PINNED})

    def __init__(
        self,
        cfg: StoreConfig,
        fmt: BlockFormat,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        disk_usage: DiskUsage = shutil.disk_usage,
    ):
        self.cfg = cfg
        self.fmt = fmt
        self._on_events = on_events
        self._event_lock = threading.Lock()
        self._window = max(1, cfg.io_concurrency)
        spec = tensorstore_io.kvstore_spec(cfg)
        if cfg.kind == "file":
            tensorstore_io.check_root(spec["path"])
        try:
            self._kv = ts.KvStore.open(spec).result(timeout=cfg.timeout_s)
        except Exception as e:  # tensorstore reports bad specs and I/O failures as ValueError
            raise StoreUnavailable(f"cannot open block store {cfg.kind}: {e}") from None
        self._counts: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        found: list[str] = []
        if cfg.kind != "memory":
            try:
                listed = self._kv.list().result(timeout=cfg.timeout_s)
            except Exception as e:
                raise StoreUnavailable(f"cannot list block store {cfg.kind}: {e}") from None
            found = [k for k in (key_from_path(p.decode(errors="replace")) for p in listed) if k]
        self.capacity = store_capacity(cfg, spec, len(found) * fmt.encoded_bytes, disk_usage)
        log.info(
            "block store capacity: %s (%s)",
            f"{self.capacity.nbytes / 2**30:.2f} GiB" if self.capacity.nbytes else "unlimited",
            self.capacity.why,
        )
        self.index = BlockIndex(self.capacity.nbytes, cfg.eviction)
        self.index.touch(found, fmt.encoded_bytes, found=True)
        self._pool = futures.ThreadPoolExecutor(
            max_workers=self._window, thread_name_prefix="blockstore"
        )
        # File stores read by positional reads on their own threads (see filereader).
        self._file_root = spec["path"] if cfg.kind == "file" else None
        self._io_pool = futures.ThreadPoolExecutor(
            max_workers=self._window, thread_name_prefix="blockstore-io"
        )
        self._closed = False

    # ------------------------------------------------------------------ plumbing

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            self._counts.update(deltas)

    def _emit(self, *events: KVEvent) -> None:
        """Hands events with keys to `on_events`, one call at a time (so they arrive in the order
        this process got here); a failing callback is logged, never the operation's error."""
        events = tuple(e for e in events if e.keys)
        if self._on_events is None or not events:
            return
        with self._event_lock:
            try:
                self._on_events(list(events))
            except Exception:  # noqa: BLE001 - the store's I/O succeeded either way
                log.exception("the KV event callback failed")

    def _submit(self, fn: Callable[..., Any], *args: Any) -> futures.Future[Any]:
        if self._closed:
            raise StoreError("block store is closed")
        return self._pool.submit(fn, *args)

    def _wait(self, fut: ts.Future, what: str) -> Any:
        return tensorstore_io.wait(fut, what, self.cfg.timeout_s)

    def _windowed(
        self,
        keys: list[str],
        issue: Callable[[int, str], Any],
        handle: Callable[[int, str, Any], bool],
    ) -> None:
        tensorstore_io.windowed(
            keys, issue, handle, window=self._window, timeout_s=self.cfg.timeout_s
        )

    def _classify(self, key: str, res: Any) -> tuple[Any, str]:
        """(read result or None, miss reason) of one read; raises StoreError on I/O errors."""
        if isinstance(res, Exception):
            if str(res).startswith("OUT_OF_RANGE"):  # a byte range past the end: truncated
                return None, f"corrupt: block {key} is truncated"
            raise StoreError(f"read of block {key} failed: {res}") from res
        if res.state != "value":
            return None, "missing"
        return res, ""

    def _corrupt(self, key: str, err: Exception, generation: bytes | None) -> str:
        self._count(checksum_failures=1)
        self.index.remove([key])
        if generation is not None:
            # Only the bad generation goes: a concurrent rewrite of the key survives. Waiting
            # makes the removal visible to this caller's next lookup.
            try:
                res = self._wait(
                    self._kv.write(key_path(key), None, if_equal=generation), f"block {key}"
                )
            except Exception:  # the block is still reported as a miss; the next read retries
                res = None
            if res is not None and res.generation:  # empty: another generation is there now
                self._emit(BlockRemoved(keys=(key,), reason="corrupt"))
        return f"corrupt: {err}"

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[str]) -> futures.Future[int]:
        keys = [check_key(k) for k in keys]
        return self._submit(self._lookup, keys)

    def _lookup(self, keys: list[str]) -> int:
        hits = 0

        def issue(i: int, key: str) -> ts.Future:
            return self._kv.read(key_path(key), byte_range=slice(0, HEADER_BYTES))

        def handle(i: int, key: str, res: Any) -> bool:
            nonlocal hits
            res, reason = self._classify(key, res)
            if res is None:
                if reason != "missing":  # shorter than a header
                    self._count(checksum_failures=1)
                return False
            try:
                check_header(self.fmt, key, res.value)
            except BlockDecodeError as e:
                self._corrupt(key, e, res.stamp.generation)
                return False
            hits += 1
            return True

        self._windowed(keys, issue, handle)
        self.index.touch(keys[:hits], self.fmt.encoded_bytes)
        self.index.remove(keys[hits : hits + 1])
        self._count(lookups=1, lookup_hits=hits)
        return hits

    # ------------------------------------------------------------------ reads

    def _submit_read(self, read: BlockRead) -> futures.Future[BlockReadResult]:
        return self._submit(self._read, read)

    def _read(self, read: BlockRead) -> BlockReadResult:
        keys, layers, out = read.keys, read.layers, read.out
        blocks: list[np.ndarray] = []
        reason = ""
        nbytes = 0
        if layers is not None:
            checksum_range = slice(*self.fmt.checksum_byte_range(*layers))
            payload_range = slice(*self.fmt.layer_byte_range(*layers))
        direct = self._file_root is not None
        # A single block is read here (a thread hop would cost more than a small read); a batch
        # fans out so that storage sees several reads at once.
        inline = len(keys) == 1

        def issue(i: int, key: str) -> Any:
            dest = None if out is None else out[i]
            if direct:
                args = (self._file_root, self.fmt, key, layers, dest)
                return (
                    tensorstore_io.run_now(read_block_file, *args)
                    if inline
                    else self._io_pool.submit(read_block_file, *args)
                )
            if layers is None:
                return self._kv.read(key_path(key))
            path = key_path(key)
            return tensorstore_io.Joined(
                self._kv.read(path, byte_range=checksum_range),
                self._kv.read(path, byte_range=payload_range),
            )

        def handle_direct(i: int, key: str, res: Any) -> tuple[np.ndarray | None, int]:
            nonlocal reason
            if isinstance(res, BlockDecodeError):
                reason = self._corrupt_file(key, res)
                return None, 0
            if isinstance(res, Exception):
                raise StoreError(f"read of block {key} failed: {res}") from res
            if res[0] is None:
                reason = "missing"
            return res

        def handle_ts(i: int, key: str, res: Any) -> tuple[np.ndarray | None, int]:
            nonlocal reason
            parts = []
            for r in res if isinstance(res, tuple) else (res,):
                r, reason = self._classify(key, r)
                if r is None:
                    if reason != "missing":
                        self._count(checksum_failures=1)
                    return None, 0
                parts.append(r)
            dest = None if out is None else out[i]
            try:
                if layers is None:
                    blk = decode_block(self.fmt, key, parts[0].value, dest)
                else:
                    blk = decode_layers(
                        self.fmt, key, parts[0].value, parts[1].value, layers[0], layers[1], dest
                    )
            except BlockDecodeError as e:
                reason = self._corrupt(key, e, parts[-1].stamp.generation)
                return None, 0
            return blk, sum(len(r.value) for r in parts)

        def handle(i: int, key: str, res: Any) -> bool:
            nonlocal nbytes
            blk, n = (handle_direct if direct else handle_ts)(i, key, res)
            if blk is None:
                self.index.remove([key])
                return False
            blocks.append(blk)
            nbytes += n
            return True

        self._windowed(keys, issue, handle)
        self.index.touch(keys[: len(blocks)], self.fmt.encoded_bytes)
        kind = "reads" if layers is None else "layer_reads"
        self._count(**{kind: len(blocks)}, read_bytes=nbytes, misses=len(keys) - len(blocks))
        return BlockReadResult(len(blocks), tuple(blocks), reason)

    def _corrupt_file(self, key: str, err: Exception) -> str:
        """A direct read found `key` bad: remove it if tensorstore still sees a bad block there
        (its generation guards against deleting a concurrent good rewrite)."""
        generation = None
        try:
            res = self._wait(self._kv.read(key_path(key)), f"block {key}")
            if res.state == "value":
                try:
                    decode_block(self.fmt, key, res.value)
                except BlockDecodeError:
                    generation = res.stamp.generation
        except Exception:  # reported as a miss either way
            pass
        return self._corrupt(key, err, generation)

    # ------------------------------------------------------------------ writes

    def _submit_write(
        self, keys: list[str], blocks: np.ndarray | Sequence[np.ndarray], owner: str | None
    ) -> futures.Future[WriteReport]:
        if owner is not None:
            self.index.claim(owner, keys)
        return self._submit(self._write, keys, blocks)

    def _write(self, keys: list[str], blocks: Any) -> WriteReport:
        _, evicted = self.index.admit(keys, self.fmt.encoded_bytes)
        if evicted:
            self._delete_now(evicted, "evicted")
            self._count(evictions=len(evicted))
        # Keys indexed before are written too (conditionally, so a stored one stays untouched):
        # this process's index may be stale when another process deleted them.
        block_of = {k: blocks[i] for i, k in enumerate(keys) if k in self.index}
        todo_keys = list(block_of)
        rejected = len(dict.fromkeys(keys)) - len(todo_keys)
        existed = 0
        stored: list[str] = []  # written now, in write order
        failed: list[str] = []
        errors: list[str] = []

        def issue(i: int, key: str) -> ts.Future:
            data = encode_block(self.fmt, key, np.asarray(block_of[key]))
            return self._kv.write(key_path(key), data, if_equal=tensorstore_io.IF_ABSENT)

        def handle(i: int, key: str, res: Any) -> bool:
            nonlocal existed
            if isinstance(res, Exception):
                failed.append(key)
                errors.append(f"block {key}: {res}")
            elif res.generation:
                stored.append(key)
            else:
                existed += 1
            return True

        try:
            self._windowed(todo_keys, issue, handle)
        except StoreError:
            self.index.remove(todo_keys)
            self._emit(self._stored(stored))
            raise
        self.index.remove(failed)
        self._emit(self._stored(stored))
        written = len(stored)
        self._count(
            writes=written,
            write_bytes=written * self.fmt.encoded_bytes,
            write_existed=existed,
            write_rejected=rejected,
        )
        if errors:
            raise StoreError(f"{len(errors)} block write(s) failed; first: {errors[0]}")
        return WriteReport(written, len(keys) - written - rejected, rejected)

    def _stored(self, keys: list[str]) -> BlockStored:
        return BlockStored(
            keys=tuple(keys),
            block_tokens=self.fmt.layout.block_tokens,
            block_bytes=self.fmt.encoded_bytes,
        )

    # ------------------------------------------------------------------ deletion, pins, owners

    def _delete_now(self, keys: list[str], reason: str) -> int:
        """Deletes `keys` (already dropped from the index) and reports them removed for
        `reason`."""
        errors: list[str] = []
        removed: list[str] = []

        def handle(i: int, key: str, res: Any) -> bool:
            if isinstance(res, Exception):
                errors.append(f"block {key}: {res}")
            else:
                removed.append(key)
            return True

        try:
            self._windowed(keys, lambda i, k: self._kv.write(key_path(k), None), handle)
        finally:
            self._emit(BlockRemoved(keys=tuple(removed), reason=reason))
        self._count(deletes=len(keys) - len(errors))
        if errors:
            raise StoreError(f"{len(errors)} block delete(s) failed; first: {errors[0]}")
        return len(keys)

    def _delete_doomed(self, doomed: list[tuple[str, str]]) -> int:
        """Deletes keys whose last pin went, grouped by the reason they were doomed for."""
        by_reason: dict[str, list[str]] = {}
        for key, reason in doomed:
            by_reason.setdefault(reason, []).append(key)
        return sum(self._delete_now(keys, reason) for reason, keys in by_reason.items())

    def delete(self, keys: Sequence[str]) -> futures.Future[int]:
        keys = [check_key(k) for k in keys]
        return self._submit(self._delete_now, self.index.doom(keys, "deleted"), "deleted")

    def pin(self, keys: Sequence[str]) -> None:
        self.index.pin([check_key(k) for k in keys])

    def unpin(self, keys: Sequence[str]) -> futures.Future[int]:
        doomed = self.index.unpin_doomed([check_key(k) for k in keys])
        return self._submit(self._delete_doomed, doomed)

    def claim(self, owner: str, keys: Sequence[str]) -> None:
        self.index.claim(owner, [check_key(k) for k in keys])

    def release(self, owner: str) -> futures.Future[int]:
        return self._submit(self._delete_now, self.index.release(owner), "released")

    def disown(self, owner: str) -> None:
        """Drops `owner`'s claims and retention, keeping its blocks (`BlockIndex.disown`)."""
        self.index.disown(owner)

    def retain(self, owner: str, state: str, priority: int = 0, ttl_s: float = 0.0) -> None:
        self.index.retain(owner, state, priority, ttl_s)

    # ------------------------------------------------------------------ stats, lifecycle

    def stats(self) -> StoreStats:
        with self._count_lock:
            c = dict(self._counts)
        fields = [f.name for f in dataclasses.fields(StoreStats)]
        base = {
            "blocks": self.index.blocks,
            "bytes": self.index.used_bytes,
            "capacity_bytes": self.index.capacity_bytes,
            "pinned": self.index.pinned_count,
            "retained": self.index.retained_count,
        }
        return StoreStats(**{f: base.get(f, c.get(f, 0)) for f in fields})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._io_pool.shutdown(wait=True)


def open_block_store(
    cfg: StoreConfig,
    model: ModelConfig,
    params_version: str = "",
    kv_format: str | None = None,
    on_events: Callable[[list[KVEvent]], None] | None = None,
    disk_usage: DiskUsage = shutil.disk_usage,
) -> TensorStoreBlockStore:
    """Opens the block store of `model` (layout, KV dtype tag and fingerprint derived from it);
    `on_events` receives its KV events, `disk_usage` sizes its default capacity
    (`TensorStoreBlockStore`)."""
    layout = BlockLayout.for_model(model, cfg.block_tokens, kv_format)
    fmt = BlockFormat(layout, kv_format or model.kv_dtype, model_fingerprint(model, params_version))
    return TensorStoreBlockStore(cfg, fmt, on_events, disk_usage)
