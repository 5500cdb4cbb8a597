"""KV events: which Full Blocks the cluster's block stores created or removed, for an index
outside the cluster (docs/kv_events.md).

A store (`TensorStoreBlockStore(on_events=...)`) reports each change it made to storage once it
has happened: `BlockStored` names the blocks a write created (not those already there),
`BlockRemoved` the blocks it deleted and why (`REMOVAL_REASONS`). The router numbers them in
`EventBatch`es and publishes them on one ZeroMQ PUB socket (`cluster.kv_events_address`,
router/kv_publisher.py). A user reads them with `KVEventSubscriber` and may keep them in
`StoredBlocks`.

Wire format: every PUB message is two frames, `TOPIC` and `encode_batch(batch)` (msgpack of the
structs below, tagged by class name like the control-plane messages); `EVENTS_VERSION` changes
with any incompatible change of these structs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import msgspec
import zmq

EVENTS_VERSION = 1
TOPIC = b"kv"
# evicted: capacity (least recently used first); deleted: `BlockStore.delete`; released: the
# last trajectory claiming the block ended (`release`); corrupt: found bad on a read or lookup.
REMOVAL_REASONS = ("evicted", "deleted", "released", "corrupt")


class BlockStored(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Blocks a write created, in the order of the write (chain order, prefix first; a run
    may skip keys that were stored already). A key names its whole token prefix
    (kvstore/identity.py), so no parent is needed to place it."""

    keys: tuple[str, ...]
    block_tokens: int  # tokens per block
    block_bytes: int  # stored bytes per block (header, checksums, every layer)
    medium: str = "store"  # where the blocks live: the shared block store


class BlockRemoved(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Blocks a store deleted, and why (one of `REMOVAL_REASONS`). A deletion does not say
    whether the key was there: a key no `BlockStored` announced (never persisted, or removed
    already by another process) can appear, and an index ignores it."""

    keys: tuple[str, ...]
    reason: str
    medium: str = "store"


KVEvent = BlockStored | BlockRemoved


class EventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """What one store reported at once, as published. `seq` counts the publisher's batches from
    0 without gaps (a subscriber that sees a jump lost batches; a lower one: the publisher
    restarted); `ts` is the publisher's wall clock (seconds since the epoch) when it sent the
    batch; `source` names the process whose store acted (`router`, `pe0`, `de1`, ...)."""

    v: int
    seq: int
    ts: float
    source: str
    events: tuple[KVEvent, ...]


class EventFormatError(ValueError):
    """A published frame is not an `EventBatch` of this `EVENTS_VERSION`."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(frame: bytes) -> EventBatch:
    """Decodes and checks one published frame; raises `EventFormatError` naming the problem."""
    try:
        batch = _decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise EventFormatError(f"malformed KV event batch: {e}") from None
    if batch.v != EVENTS_VERSION:
        raise EventFormatError(
            f"KV event version {batch.v} is not supported (this side reads {EVENTS_VERSION})"
        )
    return batch


class StoredBlocks:
    """An index of stored blocks built from event batches: key -> the source that stored it.

    `hit(keys)` is the prefix hit of a request's block keys (`identity.block_keys` of its
    prompt under the served model's fingerprint): the leading keys stored. It is a hint, as any
    index outside the store is: a block can vanish between an event and a read, and the engines
    recompute what they do not find.
    """

    def __init__(self) -> None:
        self.where: dict[str, str] = {}

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.where.update(dict.fromkeys(ev.keys, batch.source))
            else:
                for key in ev.keys:
                    self.where.pop(key, None)

    def apply_all(self, batches: Iterable[EventBatch]) -> None:
        for b in batches:
            self.apply(b)

    def __contains__(self, key: object) -> bool:
        return key in self.where

    def __len__(self) -> int:
        return len(self.where)

    def hit(self, keys: Sequence[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.where:
            n += 1
        return n


class KVEventSubscriber:
    """A SUB socket on a router's KV event stream (`address`: the router's
    `stats()["kv_events"]["address"]`). Iterating yields every `EventBatch` as it arrives.

    The stream has no replay: a subscriber sees the batches published after its subscription
    reached the router (`wait_connected` waits for the connection), and ZeroMQ drops batches for a
    subscriber that falls `hwm` batches behind. Gaps show in `seq`: `missed` counts the batches
    skipped since the first one received, `restarts` the times `seq` went back (a new router).
    After either, an index built from the events is stale.
    """

    def __init__(self, address: str, *, hwm: int = 100_000, context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.IPV6, 1)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(address)
        self.address = address
        self.connected = False
        self.next_seq: int | None = None
        self.missed = 0
        self.restarts = 0

    def wait_connected(self, timeout_ms: int) -> bool:
        """Whether the connection to the publisher is up (waiting at most `timeout_ms`); batches
        published after that reach this subscriber."""
        if not self.connected and self._monitor.poll(timeout_ms):
            self._monitor.recv_multipart()
            self.connected = True
        return self.connected

    def recv(self, timeout_ms: int | None = None) -> EventBatch | None:
        """The next batch, or None after `timeout_ms` (None: wait for one). Raises
        `EventFormatError` for a frame that is not a batch of this version."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        if len(frames) != 2 or frames[0] != TOPIC:
            raise EventFormatError(f"expected the frames [{TOPIC!r}, batch], got {len(frames)}")
        batch = decode_batch(frames[1])
        if self.next_seq is not None and batch.seq > self.next_seq:
            self.missed += batch.seq - self.next_seq
        elif self.next_seq is not None and batch.seq < self.next_seq:
            self.restarts += 1
        self.next_seq = batch.seq + 1
        return batch

    def __iter__(self) -> Iterator[EventBatch]:
        while True:
            batch = self.recv()
            if batch is not None:
                yield batch

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
