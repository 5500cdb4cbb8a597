"""Tool-gap prefetch decisions (`sched.prefetch`): where and how much, the DRAM budget, eviction,
cancellation of a gap that runs long, routing affinity and the held blocks of the next turn."""

from __future__ import annotations

import pytest

from dualpath_jax.config import Policy
from dualpath_jax.sched.inter import assign_paths
from dualpath_jax.sched.prefetch import (
    Held,
    PrefetchRule,
    expired,
    hold_until,
    honor_affinity,
    make_room,
    pe_pin_wins,
    plan_prefetch,
    prefetch_sides,
)
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import EngineLoad, ReadPath, Request

RULE = PrefetchRule(budget_bytes=1000, min_gap_s=1.0, hold_factor=2.0, affinity_slack=0.5)


def plan(hit_blocks=4, expected_s=10.0, held=(), tok=None, now=0.0, rule=RULE, **kw):
    return plan_prefetch(
        rule,
        hit_blocks=hit_blocks,
        block_bytes=100,
        expected_s=expected_s,
        now=now,
        group_tok=tok if tok is not None else {0: 50, 1: 20},
        group_node={0: 10, 1: 11},
        held=list(held),
        **kw,
    )


def test_prefetch_goes_to_the_least_loaded_group_and_needs_a_hit_and_a_long_enough_gap():
    d = plan()
    assert (d.group, d.node, d.blocks, d.evict) == (1, 11, 4, ())
    assert plan(hit_blocks=0) is None
    assert plan(expected_s=0.5) is None  # shorter than min_gap_s
    assert plan(expected_s=float("inf")) is None
    assert plan(tok={}) is None


def test_the_budget_bounds_the_blocks_and_eviction_makes_room():
    assert plan(hit_blocks=50).blocks == 10  # 1000 B of 100 B blocks
    full = [Held("a", 11, 600, 0.0, 30.0), Held("b", 11, 300, 0.0, 5.0), Held("c", 10, 900, 0, 1)]
    # 100 B free on node 11: "a" (needed at 30 s, after the new one's 10 s) goes; "b" (5 s) stays
    assert plan(held=full).evict == ("a",)
    # nothing needed later than the new one: refused
    assert plan(held=[Held("b", 11, 900, 0.0, 5.0)]) is None


def test_make_room_evicts_overdue_first_then_the_one_needed_last():
    held = [
        Held("late", 0, 400, 0.0, 50.0),
        Held("over", 0, 400, 0.0, 2.0),
        Held("soon", 0, 100, 0, 8),
    ]
    assert make_room(held, 100, 1000, now=5.0, due_s=10.0) == ()
    assert make_room(held, 300, 1000, now=5.0, due_s=10.0) == ("over",)
    assert make_room(held, 700, 1000, now=5.0, due_s=10.0) == ("over", "late")
    assert make_room(held, 1000, 1000, now=5.0, due_s=10.0) is None  # "soon" is needed first
    assert make_room([], 1001, 1000, now=0.0, due_s=1.0) is None
    in_use = [Held("over", 0, 900, 0.0, 2.0, in_use=True)]  # its turn came: never evicted
    assert make_room(in_use, 200, 1000, now=5.0, due_s=10.0) is None


def test_a_gap_that_runs_long_expires():
    h = Held("s", 0, 100, started_s=10.0, due_s=15.0)  # expected 5 s, hold factor 2
    assert not expired(h, 19.9, RULE)
    assert expired(h, 20.1, RULE)
    short = Held("s", 0, 100, started_s=0.0, due_s=0.1)  # held at least min_gap_s x factor
    assert not expired(short, 1.9, RULE) and expired(short, 2.1, RULE)
    assert hold_until(h, RULE) == 20.0
    assert not expired(Held("s", 0, 100, 10.0, 15.0, in_use=True), 99.0, RULE)


def test_affinity_holds_unless_the_group_is_far_above_the_mean():
    assert honor_affinity(0, {0: 100, 1: 100}, 10, 0.5)
    assert not honor_affinity(0, {0: 1000, 1: 0}, 10, 0.5)
    assert not honor_affinity(2, {0: 0, 1: 0}, 10, 0.5)


def req(traj: str, cached=640, prompt=1000) -> Request:
    return Request(f"{traj}/r1", traj, 1, prompt, cached, 8)


def test_held_blocks_read_on_the_de_side_from_memory_and_only_the_rest_is_queued():
    pairs = [(req("s"), 0, 5), (req("t"), 0, 5)]
    out, q = assign_paths(
        pairs, {0: 1}, {5: 2}, {1: 0, 2: 0}, mode="shorter", block_tokens=64,
        held={"s": (2, 7, ReadPath.DE), "t": (3, 10, ReadPath.DE)},  # t's: another node
    )  # fmt: skip
    s, t = out
    assert (s.path, s.pe_read_blocks, s.de_read_blocks, s.held_blocks) == (ReadPath.DE, 0, 10, 7)
    assert t.held_blocks == 0 and t.path is ReadPath.PE  # by queue, as without a prefetch
    assert q == {1: 640, 2: 640 - 7 * 64}


def test_the_scheduler_routes_a_held_session_to_its_group_and_reads_it_from_memory():
    s = GlobalScheduler(Policy.DUALPATH, block_tokens=64)
    des = [EngineLoad(10 + g, 20 + g, g, free_hbm_tokens=10**6) for g in range(2)]
    s.report(des, "de")
    s.report([EngineLoad(0, 1, 0)], "pe")
    assert s.group_totals() == {0: 0, 1: 0} and s.de_group_nodes() == {0: 20, 1: 21}
    s.hold("sess", 1, 21, 10)  # group 1 is no lighter than group 0: affinity decides
    s.submit(req("sess"))
    assert s.route_de() == ((req("sess"), 1),)
    assert s.fetch_de(1, [des[1]])
    (a,) = s.fetch_pe(0, [EngineLoad(0, 1, 0)])
    assert (a.de, a.path, a.held_blocks) == (11, ReadPath.DE, 10)
    s.drop("sess")
    s.submit(req("sess"))
    assert s.route_de()[0][1] == 0  # dropped: by totals (group 1 has the first turn)


def test_the_side_follows_the_policy_and_the_read_queues():
    assert [prefetch_sides(m) for m in ("pe", "shorter", "alternate", "split", "none")] == [
        "pe", "shorter", "shorter", "shorter", "",
    ]  # fmt: skip
    pes = {1: 300, 2: 100}  # PE node -> tokens
    d = plan(pe_node_tok=pes, sides="pe")  # the shortest read queue, then the least tokens
    assert (d.side, d.group, d.node, d.blocks) == (ReadPath.PE, -1, 2, 4)
    assert plan(pe_node_tok=pes, read_q={2: 30}, sides="pe").node == 1
    assert plan(pe_node_tok={}, sides="pe") is None  # no PE can take the turn
    # "shorter": the DE node (11) unless the PE node's (2) read queue is shorter; ties to DE
    q = {11: 50, 1: 80}
    assert plan(pe_node_tok=pes, read_q={**q, 2: 50}, sides="shorter").side is ReadPath.DE
    assert plan(pe_node_tok=pes, read_q={**q, 2: 10}, sides="shorter").node == 2
    assert plan(pe_node_tok=pes, read_q={2: 10}, sides="de").node == 11
    # pinning a turn to its PE node: only when its read there is no longer than elsewhere
    assert pe_pin_wins(2, pes, {1: 0, 2: 0}, 640, 0, 64)  # equal queues: no loss
    assert not pe_pin_wins(2, pes, {1: 0, 2: 100}, 640, 0, 64)  # nothing held, longer queue
    assert pe_pin_wins(2, pes, {1: 0, 2: 100}, 640, 2, 64)  # 128 held tokens outweigh it
    assert pe_pin_wins(2, {2: 0}, {2: 10**6}, 640, 0, 64)  # no other PE node
    # no room on the chosen node: the other side
    full = [Held("x", 2, 1000, 0.0, 5.0)]
    assert plan(pe_node_tok=pes, read_q={11: 50}, held=full, sides="shorter").node == 11
    assert plan(pe_node_tok=pes, held=full, sides="pe") is None
    with pytest.raises(ValueError, match="sides"):
        plan(sides="both")


def test_held_blocks_on_the_pe_side_are_read_from_the_pe_nodes_memory():
    pairs = [(req("s"), 0, 5), (req("t"), 0, 5), (req("u"), 0, 5)]
    held = {"s": (1, 7, ReadPath.PE), "t": (3, 10, ReadPath.PE), "u": (2, 4, ReadPath.DE)}
    for mode in ("pe", "shorter", "split", "alternate"):
        out, q = assign_paths(
            pairs, {0: 1}, {5: 2}, {1: 0, 2: 0}, mode=mode, block_tokens=64, held=held
        )
        s, t, u = out
        assert (s.path, s.pe_read_blocks, s.de_read_blocks, s.held_blocks) == (
            ReadPath.PE, 10, 0, 7,
        )  # fmt: skip
        assert t.held_blocks == 0  # its prefetch sits on another PE node
        # a DE-side hold counts only where the mode reads on the DE side
        assert u.held_blocks == (0 if mode == "pe" else 4)
        if mode == "pe":
            assert q == {1: 640 - 7 * 64 + 640 + 640, 2: 0}
    out, _ = assign_paths(pairs, {0: 1}, {5: 2}, {}, mode="none", block_tokens=64, held=held)
    assert all(a.held_blocks == 0 and a.path is ReadPath.NONE for a in out)


def pe_sched(policy=Policy.BASIC):
    """Two PE nodes (1, 2; one PE each, its own group) and one DE."""
    s = GlobalScheduler(policy, block_tokens=64)
    s.report([EngineLoad(10, 20, 0, free_hbm_tokens=10**6)], "de")
    s.report([EngineLoad(0, 1, 0), EngineLoad(1, 2, 1)], "pe")
    return s


def test_a_turn_held_on_a_pe_node_waits_for_that_nodes_pe_and_reads_from_memory():
    s = pe_sched()
    de = [EngineLoad(10, 20, 0, free_hbm_tokens=10**6)]
    s.hold("sess", -1, 2, 10, ReadPath.PE)
    s.submit(req("sess"))
    s.submit(req("other"))
    assert len(s.fetch_de(0, de)) == 2
    assert s.queued() == {"de_global": 0, "de_private": 0, "pe_waiting": 1, "pe_pinned": 1}
    assert s.pe_queued() == 2 and len(s) == 2
    # the PE of node 1 fetches first: it takes the other turn, not the pinned one
    (a,) = s.fetch_pe(0, [EngineLoad(0, 1, 0)])
    assert a.request.trajectory == "other" and a.held_blocks == 0
    (b,) = s.fetch_pe(1, [EngineLoad(1, 2, 1)])
    assert (b.request.trajectory, b.pe, b.path, b.pe_read_blocks, b.held_blocks) == (
        "sess", 1, ReadPath.PE, 10, 10,
    )  # fmt: skip
    assert len(s) == 0


def test_a_pe_pin_gives_way_to_load_and_to_a_dead_node():
    s = pe_sched()
    de = [EngineLoad(10, 20, 0, free_hbm_tokens=10**6)]
    s.report([EngineLoad(1, 2, 1, tok_e=10**6)], "pe")  # node 2 is far above the mean
    s.hold("sess", -1, 2, 10, ReadPath.PE)
    s.submit(req("sess"))
    s.fetch_de(0, de)
    assert s.queued()["pe_pinned"] == 0  # affinity given up: the shared queue
    (a,) = s.fetch_pe(0, [EngineLoad(0, 1, 0)])
    assert a.held_blocks == 0 and a.pe == 0
    # pinned, then its node's only PE dies: back to the shared queue, ahead of later turns
    s = pe_sched()
    s.hold("sess", -1, 2, 10, ReadPath.PE)
    s.submit(req("sess"))
    s.fetch_de(0, de)
    s.submit(req("later"))
    s.fetch_de(0, de)
    assert s.queued()["pe_pinned"] == 1
    s.remove_engines([1])
    assert s.queued()["pe_pinned"] == 0 and s.pe_queued() == 2
    a, b = s.fetch_pe(0, [EngineLoad(0, 1, 0)])
    assert [a.request.trajectory, b.request.trajectory] == ["sess", "later"]
    # a pinned turn withdrawn (cancelled) leaves every queue
    s = pe_sched()
    s.hold("sess", -1, 2, 10, ReadPath.PE)
    s.submit(req("sess"))
    s.fetch_de(0, de)
    assert [r.id for r in s.queued_requests()] == ["sess/r1"]
    assert [r.id for r in s.withdraw(["sess/r1"])] == ["sess/r1"] and len(s) == 0
