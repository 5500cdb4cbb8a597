"""KV events of a block store (run against the file, memory and raw-spec stores) and their schema:
what a write created, what eviction, deletion, release and corruption removed, in order, after
the I/O and before the future resolves."""

from __future__ import annotations

import msgspec
import pytest

from dualpath_jax.kv_events import (
    EVENTS_VERSION,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFormatError,
    StoredBlocks,
    decode_batch,
    encode_batch,
)
from dualpath_jax.kvstore import block_keys
from dualpath_jax.kvstore.identity import key_path

BT = 4  # tokens per block in the fixtures' layout


class Recorder:
    """An `on_events` callback that keeps every call, and whether the store's index lock was
    held at the time (it must not be)."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self.store = None
        self.under_index_lock = False

    def __call__(self, events: list) -> None:
        if self.store is not None:
            self.under_index_lock |= self.store.index._lock.locked()
        self.calls.append(list(events))

    @property
    def events(self) -> list:
        return [e for call in self.calls for e in call]


@pytest.fixture
def recorded(make_store):
    """`recorded(**StoreConfig overrides)` -> (store, recorder)."""

    def make(**kw):
        rec = Recorder()
        store = make_store(on_events=rec, **kw)
        rec.store = store
        return store, rec

    return make


def keys_of(store, tokens):
    return block_keys(tokens, BT, store.fmt.fingerprint)


def stored(store, keys) -> BlockStored:
    return BlockStored(keys=tuple(keys), block_tokens=BT, block_bytes=store.fmt.encoded_bytes)


def test_a_write_reports_the_blocks_it_created_before_its_future_resolves(recorded, random_blocks):
    store, rec = recorded()
    keys = keys_of(store, range(20))
    store.write_full(keys[:3], random_blocks(3)).result()
    assert rec.calls == [[stored(store, keys[:3])]]
    # Blocks stored already are not reported again; the new ones are, in write order.
    store.write_full(keys, random_blocks(5)).result()
    assert rec.calls[1:] == [[stored(store, keys[3:])]]
    store.write_full(keys, random_blocks(5)).result()  # nothing new: no call
    assert len(rec.calls) == 2 and not rec.under_index_lock


def test_eviction_under_capacity_is_reported_before_the_write_it_made_room_for(
    recorded, random_blocks, fmt
):
    store, rec = recorded(capacity_bytes=3 * fmt.encoded_bytes)
    keys = keys_of(store, range(24))
    store.write_full(keys[:3], random_blocks(3)).result()
    lru = store.index.lru_order()  # a chain's tail first: eviction keeps the useful prefix
    assert lru == keys[2::-1]
    store.write_full(keys[3:5], random_blocks(2)).result()
    assert rec.events[1:] == [
        BlockRemoved(keys=(keys[2], keys[1]), reason="evicted"),
        stored(store, keys[3:5]),
    ]
    assert store.stats().evictions == 2
    index = StoredBlocks()
    index.apply(EventBatch(v=EVENTS_VERSION, seq=0, ts=0.0, source="de1", events=rec.events))
    assert set(index.where) == {keys[0], keys[3], keys[4]} == set(store.index.lru_order())


def test_delete_reports_removed_blocks_and_a_pinned_one_at_its_last_unpin(recorded, random_blocks):
    store, rec = recorded()
    keys = keys_of(store, range(16))
    store.write_full(keys, random_blocks(4)).result()
    store.pin(keys[:1])
    store.pin(keys[:1])
    assert store.delete(keys[:2]).result() == 1
    assert rec.events[1:] == [BlockRemoved(keys=(keys[1],), reason="deleted")]
    store.unpin(keys[:1]).result()
    assert len(rec.events) == 2  # still pinned once
    store.unpin(keys[:1]).result()
    assert rec.events[2:] == [BlockRemoved(keys=(keys[0],), reason="deleted")]
    assert not rec.under_index_lock


def test_release_reports_the_blocks_no_other_trajectory_claims(recorded, random_blocks):
    store, rec = recorded()
    keys = keys_of(store, range(20))
    store.write_full(keys[:3], random_blocks(3), owner="t1").result()
    store.write_full(keys, random_blocks(5), owner="t2").result()  # shares t1's first three
    store.pin(keys[4:])
    assert store.release("t1").result() == 0  # t2 still claims them
    assert rec.events == [stored(store, keys[:3]), stored(store, keys[3:])]
    assert store.release("t2").result() == 4
    (removed,) = rec.events[2:]
    assert removed.reason == "released" and sorted(removed.keys) == sorted(keys[:4])
    store.unpin(keys[4:]).result()  # the pinned one goes now, still as released
    assert rec.events[3:] == [BlockRemoved(keys=(keys[4],), reason="released")]


def test_a_corrupt_block_found_on_read_is_reported_removed(recorded, random_blocks):
    store, rec = recorded()
    keys = keys_of(store, range(12))
    store.write_full(keys, random_blocks(3)).result()
    data = bytearray(store._kv.read(key_path(keys[1])).result().value)
    data[-5] ^= 0xFF
    store._kv.write(key_path(keys[1]), bytes(data)).result()
    assert store.read_full(keys).result().hits == 1
    assert rec.events[1:] == [BlockRemoved(keys=(keys[1],), reason="corrupt")]
    assert store.lookup(keys).result() == 1  # a lookup of the removed block reports nothing
    assert len(rec.events) == 2


def test_a_failing_callback_costs_the_store_nothing(make_store, random_blocks):
    def boom(events):
        raise RuntimeError("subscriber went away")

    store = make_store(on_events=boom)
    keys = keys_of(store, range(8))
    assert store.write_full(keys, random_blocks(2)).result().written == 2
    assert store.delete(keys).result() == 2


def test_without_a_callback_nothing_is_reported_and_nothing_changes(store, random_blocks):
    keys = keys_of(store, range(8))
    assert store.write_full(keys, random_blocks(2)).result().written == 2
    assert store.release("nobody").result() == 0


# ----------------------------------------------------------------------------- schema

BATCH = EventBatch(
    v=EVENTS_VERSION,
    seq=7,
    ts=1_700_000_000.25,
    source="de1",
    events=(
        BlockRemoved(keys=("a" * 32,), reason="evicted"),
        BlockStored(keys=("b" * 32, "c" * 32), block_tokens=16, block_bytes=4096),
    ),
)


def test_a_batch_round_trips_as_plain_tagged_msgpack():
    frame = encode_batch(BATCH)
    assert decode_batch(frame) == BATCH
    plain = msgspec.msgpack.decode(frame)  # what a subscriber in any language sees
    assert plain == {
        "v": EVENTS_VERSION,
        "seq": 7,
        "ts": 1_700_000_000.25,
        "source": "de1",
        "events": [
            {"type": "BlockRemoved", "keys": ["a" * 32], "reason": "evicted", "medium": "store"},
            {
                "type": "BlockStored",
                "keys": ["b" * 32, "c" * 32],
                "block_tokens": 16,
                "block_bytes": 4096,
                "medium": "store",
            },
        ],
    }


@pytest.mark.parametrize(
    "frame, problem",
    [
        (encode_batch(msgspec.structs.replace(BATCH, v=EVENTS_VERSION + 1)), "version"),
        (b"\x93garbage", "malformed"),
        (msgspec.msgpack.encode({"v": 1, "seq": 0}), "malformed"),
    ],
    ids=["version", "garbage", "missing-fields"],
)
def test_other_versions_and_garbage_are_refused(frame, problem):
    with pytest.raises(EventFormatError, match=problem):
        decode_batch(frame)


def test_stored_blocks_is_the_prefix_index_of_the_events():
    index = StoredBlocks()
    keys = [f"{i:032x}" for i in range(4)]
    stored_ = BlockStored(keys=tuple(keys), block_tokens=16, block_bytes=1)
    index.apply(EventBatch(v=1, seq=0, ts=0.0, source="de1", events=(stored_,)))
    assert index.hit(keys) == 4 and index.where[keys[0]] == "de1" and len(index) == 4
    gone = BlockRemoved(keys=(keys[2], "f" * 32), reason="evicted")  # an unknown key is ignored
    index.apply(EventBatch(v=1, seq=1, ts=0.0, source="de1", events=(gone,)))
    assert index.hit(keys) == 2 and keys[3] in index and keys[2] not in index
