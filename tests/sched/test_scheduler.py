"""Policies behind `make_policy` and the stateful `GlobalScheduler` shell."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_jax.config import Policy, SchedulerConfig
from dualpath_jax.sched import (
    POLICY_SPECS,
    EngineChoice,
    EngineLoad,
    GlobalScheduler,
    PathMode,
    QueueFull,
    ReadPath,
    Request,
    make_policy,
)


def req(i: int, prompt: int = 1000, cached: int = 640, gen: int = 10) -> Request:
    return Request(f"r{i}", f"t{i}", 0, prompt, cached, gen)


def pe_loads(read_q: int = 0, tok=(0, 0)) -> list[EngineLoad]:
    return [
        EngineLoad(engine=e, node=0, group=0, tok_e=t, read_q=read_q) for e, t in enumerate(tok)
    ]


def de_loads(read_q: int = 0, free: int = 10**6, group: int = 0, base: int = 10, node: int = 1):
    return [
        EngineLoad(engine=base + i, node=node, group=group, read_q=read_q, free_hbm_tokens=free)
        for i in range(2)
    ]


@pytest.mark.parametrize(
    "policy, engines, path, layerwise",
    [
        (Policy.BASIC, EngineChoice.LOAD_AWARE, PathMode.PE, False),
        (Policy.LAYERWISE, EngineChoice.LOAD_AWARE, PathMode.PE, True),
        (Policy.DUALPATH_RR, EngineChoice.ROUND_ROBIN, PathMode.ALTERNATE, True),
        (Policy.DUALPATH, EngineChoice.LOAD_AWARE, PathMode.SHORTER, True),
        (Policy.SPLIT, EngineChoice.LOAD_AWARE, PathMode.SPLIT, True),
        (Policy.ORACLE, EngineChoice.LOAD_AWARE, PathMode.NONE, True),
    ],
)
def test_each_policy_resolves_to_its_spec(policy, engines, path, layerwise):
    for arg in (policy, Policy(policy.value), SchedulerConfig(policy=policy)):
        p = make_policy(arg)
        assert (p.spec.engine_choice, p.spec.path_mode) == (engines, path)
        assert p.layerwise is layerwise
    assert set(POLICY_SPECS) == set(Policy)  # one spec per policy, derived in one place


def test_a_policy_is_a_config_policy_not_a_bare_string():
    for bad in ("dualpath", "fastest", 3):
        with pytest.raises(TypeError, match="a policy is a config.Policy"):
            make_policy(bad)
        with pytest.raises(TypeError, match="a policy is a config.Policy"):
            GlobalScheduler(bad)
    with pytest.raises(ValueError, match="'fastest' is not a valid Policy"):
        Policy("fastest")


def test_dualpath_flow_alternates_read_sides_by_queue():
    s = GlobalScheduler(Policy.DUALPATH, block_tokens=64)
    for i in range(3):
        s.submit(req(i))
    taken = s.fetch_de(0, de_loads())
    assert [r.id for r, _ in taken] == ["r0", "r1", "r2"]
    out = s.fetch_pe(0, pe_loads())
    # r0: tie (0 vs 0) -> PE side; PE node queue 640. r1: 640 > 0 -> DE side. r2: tie -> PE.
    assert [a.path for a in out] == [ReadPath.PE, ReadPath.DE, ReadPath.PE]
    assert [(a.pe_read_blocks, a.de_read_blocks) for a in out] == [(10, 0), (0, 10), (10, 0)]
    assert [a.pe for a in out] == [0, 1, 0]  # argmin tok_e, updated after each assignment
    assert {a.de for a in out} == {10, 11}
    assert len(s) == 0
    v = s.view()
    assert {x.node: x.read_q for x in v.pe} == {0: 1280}
    assert {x.node: x.read_q for x in v.de} == {1: 640}
    # A fresh report overrides the estimate.
    s.report(pe_loads(read_q=5), "pe")
    assert s.view().pe[0].read_q == 5


def test_pe_only_oracle_and_split_paths():
    for policy, want in [
        (Policy.BASIC, {ReadPath.PE}),
        (Policy.ORACLE, {ReadPath.NONE}),
    ]:
        s = GlobalScheduler(policy)
        for i in range(4):
            s.submit(req(i))
        s.fetch_de(0, de_loads())
        out = s.fetch_pe(0, pe_loads())
        assert {a.path for a in out} == want
        if policy is Policy.ORACLE:
            assert all(a.pe_read_blocks == a.de_read_blocks == 0 for a in out)
    s = GlobalScheduler(Policy.SPLIT, block_tokens=64)
    s.submit(req(0, prompt=2000, cached=1280))  # 20 blocks, both queues empty: 10 + 10
    s.fetch_de(0, de_loads())
    (a,) = s.fetch_pe(0, pe_loads())
    assert (a.path, a.pe_read_blocks, a.de_read_blocks) == (ReadPath.SPLIT, 10, 10)
    s.submit(req(1, prompt=2000, cached=1280))
    s.fetch_de(0, de_loads(read_q=1280 + 640))  # DE side is now 1280 tokens behind the PE side
    (a,) = s.fetch_pe(0, pe_loads(read_q=640))
    assert a.pe_read_blocks - a.de_read_blocks == 20  # everything on the shorter side
    assert a.path is ReadPath.PE


def test_no_hit_reads_nothing():
    s = GlobalScheduler(Policy.DUALPATH)
    s.submit(req(0, cached=0))
    s.fetch_de(0, de_loads())
    (a,) = s.fetch_pe(0, pe_loads())
    assert a.path is ReadPath.NONE and a.pe_read_blocks == a.de_read_blocks == 0


def test_de_phase_1_balances_groups_and_beta_backpressures():
    s = GlobalScheduler(Policy.DUALPATH, beta=1500)
    s.report(de_loads(group=1, base=20, node=2), "de")
    for i in range(4):
        s.submit(req(i))
    got0 = s.fetch_de(0, de_loads(group=0))
    # Phase 1 alternates the two empty groups; group 0 takes only its share.
    assert [r.id for r, _ in got0] == ["r0", "r2"]
    assert s.queued() == {"de_global": 0, "de_private": 2, "pe_waiting": 2, "pe_pinned": 0}
    got1 = s.fetch_de(1, de_loads(group=1, base=20, node=2))
    assert [r.id for r, _ in got1] == ["r1", "r3"]
    # beta = 1500: each PE (tok 0) takes one 1000-token request and is then at 1000 <= beta,
    # takes another (2000 > beta), so four requests fill two PEs; a fifth would wait.
    out = s.fetch_pe(0, pe_loads(tok=(0, 0)))
    assert [a.request.id for a in out] == ["r0", "r2", "r1", "r3"]
    s.submit(req(9))
    s.fetch_de(0, de_loads(group=0))
    assert s.fetch_pe(0, pe_loads(tok=(2000, 1600))) == ()
    assert s.queued()["pe_waiting"] == 1


def test_hbm_backpressure_and_dead_engines():
    s = GlobalScheduler(Policy.DUALPATH)
    for i in range(3):
        s.submit(req(i, prompt=1000, gen=10))
    got = s.fetch_de(0, de_loads(free=1010))  # each DE holds exactly one request
    assert len(got) == 2 and s.queued()["de_private"] == 1
    back = s.remove_engines([got[0][1]])
    assert [r.id for r in back] == ["r0"]
    assert s.queued() == {"de_global": 1, "de_private": 1, "pe_waiting": 1, "pe_pinned": 0}
    back = s.remove_engines([got[1][1]])  # the whole group is gone
    assert sorted(r.id for r in back) == ["r1", "r2"]
    assert s.queued() == {"de_global": 3, "de_private": 0, "pe_waiting": 0, "pe_pinned": 0}


def test_queue_bound_and_requeue():
    s = GlobalScheduler(Policy.DUALPATH, max_queue=2)
    s.submit(req(0))
    s.submit(req(1))
    with pytest.raises(QueueFull):
        s.submit(req(2))
    s.requeue([req(7), req(8)])  # never refused, and goes first
    got = s.fetch_de(0, de_loads())
    assert [r.id for r, _ in got] == ["r7", "r8", "r0", "r1"]


def test_round_robin_cycles_engines():
    s = GlobalScheduler(Policy.DUALPATH_RR)
    for i in range(6):
        s.submit(req(i))
    got = s.fetch_de(0, de_loads())
    assert [de for _, de in got] == [10, 11, 10, 11, 10, 11]
    out = s.fetch_pe(0, pe_loads(tok=(0, 99999)))  # RR ignores tok_e below beta
    assert [a.pe for a in out] == [0, 1, 0, 1, 0, 1]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3000)), min_size=1, max_size=40),
    st.sampled_from(list(Policy)),
    st.integers(1, 3),
)
def test_every_request_is_assigned_once_in_fifo_order(lens, policy, n_groups):
    s = GlobalScheduler(policy, block_tokens=64)
    reqs = [req(i, prompt=p, cached=min(c, p)) for i, (p, c) in enumerate(lens)]
    for r in reqs:
        s.submit(r)
    out = []
    for _ in range(3):
        for g in range(n_groups):
            s.fetch_de(g, de_loads(group=g, base=10 + 2 * g, node=1 + g))
        out.extend(s.fetch_pe(0, pe_loads()))
    assert sorted(a.request.id for a in out) == sorted(r.id for r in reqs)
    for a in out:
        assert a.pe_read_blocks + a.de_read_blocks == (
            0 if a.path is ReadPath.NONE else a.request.cached_blocks(64)
        )
    if n_groups == 1:
        assert [a.request.id for a in out] == [r.id for r in reqs]


def test_from_config_uses_z_and_queue_bound():
    cfg = dataclasses.replace(SchedulerConfig(), z_factor=1.2, max_queue=7)
    s = GlobalScheduler.from_config(cfg, alpha=10.0, beta=20.0, block_tokens=32)
    assert (s.z_factor, s.max_queue, s.alpha, s.beta, s.block_tokens) == (1.2, 7, 10.0, 20.0, 32)


def test_fetch_de_would_place_and_repeated_reports():
    """`fetch_de_would_place` is False exactly when a DE fetch would route and place nothing;
    reporting the same load objects again records nothing new (not even their read queue, which
    read decisions may have raised since), while a new report resets the node's estimate."""
    s = GlobalScheduler(Policy.DUALPATH)
    loads = de_loads(free=1010)
    s.report(loads, "de")
    assert not s.fetch_de_would_place(0, loads)  # nothing queued
    for i in range(3):
        s.submit(req(i, prompt=1000, gen=10))
    assert s.fetch_de_would_place(0, de_loads(free=0))  # the global queue is routed
    got = s.fetch_de(0, loads)  # routes all three to group 0, each DE takes one
    assert len(got) == 2 and s.queued()["de_private"] == 1
    full = [s._de[x.engine] for x in loads]  # after the fetch: no room for r2 (1010 tokens)
    assert not s.fetch_de_would_place(0, full) and s.fetch_de(0, full) == ()
    assert s.fetch_de_would_place(0, de_loads(free=1010)) and not s.fetch_de_would_place(7, loads)
    before = (dict(s._group_tok), dict(s._de))
    s.report(list(s._de.values()), "de")  # the loads it holds, after the fetch
    assert (dict(s._group_tok), dict(s._de)) == before
    s.fetch_pe(0, pe_loads())  # read decisions add to node queues
    raised = dict(s._read_q)
    assert raised[1] > 0 or raised[0] > 0
    s.report(list(s._de.values()), "de")  # held reports: the raised estimate stays
    assert s._read_q == raised
    s.report([dataclasses.replace(x) for x in s._de.values()], "de")  # new reports reset it
    assert s._read_q[1] == 0
