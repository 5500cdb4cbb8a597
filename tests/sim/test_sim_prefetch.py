"""Tool-gap prefetch in the simulator: background reads never delay a critical read (the link's
own accounting), and on the paper's 2P4D testbed with coding-agent sessions (Weka format, built
here) turns after a tool call start sooner with prefetch on, at the same JCT or better, under
DualPath and under Basic (whose prefetch reads into PE nodes)."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics

import pytest

from dualpath_jax.presets import paper_experiment
from dualpath_jax.sim import simulate
from dualpath_jax.sim.core import EventLoop
from dualpath_jax.sim.network import SimNetwork
from dualpath_jax.sim.prefetch import Background, BackgroundJob
from dualpath_jax.transfer.links import LinkId, LinkKind, TrafficClass

SNIC = LinkId(LinkKind.SNIC_RX, "node0")
DRAM = LinkId(LinkKind.DRAM, "node0")


def _net(loop):
    rates = {SNIC: 1e6}
    return SimNetwork(
        loop, lambda lid: rates.get(lid, 0.0), quantum_s=0.01, window_s=0.5, fifo=("snic_rx",)
    )


def test_a_critical_read_starts_at_once_over_background_bytes_which_resume_after():
    loop = EventLoop()
    net = _net(loop)
    snic, dram = net.resolve([SNIC, DRAM])
    bg = Background(snic, loop, slice_s=0.1, counted=(dram,))
    got, done = [], []
    bg.add(BackgroundJob(3_000_000, got.append, lambda: done.append(loop.now)))
    crit = []
    loop.at(1.05, lambda: net.send((snic, dram), 1_000_000, TrafficClass.LOW, crit.append, "r"))
    loop.run()
    assert crit == ["r"] and loop.now == pytest.approx(4.0)
    # the critical read took exactly bytes / rate from its arrival: as on an idle link
    assert bg.yields == 1
    assert done == [pytest.approx(4.0)] and sum(got) == 3_000_000
    assert snic.bytes == [0, 4_000_000] and dram.bytes == [0, 4_000_000]
    for _, b in snic.window_series():  # never more than the link's rate in any window
        assert b <= 0.5e6 * (1 + 1e-9)


def test_critical_read_end_is_the_same_with_and_without_background():
    ends = []
    for with_bg in (False, True):
        loop = EventLoop()
        net = _net(loop)
        (snic,) = net.resolve([SNIC])
        if with_bg:
            Background(snic, loop, slice_s=0.05).add(BackgroundJob(10**8, lambda n: None, list))
        t = []
        for at in (0.3, 0.31, 2.0):
            loop.at(
                at, lambda: net.send((snic,), 250_000, TrafficClass.LOW, lambda: t.append(loop.now))
            )
        loop.run(until=50.0)
        ends.append(t)
    assert ends[0] == pytest.approx(ends[1])
    assert ends[0] == pytest.approx([0.55, 0.8, 2.25])


def _weka(tmp_path, n=6, turns=8, seed=0, stop="tool_use"):
    """`n` coding-agent sessions of 64-token blocks: a 24K-token first context growing by about
    900 tokens a turn, 200 generated, 5-30 s tool gaps, arrivals a few seconds apart."""
    rng = random.Random(seed)
    d = tmp_path / "weka"
    d.mkdir(parents=True)
    for s in range(n):
        ids, reqs, t = [], [], 3.0 * s
        ctx = 24_000 + 512 * s
        for i in range(turns):
            ids = ids + list(range(s * 10_000 + len(ids), s * 10_000 + ctx // 64))
            gap = 0.0 if i == 0 else rng.uniform(5, 30)
            t += gap
            reqs.append(
                {
                    "t": t,
                    "type": "n",
                    "in": ctx,
                    "out": 200,
                    "hash_ids": ids,
                    "think_time": gap,
                    "stop": stop,
                }  # fmt: skip
            )
            t += 2.0
            ctx += 200 + rng.randint(600, 1200)
        (d / f"s{s}.json").write_text(
            json.dumps({"id": f"s{s}", "block_size": 64, "requests": reqs})
        )
    return d


def _run(tmp_path, prefetch: bool, policy: str = "dualpath", stop: str = "tool_use"):
    cfg, cost = paper_experiment("ds660b", 2, 4, policy=policy, snic_bytes_per_s=2e9)
    w = dataclasses.replace(
        cfg.workload, trace=str(_weka(tmp_path, stop=stop)), trace_format="weka", agents=None,
        mode="online", max_turns=0,
    )  # fmt: skip
    sched = dataclasses.replace(cfg.scheduler, prefetch=prefetch)
    return simulate(dataclasses.replace(cfg, workload=w, scheduler=sched), cost=cost)


@pytest.mark.parametrize("policy", ["dualpath", "basic"])
def test_prefetch_cuts_the_ttft_of_turns_after_a_tool_call_and_keeps_link_priorities(
    tmp_path, policy
):
    off = _run(tmp_path / "off", False, policy)
    on = _run(tmp_path / "on", True, policy)

    def after_tool(run):
        return statistics.median(
            r.ttft_s for r in run.cluster.results if not r.request.endswith("/r0")
        )

    assert after_tool(on) < 0.8 * after_tool(off)
    assert on.jct_s <= off.jct_s * (1 + 1e-9)
    c = on.cluster.counters
    assert c["prefetch_started"] > 0 and c["prefetch_hit_tokens"] > 0
    if policy == "basic":  # it reads on the PE side only: so does its prefetch
        assert c["prefetch_used_pe"] > 0 and c["prefetch_used_de"] == 0
    # Link accounting: the background bytes only filled idle storage-NIC time (no window holds
    # more than the link moves), and each round's critical reads went first (yields counted).
    bgs = on.cluster.prefetch.background
    assert sum(b.bytes for b in bgs.values()) == c["prefetch_bytes"] > 0
    for b in bgs.values():
        w = b.link.window_s
        assert all(v <= b.rate * w * (1 + 1e-9) for _, v in b.link.window_series())

    # The same tokens and hits: prefetch moves when the hit is read, not what is hit.
    def key(run):
        return sorted((r.request, r.prompt_tokens, r.cached_tokens) for r in run.cluster.results)

    assert key(on) == key(off)


def test_no_prefetch_for_a_users_think_time(tmp_path):
    """Gaps after the model ended its turn (`stop: end_turn`) are not tool calls: nothing to
    prefetch, whatever their length."""
    run = _run(tmp_path, True, stop="end_turn")
    assert run.cluster.counters["prefetch_started"] == 0


def _cluster(per_engine_bytes: float):
    from dualpath_jax.sim.cluster import SimCluster

    cfg, cost = paper_experiment("ds660b", 2, 4, policy="dualpath")
    sched = dataclasses.replace(
        cfg.scheduler, prefetch=True, prefetch_bytes_per_engine=per_engine_bytes
    )
    c = SimCluster(dataclasses.replace(cfg, scheduler=sched), cost)
    c.router._report_des()  # the DEs' first loads, as the first fetch reports them
    return c


def test_a_gap_that_runs_long_is_cancelled_and_frees_the_memory():
    c = _cluster(0.0)
    c.prefetch.tool_call("s", hit_tokens=64_000, expected_s=2.0)
    assert c.counters["prefetch_started"] == 1 and "s" in c.prefetch.entries
    c.loop.run()  # no next turn: given up 3 x 2 s after it started
    assert c.counters["prefetch_cancelled"] == 1 and not c.prefetch.entries
    assert c.loop.now == pytest.approx(6.0)
    assert c.scheduler.group_totals() and not c.scheduler._held


def test_a_short_budget_evicts_the_prefetch_needed_last_or_refuses():
    block = _cluster(0.0).bt * _cluster(0.0).kvb
    c = _cluster(block * 100 / 8)  # 100 blocks per DE node (8 engines); every group ties: node 0
    c.prefetch.tool_call("late", hit_tokens=60 * c.bt, expected_s=50.0)
    c.prefetch.tool_call("soon", hit_tokens=60 * c.bt, expected_s=5.0)  # evicts "late"
    assert set(c.prefetch.entries) == {"soon"} and c.counters["prefetch_evicted"] == 1
    assert c.prefetch.entries["soon"].nbytes == 60 * block
    c.prefetch.turn_submitted("soon")  # in use now: a later prefetch cannot evict it
    c.prefetch.tool_call("other", hit_tokens=60 * c.bt, expected_s=1.0)
    assert set(c.prefetch.entries) == {"soon"} and c.counters["prefetch_skipped"] == 1
