"""The simulated cluster: it calls the real scheduler, charges the real data paths, and keeps the
paper's bounds (DualPath/Basic <= (P+D)/P, ~1 without a storage bottleneck)."""

from __future__ import annotations

import collections
import dataclasses
import gc

import pytest
from trace_helpers import CPU_COST

from dualpath_jax.config import Policy
from dualpath_jax.metrics.summary import summarize
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sim import SimOptions, simulate
from dualpath_jax.transfer.paths import expected_link_bytes
from dualpath_jax.workload.trace import Round, Trajectory

TINY_COMPUTE = FittedCostModel(prefill=(1e-6, 1e-9, 1e-13), decode=(1e-6, 1e-9, 1e-13))


def _cfg(p: int, d: int, policy: str, *, unlimited: bool = False):
    cfg = emulated_cpu_experiment(p, d, "tiny")
    hw = cfg.hardware
    if unlimited:
        hw = dataclasses.replace(
            hw, snic_bytes_per_s=0.0, cnic_bytes_per_s=0.0, h2d_bytes_per_s=0.0, d2h_bytes_per_s=0.0
        )
    return dataclasses.replace(
        cfg, hardware=hw, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
    )


def _jct(p, d, policy, cost=CPU_COST, **kw):
    run = simulate(_cfg(p, d, policy, **kw), cost=cost)
    assert run.summary["errors"] == 0
    return run.jct_s


@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_dualpath_over_basic_never_exceeds_p_plus_d_over_p(p, d):
    ratio = _jct(p, d, "basic") / _jct(p, d, "dualpath")
    assert 1.0 < ratio <= (p + d) / p * 1.01


def test_ratio_is_one_with_unlimited_storage_bandwidth():
    assert _jct(1, 1, "basic", unlimited=True) == pytest.approx(
        _jct(1, 1, "dualpath", unlimited=True), rel=0.01
    )


@pytest.mark.parametrize("p,d", [(1, 1), (1, 2)])
def test_ratio_approaches_the_bound_when_compute_is_negligible(p, d):
    ratio = _jct(p, d, "basic", TINY_COMPUTE) / _jct(p, d, "dualpath", TINY_COMPUTE)
    bound = (p + d) / p
    assert 0.75 * bound <= ratio <= bound * 1.01


def test_oracle_is_fastest_and_every_policy_finishes_every_round():
    jcts = {pol.value: _jct(1, 2, pol.value) for pol in Policy}
    assert min(jcts, key=jcts.get) == "oracle"
    assert jcts["dualpath"] < jcts["basic"]


class SpyScheduler(GlobalScheduler):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = {"submit": 0, "fetch_de": 0, "fetch_pe": 0}
        self.assignments = []

    def submit(self, request):
        self.calls["submit"] += 1
        super().submit(request)

    def fetch_de(self, group, loads):
        self.calls["fetch_de"] += 1
        return super().fetch_de(group, loads)

    def fetch_pe(self, group, loads):
        self.calls["fetch_pe"] += 1
        out = super().fetch_pe(group, loads)
        self.assignments.extend(out)
        return out


def _spy(cfg):
    return SpyScheduler(cfg.scheduler.policy, block_tokens=cfg.store.block_tokens)


def test_the_simulator_drives_the_real_scheduler():
    cfg = _cfg(2, 2, "dualpath")
    spy = _spy(cfg)
    run = simulate(cfg, cost=CPU_COST, scheduler=spy)
    n = run.summary["requests"]
    assert spy.calls["submit"] == n == len(spy.assignments)
    assert spy.calls["fetch_de"] > 0 and spy.calls["fetch_pe"] > 0
    paths = {a.path.value for a in spy.assignments if a.request.cached_tokens}
    assert paths == {"pe", "de"}  # both read paths are used
    assert run.summary["read_paths"] == {
        p: sum(1 for a in spy.assignments if a.path.value == p) for p in run.summary["read_paths"]
    }


@pytest.mark.parametrize("policy", ["basic", "dualpath", "split"])
def test_link_bytes_equal_expected_link_bytes_per_request(policy):
    cfg = _cfg(1, 1, policy)
    traj = Trajectory("t", (Round(300, 20), Round(100, 30), Round(50, 10)))
    spy = _spy(cfg)
    run = simulate(
        cfg,
        cost=CPU_COST,
        options=SimOptions(persist=False),
        trajectories=[traj],
        arrivals=[0.0],
        scheduler=spy,
    )
    kvb = run.cluster.kvb
    bt = cfg.store.block_tokens
    want: dict[str, int] = {}
    for a in spy.assignments:
        r = a.request
        pe, de = run.cluster.engines[a.pe], run.cluster.engines[a.de]
        path = a.path.value if r.cached_tokens else "none"
        got = expected_link_bytes(
            path,
            r.cached_tokens * kvb,
            r.new_tokens * kvb,
            pe=pe.name,
            de=de.name,
            pe_node=pe.node_name,
            de_node=de.node_name,
            de_hit_bytes=a.de_read_blocks * bt * kvb,
        )
        for k, v in got.items():
            want[k] = want.get(k, 0) + v
    assert {k: v for k, v in run.cluster.net.totals().items() if v} == want


def test_summary_has_the_launcher_keys():
    run = simulate(_cfg(1, 1, "dualpath"), cost=CPU_COST)
    s = run.summary
    for key in [
        "policy",
        "mode",
        "emulated",
        "agents",
        "requests",
        "jct_s",
        "ttft_s",
        "ttst_s",
        "tpot_s",
        "tokens_generated",
        "bytes_read_pe_path",
        "bytes_read_de_path",
        "snic_max_over_avg",
        "recomputed_blocks",
        "errors",
    ]:
        assert key in s
    assert set(s) >= set(
        summarize(
            policy="x",
            mode="offline",
            emulated=True,
            agents=0,
            results=[],
            errors=0,
            jct_s=0.0,
            reports=[],
        )
    )
    assert s["bytes_read_pe_path"] > 0 and s["bytes_read_de_path"] > 0
    assert s["tokens_generated"] == sum(len(r.tokens) for r in run.cluster.results)
    assert all(r.ttft_s > 0 and r.jct_s >= r.ttft_s for r in run.cluster.results)


def test_deterministic():
    a = simulate(_cfg(1, 2, "dualpath"), cost=CPU_COST).summary
    b = simulate(_cfg(1, 2, "dualpath"), cost=CPU_COST).summary
    a.pop("sim"), b.pop("sim")
    assert a == b


def test_online_mode_arrivals():
    cfg = _cfg(1, 1, "dualpath")
    cfg = dataclasses.replace(
        cfg, workload=dataclasses.replace(cfg.workload, mode="online", aps=0.5)
    )
    run = simulate(cfg, cost=CPU_COST)
    assert run.summary["mode"] == "online" and run.summary["errors"] == 0
    assert run.summary["agents"] == cfg.workload.agents


@pytest.mark.parametrize("policy", ["basic", "dualpath", "split"])
def test_one_event_per_uncontended_transfer_keeps_results(policy):
    runs = [
        simulate(_cfg(1, 2, policy), cost=CPU_COST, options=SimOptions(fast_links=f))
        for f in (False, True)
    ]
    slow, fast = (r.summary for r in runs)
    assert fast["jct_s"] == pytest.approx(slow["jct_s"], rel=0.01)
    assert fast["ttft_s"]["mean"] == pytest.approx(slow["ttft_s"]["mean"], rel=0.01)
    assert runs[1].events < runs[0].events


def test_pe_hbm_bounds_basic_batches_and_layerwise_lifts_it():
    """Without layerwise prefill a PE batch holds every layer of its context; a PE whose HBM
    holds about one request's context then runs one request per forward (each paying the
    per-batch time), while layerwise prefill holds one layer and batches as before."""
    cost = FittedCostModel(prefill=(0.2, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-8))
    fast_store = dict(unlimited=True)

    def run(policy, pe_hbm):
        r = simulate(
            _cfg(1, 1, policy, **fast_store), cost=cost, options=SimOptions(pe_hbm_tokens=pe_hbm)
        )
        assert r.summary["errors"] == 0
        return r.jct_s

    assert run("basic", 1_100) > 1.2 * run("basic", 0)
    assert run("layerwise", 1_100) == pytest.approx(run("layerwise", 0), rel=0.02)


def test_cluster_prefill_max_kv_tokens_is_the_simulated_pe_hbm():
    cost = FittedCostModel(prefill=(0.2, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-8))
    cfg = _cfg(1, 1, "basic", unlimited=True)
    bounded = dataclasses.replace(
        cfg, cluster=dataclasses.replace(cfg.cluster, prefill_max_kv_tokens=1_100)
    )
    via_cfg = simulate(bounded, cost=cost).jct_s
    assert via_cfg == simulate(cfg, cost=cost, options=SimOptions(pe_hbm_tokens=1_100)).jct_s
    assert via_cfg > simulate(cfg, cost=cost).jct_s


def test_ttft_breakdown_comes_from_the_results():
    """The simulator keeps each round's read and prefill time on its result (no event per
    round); the summary's TTFT breakdown covers every round and adds up below its TTFT."""
    run = simulate(_cfg(1, 2, "dualpath"), cost=CPU_COST)
    s = run.summary
    assert run.cluster.events == []
    rounds = run.cluster.results
    assert all(r.read_s >= 0 and r.prefill_s > 0 for r in rounds)
    assert all(r.queue_s + r.read_s + r.prefill_s <= r.ttft_s + 1e-9 for r in rounds)
    br = s["ttft_breakdown_s"]
    assert br["prefill"]["mean"] == pytest.approx(sum(r.prefill_s for r in rounds) / len(rounds))
    assert br["kv_read"]["mean"] > 0


@pytest.mark.parametrize("policy", ["basic", "dualpath", "oracle"])
def test_a_run_makes_no_reference_cycles(policy):
    """`simulate` pauses the cyclic collector while its loop runs; that is only free of leaks
    because every object a round makes is freed by reference counting."""
    from dualpath_jax.presets import paper_experiment

    cfg, cost = paper_experiment("ds660b", 2, 4, policy=policy, agents=32, max_turns=3)
    opts = SimOptions(kv_format="fp8_flashmla")
    simulate(cfg, cost=cost, options=opts)  # first use: lazy imports may leave cycles
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run = simulate(cfg, cost=cost, options=opts)
        gc.collect()
        garbage = collections.Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert run.summary["requests"] == 32 * 3 and run.summary["errors"] == 0
    assert not garbage


@pytest.mark.parametrize("enabled", [True, False])
def test_simulate_leaves_the_collector_as_it_found_it(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        seen = []
        run = simulate(_cfg(1, 1, "dualpath"), cost=CPU_COST)
        seen.append(gc.isenabled())
        simulate(_cfg(1, 1, "dualpath"), cost=CPU_COST, pause_gc=False)
        seen.append(gc.isenabled())
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [enabled, enabled] and run.summary["errors"] == 0


def test_agents_replay_turn_specs_lengths_and_hits():
    """`sim.agents` keeps round lengths as ints: every submitted request has `turn_specs`' prompt
    and gen and `round_hit`'s hit, and `reference_request` is the mean of `turn_specs`."""
    from dualpath_jax.sim.agents import reference_request, round_hit
    from dualpath_jax.workload.trace import turn_specs

    trajs = [
        Trajectory("t0", (Round(300, 20), Round(70, 5), Round(1, 130))),
        Trajectory("t1", (Round((1, 2, 3), 9), Round(200, 1))),
    ]
    cfg = _cfg(1, 1, "dualpath")
    run = simulate(cfg, cost=CPU_COST, trajectories=trajs, arrivals=[0.0, 0.5])
    bt = cfg.store.block_tokens
    got = {
        r.request: (r.prompt_tokens, r.cached_tokens, len(r.tokens)) for r in run.cluster.results
    }
    want = {}
    for agent, t in enumerate(trajs):
        specs = turn_specs(t)
        for i, s in enumerate(specs):
            hit = round_hit(specs[i - 1] if i else None, s, bt)
            want[f"{t.id}/a{agent}/r{i}"] = (s.prompt, hit, s.gen)
    assert got == want
    assert any(hit for _, hit, _ in want.values())
    specs = [s for t in trajs for s in turn_specs(t)]
    mean_ctx = sum(s.context for s in specs) // len(specs)
    mean_app = sum(s.append for s in specs) // len(specs)
    assert reference_request(trajs) == (mean_ctx, max(1, mean_app))
