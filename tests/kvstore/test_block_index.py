"""BlockIndex: LRU order, admission under capacity, pins and trajectory ownership."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_jax.kvstore import BlockIndex


def k(i: int) -> str:
    return f"{i:032x}"


def test_touch_keeps_a_chain_prefix_most_recent():
    idx = BlockIndex()
    idx.touch([k(0), k(1), k(2)], 10)
    assert idx.lru_order() == [k(2), k(1), k(0)]
    assert idx.blocks == 3 and idx.used_bytes == 30
    idx.touch([k(2)], 10)
    assert idx.lru_order() == [k(1), k(0), k(2)]


def test_admit_evicts_lru_and_rejects_what_cannot_fit():
    idx = BlockIndex(capacity_bytes=40)
    assert idx.admit([k(0), k(1), k(2)], 10) == ([k(0), k(1), k(2)], [])
    admitted, evicted = idx.admit([k(3), k(4)], 10)
    assert admitted == [k(3), k(4)] and evicted == [k(2)]  # the oldest chain's tail
    idx.pin(idx.lru_order())
    assert idx.admit([k(5)], 10) == ([], [])
    assert idx.used_bytes == 40


def test_admit_takes_the_longest_prefix_that_fits():
    idx = BlockIndex(capacity_bytes=30)
    idx.touch([k(9)], 10)
    idx.pin([k(9)])
    admitted, evicted = idx.admit([k(0), k(1), k(2), k(3)], 10)
    assert admitted == [k(0), k(1)] and evicted == []


def test_unpin_of_an_unpinned_key_is_an_error():
    idx = BlockIndex()
    with pytest.raises(ValueError):
        idx.unpin([k(0)])


def test_doom_waits_for_the_last_pin():
    idx = BlockIndex()
    idx.touch([k(0), k(1)], 5)
    idx.pin([k(0)])
    idx.pin([k(0)])
    assert idx.doom([k(0), k(1)]) == [k(1)]
    assert idx.unpin([k(0)]) == []
    assert k(0) in idx
    assert idx.unpin([k(0)]) == [k(0)]
    assert idx.blocks == 0 and idx.used_bytes == 0


def test_a_deferred_deletion_keeps_the_reason_it_was_doomed_for():
    idx = BlockIndex()
    idx.touch([k(0), k(1), k(2)], 5)
    idx.pin([k(0), k(1), k(2)])
    idx.claim("t1", [k(1)])
    assert idx.doom([k(0)]) == [] and idx.release("t1") == []
    assert idx.doom([k(1)], "corrupt") == []  # doomed already: the first reason stands
    assert idx.unpin_doomed([k(2), k(1), k(0)]) == [(k(1), "released"), (k(0), "deleted")]
    assert idx.blocks == 1


def test_release_keeps_keys_another_owner_claims():
    idx = BlockIndex()
    idx.touch([k(i) for i in range(4)], 1)
    idx.claim("a", [k(0), k(1), k(2)])
    idx.claim("b", [k(0), k(3)])
    assert sorted(idx.release("a")) == [k(1), k(2)]
    assert idx.owned_by("a") == set() and idx.owned_by("b") == {k(0), k(3)}
    assert sorted(idx.release("b")) == [k(0), k(3)]
    assert idx.release("unknown") == []


def test_disown_forgets_an_owner_and_keeps_its_keys():
    idx = BlockIndex(policy="retention")
    idx.touch([k(i) for i in range(3)], 1)
    idx.claim("b", [k(0)])
    base = idx.claims()
    for n in range(200):  # many sessions come and go: the claims return to where they were
        idx.claim(f"s{n}", [k(0), k(1), k(2)])
        idx.retain(f"s{n}", "idle", ttl_s=60.0)
        idx.disown(f"s{n}")
    assert idx.claims() == base == 1 and idx.retained_count == 0
    assert idx.blocks == 3 and idx.owned_by("b") == {k(0)}
    assert idx.release("b") == [k(0)]  # b was the last owner of k(0); k(1), k(2) unclaimed


def test_random_operations_keep_the_invariants():
    rng = np.random.default_rng(0)
    idx = BlockIndex(capacity_bytes=50)
    pins: dict[str, int] = {}
    for _ in range(2000):
        op = rng.integers(4)
        key = k(int(rng.integers(30)))
        if op == 0:
            idx.admit([key, k(int(rng.integers(30)))], 10)
        elif op == 1:
            idx.pin([key])
            pins[key] = pins.get(key, 0) + 1
        elif op == 2 and pins:
            key = list(pins)[rng.integers(len(pins))]
            idx.unpin([key])
            pins[key] -= 1
            if not pins[key]:
                del pins[key]
        else:
            idx.touch([key], 10)
        assert idx.used_bytes == 10 * idx.blocks
        assert all(idx.pinned(p) for p in pins)
        # Admission never evicts a pinned key: any pinned key that was indexed stays indexed.
        if op == 0:
            assert idx.used_bytes <= 50 or all(idx.pinned(x) for x in idx.lru_order())


def test_a_view_that_only_reads_remembers_at_most_its_capacity():
    # A process that never writes (the router's lookups, a prefill engine's reads) sees ever new
    # blocks on a shared root: past its capacity the least recently seen are forgotten.
    idx = BlockIndex(capacity_bytes=40)
    for n in range(0, 1000, 2):
        idx.touch([k(n), k(n + 1)], 10)
        assert idx.used_bytes <= 40 and idx.blocks <= 4
    assert idx.lru_order() == [k(997), k(996), k(999), k(998)]


def test_forgetting_a_seen_key_deletes_nothing_and_keeps_its_claims_and_pins():
    idx = BlockIndex(capacity_bytes=20)
    idx.touch([k(0)], 10)
    idx.claim("s", [k(0)])
    idx.pin([k(0)])
    idx.touch([k(1), k(2)], 10)  # k(0) is forgotten, not evicted (nothing to delete)
    assert k(0) not in idx and idx.blocks == 2
    assert idx.owned_by("s") == {k(0)} and idx.pinned(k(0))
    assert idx.unpin([k(0)]) == []
    assert idx.release("s") == [k(0)]  # still the session's to delete
    idx.touch([k(0)], 10)  # seen again: back in the view, the oldest seen key forgotten
    assert k(0) in idx and idx.blocks == 2


def test_written_and_found_keys_are_evicted_not_forgotten():
    idx = BlockIndex(capacity_bytes=30)
    idx.touch([k(0), k(1)], 10, found=True)  # listed at open: this process's to evict
    assert idx.admit([k(2)], 10) == ([k(2)], [])
    idx.touch([k(3)], 10)  # a seen key over capacity: forgotten at once
    assert k(3) not in idx and idx.blocks == 3
    admitted, evicted = idx.admit([k(4)], 10)
    assert admitted == [k(4)] and evicted == [k(1)]  # the found chain's tail, deleted


def test_seen_keys_admission_and_eviction_keep_the_invariants():
    rng = np.random.default_rng(1)
    idx = BlockIndex(capacity_bytes=50, policy="retention")
    for _ in range(3000):
        op = rng.integers(5)
        key = k(int(rng.integers(60)))
        if op == 0:
            idx.admit([key], 10)
        elif op == 1:
            idx.touch([key, k(int(rng.integers(60)))], 10)
        elif op == 2:
            idx.claim(f"s{rng.integers(4)}", [key])
        elif op == 3:
            idx.retain(f"s{rng.integers(4)}", "idle", ttl_s=10.0)
        else:
            idx.disown(f"s{rng.integers(4)}")
        assert idx.used_bytes == 10 * idx.blocks <= 50
        assert set(idx.eviction_order()) <= set(idx.lru_order())
