"""The simulator's tool calls and capacity-limited store (`sim.kvcache`): gaps delay the next
round, an unlimited capacity changes nothing, and under pressure session retention keeps the
blocks of an agent in its tool call where LRU evicts them for an ended trajectory's."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_jax.config import apply_overrides, validate
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sim import simulate
from dualpath_jax.workload.trace import Round, Trajectory

COST = FittedCostModel(prefill=(0.02, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-8))


def _cfg(*overrides: str):
    return apply_overrides(emulated_cpu_experiment(1, 1, "tiny"), list(overrides))


def _cached(run) -> dict[str, int]:
    return {r.request: r.cached_tokens for r in run.cluster.results}


def test_a_tool_call_delays_the_next_round_by_its_gap():
    plain = [Trajectory("t", (Round(300, 8), Round(40, 8), Round(40, 8)))]
    gapped = [Trajectory("t", (Round(300, 8), Round(40, 8, gap_s=7.0), Round(40, 8, gap_s=2.5)))]
    a = simulate(_cfg(), cost=COST, trajectories=plain, arrivals=[0.0])
    b = simulate(_cfg(), cost=COST, trajectories=gapped, arrivals=[0.0])
    # one agent, an idle cluster during its tool calls: the run is longer by the gaps (up to
    # where the engines' periodic load reports fall)
    assert b.jct_s == pytest.approx(a.jct_s + 9.5, abs=0.05)
    assert _cached(a) == _cached(b)


def test_an_ample_capacity_finds_every_hit():
    trajs = [
        Trajectory(f"t{i}", (Round(200 + 30 * i, 8), Round(50, 8, gap_s=1.0), Round(20, 4)))
        for i in range(4)
    ]
    unlimited = simulate(_cfg(), cost=COST, trajectories=trajs, arrivals=[0.0] * 4)
    for policy in ("lru", "retention"):
        cfg = _cfg("store.capacity_bytes=1000000000000", f"store.eviction={policy}")
        run = simulate(cfg, cost=COST, trajectories=trajs, arrivals=[0.0] * 4)
        assert _cached(run) == _cached(unlimited)
        counters = run.summary["router"]
        assert counters["store_lost_tokens"] == 0 and counters["store_evictions"] == 0
        assert counters["store_hit_tokens"] == sum(_cached(unlimited).values())


@pytest.mark.parametrize("policy", ["lru", "retention"])
def test_retention_keeps_an_agent_in_its_tool_call_where_lru_evicts_it(policy):
    """Agent a writes its chain, then spends 60 s in a tool call; meanwhile b runs one round and
    ends, and c runs one round. The store holds two chains: c's write must evict one. LRU takes
    a's (the least recently used); retention takes ended b's, so a's next round hits in full."""
    base = _cfg()
    bt = base.store.block_tokens
    chain = 6 * bt  # each first round: a prompt of 6 blocks less one token, 1 generated
    block_bytes = kv_bytes_per_token(base.model) * bt
    trajs = [
        Trajectory("a", (Round(chain - 1, 1), Round(bt, 1, gap_s=60.0))),
        Trajectory("b", (Round(chain - 1, 1),)),
        Trajectory("c", (Round(chain - 1, 1),)),
    ]
    cfg = _cfg(
        f"store.capacity_bytes={2 * 5 * block_bytes}",  # two chains of 5 Full Blocks
        f"store.eviction={policy}",
        "store.retention_ttl_s=100",
    )
    run = simulate(cfg, cost=COST, trajectories=trajs, arrivals=[0.0, 5.0, 30.0])
    assert run.summary["errors"] == 0
    a_hit = _cached(run)["a/a0/r1"]
    lost = run.summary["router"]["store_lost_tokens"]
    if policy == "retention":
        assert a_hit == 5 * bt and lost == 0
    else:
        assert a_hit < 5 * bt and lost == 5 * bt - a_hit


def test_an_unknown_eviction_policy_is_refused():
    with pytest.raises(ValueError, match="store.eviction"):
        validate(_cfg("store.eviction=fifo"))
    validate(dataclasses.replace(_cfg(), store=dataclasses.replace(_cfg().store, eviction="lru")))
