"""BlockIndex session retention: what goes first under capacity pressure, and when."""

from __future__ import annotations

import pytest

from dualpath_jax.kvstore import BlockIndex


def k(i: int) -> str:
    return f"{i:032x}"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def index(capacity_blocks: int, policy: str = "retention") -> tuple[BlockIndex, Clock]:
    clock = Clock()
    return BlockIndex(capacity_blocks * 10, policy, clock), clock


def write(idx: BlockIndex, owner: str, keys: list[str]) -> list[str]:
    """What a store's `write_full(keys, owner=owner)` does to its index; returns the evicted."""
    admitted, evicted = idx.admit(keys, 10)
    assert admitted == keys
    idx.claim(owner, keys)
    return evicted


def test_lru_policy_ignores_retention():
    idx, _ = index(4, "lru")
    idx.retain("a", "active")
    write(idx, "a", [k(0), k(1)])
    write(idx, "b", [k(2), k(3)])
    assert write(idx, "c", [k(4), k(5)]) == [k(1), k(0)]  # a's chain, oldest: tail first
    assert not idx.retained("a")


def test_an_idle_session_within_its_ttl_outlives_newer_unretained_blocks():
    idx, clock = index(4)
    write(idx, "a", [k(0), k(1)])
    idx.retain("a", "idle", ttl_s=30)
    write(idx, "b", [k(2), k(3)])  # b never said anything: plain LRU
    clock.now = 10
    assert write(idx, "c", [k(4), k(5)]) == [k(3), k(2)]
    assert idx.retained("a") and idx.retained_count == 2
    clock.now = 31  # a's tool call outlasted its TTL: its blocks go first now
    assert not idx.retained("a")
    assert idx.eviction_order()[:2] == [k(1), k(0)]
    assert write(idx, "d", [k(6)]) == [k(1)]


def test_once_retention_ends_or_expires_blocks_go_least_recently_used_first():
    idx, clock = index(6)
    write(idx, "old", [k(0), k(1)])
    idx.retain("a", "active")
    write(idx, "a", [k(2), k(3)])
    idx.retain("b", "idle", ttl_s=5)
    write(idx, "b", [k(4), k(5)])
    assert idx.eviction_order() == [k(1), k(0), k(5), k(4), k(3), k(2)]
    idx.retain("a", "ended")
    clock.now = 6  # b expired too: every block by its last use, each chain's tail first
    assert idx.eviction_order() == [k(1), k(0), k(3), k(2), k(5), k(4)]
    idx.touch([k(2), k(3)], 10)  # a later lookup of a's blocks (a shared prefix, say)
    assert idx.eviction_order() == [k(1), k(0), k(5), k(4), k(3), k(2)]


def test_with_only_retained_blocks_left_lowest_priority_then_idle_then_lru_go_first():
    idx, _ = index(6)
    idx.retain("hi", "idle", priority=2, ttl_s=100)
    write(idx, "hi", [k(0), k(1)])
    idx.retain("run", "active", priority=1)
    write(idx, "run", [k(2), k(3)])
    idx.retain("idle", "idle", priority=1, ttl_s=100)
    write(idx, "idle", [k(4), k(5)])
    assert idx.eviction_order() == [k(5), k(4), k(3), k(2), k(1), k(0)]
    idx.retain("new", "active", priority=3)
    assert write(idx, "new", [k(6), k(7), k(8)]) == [k(5), k(4), k(3)]


def test_a_shared_block_is_held_while_any_owner_is_retained():
    idx, clock = index(3)
    idx.retain("a", "idle", ttl_s=10)
    idx.retain("b", "idle", ttl_s=20)
    write(idx, "a", [k(0)])
    idx.claim("b", [k(0)])
    write(idx, "x", [k(1), k(2)])
    clock.now = 15  # a expired, b still holds the block
    assert write(idx, "y", [k(3)]) == [k(2)]
    clock.now = 25
    assert idx.eviction_order()[0] == k(0)


def test_a_new_round_renews_retention_and_claims_hold_later_writes():
    idx, clock = index(4)
    idx.retain("a", "idle", ttl_s=10)
    write(idx, "a", [k(0)])
    clock.now = 8
    idx.retain("a", "active")
    clock.now = 50  # an active round never expires
    assert idx.retained("a")
    write(idx, "a", [k(1)])  # claimed while retained: held at once
    idx.retain("a", "idle", ttl_s=10)
    write(idx, "x", [k(2), k(3)])
    assert write(idx, "y", [k(4), k(5)]) == [k(3), k(2)]
    clock.now = 61
    assert idx.eviction_order()[:2] == [k(0), k(1)]  # by last use: k(0) since t=0


def test_release_ends_retention_and_pins_still_win():
    idx, _ = index(2)
    idx.retain("a", "active")
    write(idx, "a", [k(0), k(1)])
    idx.pin([k(0), k(1)])
    assert idx.admit([k(2)], 10) == ([], [])  # pinned blocks are never evicted
    idx.unpin([k(0), k(1)])
    assert idx.admit([k(2)], 10) == ([k(2)], [k(1)])  # retained, but the only way to make room
    assert idx.release("a") == [k(0)]
    assert not idx.retained("a")


@pytest.mark.parametrize(
    "args, match",
    [(("a", "paused"), "retention state"), (("a", "idle", 0, -1.0), "ttl_s")],
)
def test_bad_retention_is_refused(args, match):
    idx, _ = index(2)
    with pytest.raises(ValueError, match=match):
        idx.retain(*args)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction policy"):
        BlockIndex(0, "fifo")


def test_a_pinned_block_keeps_its_place_in_the_eviction_order():
    idx, _ = index(3, "lru")
    write(idx, "x", [k(0)])
    write(idx, "y", [k(1)])
    write(idx, "z", [k(2)])
    idx.pin([k(0)])
    assert write(idx, "w", [k(3)]) == [k(1)]  # the oldest is pinned: the next goes
    idx.unpin([k(0)])
    assert idx.eviction_order() == [k(0), k(2), k(3)]
    assert write(idx, "v", [k(4)]) == [k(0)]


def test_a_long_run_of_sessions_leaves_no_bookkeeping_behind():
    """Sessions whose blocks were all evicted, and idle ones without a TTL, are forgotten: a
    server that runs for days keeps per-owner state only for blocks it still stores."""
    idx, clock = index(4)
    for i in range(200):
        owner = f"s{i}"
        idx.retain(owner, "active")
        write(idx, owner, [k(2 * i), k(2 * i + 1)])
        idx.retain(owner, "idle", ttl_s=0)
        clock.now += 1
    assert idx.retained_count == 0
    assert not idx._retention  # noqa: SLF001 - the bookkeeping under test
    assert set(idx._owned) == {"s198", "s199"}  # noqa: SLF001 - only owners of stored blocks
