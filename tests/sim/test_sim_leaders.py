"""When the simulated group leaders fetch (`SimOptions.leader_phases`): like the real engine loops,
a PE leader fetches between its forward batches, at most once per fetch interval, and idle
leaders fetch on their own timers, so at tens of groups the waiting rounds spread over the
prefill nodes instead of going, a pass's worth at a time, to whichever group fetches first."""

from __future__ import annotations

import dataclasses

import pytest
from trace_helpers import CPU_COST

from dualpath_jax.config import Policy
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import EngineLoad, Request
from dualpath_jax.sim import SimOptions, run
from dualpath_jax.sim.cluster import SimCluster
from dualpath_jax.sim.leaders import Leader


class _Recording(GlobalScheduler):
    """The real scheduler, recording every PE and DE fetch that reaches it:
    `(time, group, whether the group's leader was in a forward batch, rounds assigned)`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cluster: SimCluster | None = None
        self.pe_fetches: list[tuple[float, int, bool, int]] = []
        self.de_fetches: list[tuple[float, int, bool, int]] = []

    def _record(self, into: list, group: int, loads, n: int) -> None:
        cl = self.cluster
        into.append((cl.loop.now, group, cl.engines[loads[0].engine].busy, n))

    def fetch_pe(self, group, loads):
        out = super().fetch_pe(group, loads)
        self._record(self.pe_fetches, group, loads, len(out))
        return out

    def fetch_de(self, group, loads):
        out = super().fetch_de(group, loads)
        self._record(self.de_fetches, group, loads, len(out))
        return out


def _cluster(p: int, d: int, agents: int, *, phases: bool, interval_s: float | None = None):
    cfg = emulated_cpu_experiment(p, d)
    cfg = dataclasses.replace(
        cfg,
        scheduler=dataclasses.replace(cfg.scheduler, policy=Policy.DUALPATH),
        workload=dataclasses.replace(cfg.workload, agents=agents, trajectories=agents),
    )
    trajs, arrivals = run.build_agents(cfg)
    opts = SimOptions(leader_phases=phases, dispatch_interval_s=interval_s)
    ref = run.reference_request(trajs)
    cl = SimCluster(cfg, CPU_COST, options=opts, ref_request=ref, scheduler=_Recording)
    cl.scheduler.cluster = cl
    return cl, trajs, arrivals


def _run(cl: SimCluster, trajs, arrivals) -> None:
    run.schedule_agents(cl, trajs, arrivals)
    cl.loop.run()


def test_pe_leaders_fetch_between_batches_at_most_once_per_interval():
    cl, trajs, arrivals = _cluster(4, 2, 24, phases=True)
    _run(cl, trajs, arrivals)
    assert len(cl.results) == sum(len(t.rounds) for t in trajs)
    fetches = cl.scheduler.pe_fetches
    assert not any(busy for _, _, busy, _ in fetches), "a PE leader fetched during a batch"
    interval = cl.fetch_interval_s
    last: dict[int, float] = {}
    for t, g, _, _ in fetches:
        if g in last:
            assert t - last[g] >= interval - 1e-9
        last[g] = t
    assert len(last) == 4  # every prefill node's leader took work


def test_de_leaders_fetch_at_most_once_per_interval():
    cl, trajs, arrivals = _cluster(2, 3, 24, phases=True)
    _run(cl, trajs, arrivals)
    assert len(cl.results) == sum(len(t.rounds) for t in trajs)
    times: dict[int, list[float]] = {}
    for t, g, _, _ in cl.scheduler.de_fetches:
        times.setdefault(g, []).append(t)
    assert len(times) == 3
    for ts in times.values():
        assert all(b - a >= cl.fetch_interval_s - 1e-9 for a, b in zip(ts, ts[1:]))


@pytest.mark.parametrize("phases", [True, False])
def test_rounds_per_pe_fetch(phases):
    """Eight PE groups, a non-binding beta, a 0.2 s fetch interval: with one synchronous pass
    per interval the first group takes every round that came in since the last pass; with the
    leaders' own timers most fetches find one."""
    cl, trajs, arrivals = _cluster(8, 8, 64, phases=phases, interval_s=0.2)
    _run(cl, trajs, arrivals)
    assert len(cl.results) == sum(len(t.rounds) for t in trajs)
    sizes = [n for _, _, _, n in cl.scheduler.pe_fetches if n]
    later = sizes[len(sizes) // 4 :]  # after the start, where all agents submit at once
    mean = sum(later) / len(later)
    assert mean < 1.5 if phases else mean > 2.0


def test_route_de_is_phase_one_of_fetch_de():
    loads = [EngineLoad(e, e // 2, e // 2, 0, 0, 0, 10_000) for e in range(4)]
    reqs = [Request(f"r{i}", f"t{i}", 0, 100 * (i + 1), 0, 4) for i in range(5)]
    a, b = GlobalScheduler(Policy.DUALPATH), GlobalScheduler(Policy.DUALPATH)
    for s in (a, b):
        s.report(loads, "de")
        for r in reqs:
            s.submit(r)
    routes = a.route_de()
    assert [r.id for r, _ in routes] == [r.id for r in reqs]
    assert a.de_global_queued() == 0 and a.route_de() == ()
    # fetch_de of a group routes the same way, then places that group's head
    got = b.fetch_de(0, loads[:2])
    assert {r.id for r, _ in got} <= {r.id for r, g in routes if g == 0}
    assert a.fetch_de(0, loads[:2]) == got


def test_leader_timing():
    lead = Leader(period=0.005, phase=0.002)
    assert lead.next_idle(0.0) == pytest.approx(0.002)  # the first idle poll is the phase
    assert lead.next_idle(0.0021) == pytest.approx(0.007)
    lead.went_busy(0.0131)  # idle polls at 2, 7 and 12 ms happened before the batch
    assert lead.last == pytest.approx(0.012)
    assert not lead.loop_check(0.016, 0.005)  # 4 ms since the last fetch: no fetch
    assert lead.loop_check(0.0171, 0.005) and lead.last == 0.0171
    assert lead.next_idle(0.0171) == pytest.approx(0.0221)  # never twice at one time
