"""BlockStore conformance: one suite run against the file, memory and raw-spec stores."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.kvstore import (
    BlockReadResult,
    DestinationKind,
    DeviceDestination,
    HostBufferPool,
    HostDestination,
    InvalidBlockKey,
    PinnedDestination,
    UnsupportedDestination,
    WriteReport,
    block_keys,
    buffer_destination,
)
from dualpath_jax.kvstore.identity import key_path

BT = 4  # tokens per block in the fixtures' layout


def keys_of(store, tokens):
    return block_keys(tokens, BT, store.fmt.fingerprint)


def put_raw(store, key, data: bytes) -> None:
    """Overwrites a stored value with raw bytes, bypassing the codec (simulated damage)."""
    store._kv.write(key_path(key), data).result()


def get_raw(store, key) -> bytes:
    return store._kv.read(key_path(key)).result().value


def test_write_then_read_full(store, random_blocks):
    keys = keys_of(store, range(20))
    blocks = random_blocks(5)
    assert store.lookup(keys).result() == 0
    assert store.write_full(keys, blocks).result() == WriteReport(5, 0, 0)
    assert store.lookup(keys).result() == 5
    res = store.read_full(keys).result()
    assert isinstance(res, BlockReadResult) and res.hits == 5 and res.miss_reason == ""
    np.testing.assert_array_equal(res.stack(), blocks)


def test_write_is_idempotent(store, random_blocks):
    keys = keys_of(store, range(12))
    blocks = random_blocks(3)
    store.write_full(keys, blocks).result()
    before = [get_raw(store, k) for k in keys]
    # Same keys again (even with other bytes): kept as stored, reported as existing.
    assert store.write_full(keys, random_blocks(3, seed=9)).result() == WriteReport(0, 3, 0)
    assert [get_raw(store, k) for k in keys] == before
    st = store.stats()
    assert (st.writes, st.write_existed, st.blocks) == (3, 3, 3)


def test_lookup_matches_brute_force(store, random_blocks):
    """Random trajectories over a tiny vocabulary (many shared prefixes), partly stored."""
    rng = np.random.default_rng(1)
    stored: list[np.ndarray] = []  # token sequences whose full blocks were written
    trajs: list[np.ndarray] = []
    for t in range(30):
        if trajs and rng.random() < 0.7:  # branch off an earlier trajectory's prefix
            base = trajs[rng.integers(len(trajs))]
            toks = np.concatenate(
                [base[: rng.integers(0, len(base) + 1)], rng.integers(0, 3, rng.integers(0, 14))]
            )
        else:
            toks = rng.integers(0, 3, rng.integers(0, 30))
        trajs.append(toks)
        if rng.random() < 0.6:
            part = toks[: rng.integers(0, len(toks) + 1)]
            keys = keys_of(store, part)
            store.write_full(keys, random_blocks(len(keys), seed=t)).result()
            stored.append(part)

    def brute(q: np.ndarray) -> int:
        best = 0
        for s in stored:
            n = min(len(q), len(s))
            diff = np.nonzero(q[:n] != s[:n])[0]
            lcp = int(diff[0]) if diff.size else n
            best = max(best, min(lcp // BT, len(s) // BT))
        return best

    queries = trajs + [rng.integers(0, 3, rng.integers(0, 40)) for _ in range(20)]
    for q in queries:
        keys = keys_of(store, q)
        assert store.lookup(keys).result() == brute(q)
        assert store.read_full(keys).result().hits == brute(q)


def test_layer_reads_equal_slices_of_full_reads(store, random_blocks):
    keys = keys_of(store, range(24))
    store.write_full(keys, random_blocks(6, seed=2)).result()
    full = store.read_full(keys).result().stack()
    n = store.fmt.layout.num_layers
    for start in range(n):
        for stop in range(start + 1, n + 1):
            res = store.read_layers(keys, (start, stop)).result()
            assert res.hits == 6
            np.testing.assert_array_equal(res.stack(), full[:, start:stop])
    st = store.stats()
    assert st.reads == 6 and st.layer_reads == 6 * n * (n + 1) // 2


def test_reads_into_host_buffer(store, random_blocks, fmt):
    keys = keys_of(store, range(16))
    blocks = random_blocks(4, seed=5)
    store.write_full(keys, blocks).result()
    pool = HostBufferPool(fmt.layout, 6, "PE buffer", memory="pageable")
    with pool.reserve(4) as res:
        got = store.read_full(keys, HostDestination(res.blocks())).result()
        assert got.hits == 4
        for i in range(4):
            np.testing.assert_array_equal(res.block(i), blocks[i])
            assert np.shares_memory(got.blocks[i], pool.slab)
        out = np.zeros((4, 1, *fmt.layout.shape[1:]), np.uint8)
        assert store.read_layers(keys, (2, 3), HostDestination(out)).result().hits == 4
        np.testing.assert_array_equal(out, blocks[:, 2:3])


@pytest.mark.parametrize("memory", ["pinned_host", "pageable"])
def test_reads_into_buffer_slots_equal_reads_into_numpy(store, random_blocks, fmt, memory):
    """Whole blocks and every layer range, read into a PE buffer's slots (from slot 1 on), are
    the bytes a read into new numpy arrays gets, and land in the slots in place."""
    keys = keys_of(store, range(16))
    store.write_full(keys, random_blocks(4, seed=5)).result()
    host = store.read_full(keys).result().stack()
    pool = HostBufferPool(fmt.layout, 6, "PE buffer", memory=memory)
    with pool.reserve(6) as res:
        dest = buffer_destination(res, first=1)
        assert type(dest) is (PinnedDestination if memory == "pinned_host" else HostDestination)
        got = store.read_full(keys, dest).result()
        assert got.hits == 4
        for i in range(4):
            assert res.block(1 + i).tobytes() == host[i].tobytes()
            assert np.shares_memory(got.blocks[i], res.block(1 + i))
        n = fmt.layout.num_layers
        for start in range(n):
            for stop in range(start + 1, n + 1):
                for i in range(6):
                    res.block(i)[...] = 0xAB  # what a layer read must leave alone
                want = store.read_layers(keys, (start, stop)).result().stack()
                got = store.read_layers(keys, (start, stop), buffer_destination(res, 1)).result()
                assert got.hits == 4
                for i in range(4):
                    slot = res.block(1 + i)
                    assert slot[start:stop].tobytes() == want[i].tobytes()
                    assert np.shares_memory(got.blocks[i], slot)
                    rest = np.concatenate([slot[:start], slot[stop:]])
                    assert (rest == 0xAB).all()
                assert (res.block(0) == 0xAB).all() and (res.block(5) == 0xAB).all()


def test_device_destination_is_refused_before_any_io(store, random_blocks, fmt):
    keys = keys_of(store, range(8))
    store.write_full(keys, random_blocks(2)).result()
    assert store.read_destinations == {DestinationKind.HOST, DestinationKind.PINNED}
    lay = fmt.layout
    pages = jnp.zeros((lay.num_layers, 4, lay.block_tokens, lay.bytes_per_token_per_layer))
    dest = DeviceDestination(pages.astype(jnp.uint8), (2, 3))
    before = store.stats()
    with pytest.raises(UnsupportedDestination, match="not supported by this store"):
        store.read_full(keys, dest)
    with pytest.raises(UnsupportedDestination, match="not supported by this store"):
        store.read_layers(keys, (0, 1), dest)
    assert store.stats() == before


def test_bad_destinations(store, random_blocks, fmt):
    keys = keys_of(store, range(12))
    store.write_full(keys, random_blocks(3)).result()
    pinned = HostBufferPool(fmt.layout, 4, "DE buffer")
    pageable = HostBufferPool(fmt.layout, 4, "DE buffer", memory="pageable")
    with pinned.reserve(4) as res, pageable.reserve(4) as flat:
        with pytest.raises(ValueError):  # blocks [2, 5) of a reservation of 4
            store.read_full(keys, PinnedDestination(res, first=2))
        with pytest.raises(ValueError, match="pageable"):
            PinnedDestination(flat)
        read_only = np.zeros(fmt.layout.shape, np.uint8)
        read_only.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            store.read_full(keys[:1], HostDestination([read_only]))
    other = HostBufferPool(dataclasses.replace(fmt.layout, num_layers=2), 3, "PE buffer")
    with other.reserve(3) as res, pytest.raises(ValueError):
        store.read_full(keys, PinnedDestination(res))
    lay = fmt.layout
    with pytest.raises(ValueError):  # a page id past the pages
        DeviceDestination(jnp.zeros((lay.num_layers, 2, *lay.shape[1:]), jnp.uint8), (2,))


def test_missing_block_ends_the_hit_run(store, random_blocks):
    keys = keys_of(store, range(20))
    blocks = random_blocks(5)
    store.write_full(keys[:2] + keys[3:], np.concatenate([blocks[:2], blocks[3:]])).result()
    assert store.lookup(keys).result() == 2
    res = store.read_full(keys).result()
    assert (res.hits, res.miss_reason) == (2, "missing")
    np.testing.assert_array_equal(res.stack(), blocks[:2])
    assert store.read_layers(keys, (0, 1)).result().hits == 2


def test_corrupt_payload_is_a_miss_from_that_block_on(store, random_blocks):
    keys = keys_of(store, range(20))
    store.write_full(keys, random_blocks(5)).result()
    data = bytearray(get_raw(store, keys[2]))
    data[-20] ^= 0xFF  # inside the last layer record
    put_raw(store, keys[2], bytes(data))
    assert store.lookup(keys).result() == 5  # headers only: the payload is checked on read
    res = store.read_full(keys).result()
    assert res.hits == 2 and res.miss_reason.startswith("corrupt")
    st = store.stats()
    assert st.checksum_failures == 1
    # The bad block was removed, so lookups stop there and a rewrite repairs it.
    assert store.lookup(keys).result() == 2
    fresh = random_blocks(1, seed=7)
    assert store.write_full(keys[2:3], fresh).result().written == 1
    assert store.read_full(keys).result().hits == 5


def test_corrupt_layer_range(store, random_blocks):
    keys = keys_of(store, range(8))
    blocks = random_blocks(2)
    store.write_full(keys, blocks).result()
    data = bytearray(get_raw(store, keys[0]))
    lo, _ = store.fmt.layer_byte_range(1, 2)
    data[lo] ^= 1
    put_raw(store, keys[0], bytes(data))
    # Layer 2 of block 0 is intact and verifies on its own; layer 1 does not.
    assert store.read_layers(keys, (2, 3)).result().hits == 2
    res = store.read_layers(keys, (0, 2)).result()
    assert res.hits == 0 and "layer 1" in res.miss_reason
    assert store.stats().checksum_failures == 1


@pytest.mark.parametrize("cut", [10, 200, -1])
def test_truncated_block(store, random_blocks, cut):
    keys = keys_of(store, range(12))
    store.write_full(keys, random_blocks(3)).result()
    put_raw(store, keys[1], get_raw(store, keys[1])[:cut])
    n = store.fmt.layout.num_layers
    assert store.read_layers(keys, (n - 1, n)).result().hits == 1
    assert store.stats().checksum_failures == 1
    assert store.read_full(keys).result().hits == 1


def test_block_shorter_than_a_header(store, random_blocks):
    keys = keys_of(store, range(8))
    store.write_full(keys, random_blocks(2)).result()
    put_raw(store, keys[1], b"\x00" * 7)
    assert store.lookup(keys).result() == 1
    assert store.stats().checksum_failures == 1
    res = store.read_full(keys).result()
    assert res.hits == 1 and res.miss_reason.startswith("corrupt")


def test_block_of_another_model_is_a_miss(store, random_blocks, fmt):
    from dualpath_jax.kvstore import encode_block

    keys = keys_of(store, range(8))
    store.write_full(keys[:1], random_blocks(1)).result()
    other = dataclasses.replace(fmt, fingerprint="0" * 32)
    put_raw(store, keys[1], encode_block(other, keys[1], random_blocks(1)[0]))
    assert store.lookup(keys).result() == 1
    assert store.stats().checksum_failures == 1


def test_delete(store, random_blocks):
    keys = keys_of(store, range(16))
    store.write_full(keys, random_blocks(4)).result()
    assert store.delete(keys[1:2]).result() == 1
    assert store.lookup(keys).result() == 1
    assert store.stats().blocks == 3 and store.stats().deletes == 1


def test_pinned_block_outlives_delete_until_unpinned(store, random_blocks):
    keys = keys_of(store, range(8))
    store.write_full(keys, random_blocks(2)).result()
    with store.pinned(keys):
        assert store.stats().pinned == 2
        assert store.delete(keys).result() == 0
        assert store.read_full(keys).result().hits == 2
    assert store.lookup(keys).result() == 0


def test_capacity_eviction_never_takes_pinned_blocks(make_store, random_blocks, fmt):
    store = make_store(capacity_bytes=5 * fmt.encoded_bytes)
    a = keys_of(store, [1] * 20)
    b = keys_of(store, [2] * 12)
    store.write_full(a, random_blocks(5, seed=1)).result()
    store.pin(a)
    # Every stored block is pinned: nothing fits, nothing is evicted.
    assert store.write_full(b, random_blocks(3, seed=2)).result() == WriteReport(0, 0, 3)
    assert store.lookup(a).result() == 5 and store.lookup(b).result() == 0
    store.unpin(a).result()
    store.pin(a[:2])
    assert store.write_full(b, random_blocks(3, seed=2)).result() == WriteReport(3, 0, 0)
    # The tail of chain a went first; its pinned prefix stayed.
    assert store.lookup(a).result() == 2 and store.lookup(b).result() == 3
    st = store.stats()
    assert st.evictions == 3 and st.bytes <= st.capacity_bytes and st.write_rejected == 3


def test_random_pins_and_writes_respect_capacity(make_store, random_blocks, fmt):
    store = make_store(capacity_bytes=6 * fmt.encoded_bytes)
    rng = np.random.default_rng(4)
    pins: list[list[str]] = []
    for step in range(40):
        toks = rng.integers(0, 4, rng.integers(4, 20))
        keys = keys_of(store, toks)
        store.write_full(keys, random_blocks(len(keys), seed=step)).result()
        hit = store.lookup(keys).result()
        if hit and rng.random() < 0.5 and sum(map(len, pins)) < 4:
            store.pin(keys[:1])
            pins.append(keys[:1])
        if pins and rng.random() < 0.3:
            store.unpin(pins.pop(rng.integers(len(pins)))).result()
        for p in pins:
            assert store.lookup(p).result() == 1, "a pinned block was evicted"
        assert store.stats().bytes <= store.stats().capacity_bytes


def test_release_of_a_trajectory(store, random_blocks):
    prefix = list(range(8))
    t1 = keys_of(store, prefix + [100] * 8)
    t2 = keys_of(store, prefix + [200] * 8)
    store.write_full(t1, random_blocks(4, seed=1), owner="t1").result()
    # t2 found the shared prefix stored, claims it, and writes only its own blocks.
    assert store.lookup(t2).result() == 2
    store.claim("t2", t2[:2])
    store.write_full(t2[2:], random_blocks(2, seed=2), owner="t2").result()
    assert store.release("t1").result() == 2  # only t1's own tail
    assert store.lookup(t1).result() == 2 and store.lookup(t2).result() == 4
    store.pin(t2[3:])
    assert store.release("t2").result() == 3  # the pinned block waits for its unpin
    assert store.lookup(t2[3:]).result() == 1
    assert store.unpin(t2[3:]).result() == 1
    assert store.lookup(t2).result() == 0 and store.stats().blocks == 0


def test_invalid_keys_never_reach_the_store(store, random_blocks):
    for bad in ["../../etc/passwd", "AB" * 16, "ab/" + "0" * 29]:
        with pytest.raises(InvalidBlockKey):
            store.read_full([bad])
        with pytest.raises(InvalidBlockKey):
            store.write_full([bad], random_blocks(1))
        with pytest.raises(InvalidBlockKey):
            store.lookup([bad])


def test_bad_arguments(store, random_blocks):
    keys = keys_of(store, range(8))
    with pytest.raises(ValueError):
        store.write_full(keys, random_blocks(1))
    with pytest.raises(ValueError):
        store.write_full(keys[:1], random_blocks(1)[:, :2])
    with pytest.raises(IndexError):
        store.read_layers(keys, (0, 9))
    with pytest.raises(ValueError):
        store.read_full(keys, HostDestination(np.zeros((2, 1, 1, 1), np.uint8)))


def test_concurrent_batches(store, random_blocks):
    chains = [keys_of(store, [i] * 32) for i in range(8)]
    blocks = [random_blocks(8, seed=i) for i in range(8)]
    writes = [store.write_full(k, b) for k, b in zip(chains, blocks)]
    assert all(w.result().written == 8 for w in writes)
    reads = [store.read_full(k) for k in chains]
    for r, b in zip(reads, blocks):
        np.testing.assert_array_equal(r.result().stack(), b)
