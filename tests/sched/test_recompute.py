"""Load or recompute (`scheduler.recompute`): the per-request rule, its place in the read-path
choice, and the simulator running the same decisions."""

from __future__ import annotations

import pytest

from dualpath_jax import load_config, sim
from dualpath_jax.config import ConfigError, apply_overrides, validate
from dualpath_jax.sched.inter import RecomputeRule, assign_paths, fitted_prefill
from dualpath_jax.sched.types import ReadPath, Request

BT = 16
# A CPU-like PE: 2 ms per batch, 1 us per token, 100 ns per attention pair.
COST = fitted_prefill(2e-3, 1e-6, 1e-7)


def test_the_rule_compares_reading_with_recomputing():
    assert not RecomputeRule("never", 1.0, COST).recompute(4096, 16, 4096)
    assert RecomputeRule("always").recompute(16, 16, 0)
    auto = RecomputeRule("auto", read_tokens_per_s=10_000, prefill_s=COST)
    # 1,024 hit tokens: reading takes 0.10 s, recomputing them 0.05 s
    assert auto.recompute(1024, 64, 1024)
    # the same hit at a fast NIC: reading takes 1 ms
    assert not RecomputeRule("auto", 1e6, COST).recompute(1024, 64, 1024)
    # a long hit's attention makes recomputing it dearer than a slow read
    assert not auto.recompute(8192, 64, 8192)
    # a queue ahead on the reading node tips it back to recomputing
    assert auto.recompute(8192, 64, 8192 + 40_000)
    # without a cost model or a read rate, auto loads
    assert not RecomputeRule("auto", 10_000, None).recompute(1024, 64, 1024)
    assert not RecomputeRule("auto", 0.0, COST).recompute(1024, 64, 1024)
    with pytest.raises(ValueError, match="recompute mode"):
        RecomputeRule("sometimes")


def _best_by_search(rule, hit, new, n, ahead):
    """The k in [0, n] with the least predicted finish, by trying every one."""

    def total(k):
        if k == n:
            return COST(0, hit + new)
        read = ahead + hit - k * BT
        lead = COST(0, k * BT) if k else 0.0
        return read / rule.read_tokens_per_s + lead + COST(hit, new)

    return min(range(n + 1), key=lambda k: (total(k), k)), total


@pytest.mark.parametrize(
    "hit,new,rate,ahead",
    [
        (1024, 64, 10_000, 0),
        (8192, 64, 10_000, 0),
        (8192, 512, 50_000, 20_000),
        (8192, 64, 10_000, 40_000),
        (4096, 16, 1e6, 0),
        (512, 8, 2_000, 0),
    ],
)
def test_the_lead_is_the_best_split_between_recomputing_and_reading(hit, new, rate, ahead):
    rule = RecomputeRule("auto", rate, COST)
    n = hit // BT
    k = rule.lead_blocks(hit, new, n, BT, lambda m: ahead + m * BT if m else 0)
    best, total = _best_by_search(rule, hit, new, n, ahead)
    assert total(k) == pytest.approx(total(best), rel=1e-9)


def test_the_lead_rule_per_mode_and_its_regimes():
    read = lambda m: m * BT  # noqa: E731 - nothing queued ahead
    assert RecomputeRule("never", 10_000, COST).lead_blocks(1024, 64, 64, BT, read) == 0
    assert RecomputeRule("always").lead_blocks(1024, 64, 64, BT, read) == 64
    # fast storage: read it all
    assert RecomputeRule("auto", 1e7, COST).lead_blocks(8192, 64, 512, BT, read) == 0
    # slow storage: recompute the early blocks (cheap: short attention), read the late ones
    k = RecomputeRule("auto", 10_000, COST).lead_blocks(8192, 64, 512, BT, read)
    assert 0 < k < 512
    # a long queue ahead on the reading node: recompute it all, skipping the queue
    ahead = lambda m: 400_000 + m * BT if m else 0  # noqa: E731
    assert RecomputeRule("auto", 10_000, COST).lead_blocks(8192, 64, 512, BT, ahead) == 512
    # without a cost model or a read rate, auto loads
    assert RecomputeRule("auto", 10_000, None).lead_blocks(1024, 64, 64, BT, read) == 0
    assert RecomputeRule("auto", 0.0, COST).lead_blocks(1024, 64, 64, BT, read) == 0


@pytest.mark.parametrize("mode", ["shorter", "pe", "split"])
def test_a_recomputed_lead_reads_the_rest_and_only_the_rest_joins_a_read_queue(mode):
    long = Request("b", "t", 1, 8192 + 64, 8192, 8)
    rule = RecomputeRule(
        "auto", 4_000 if mode == "split" else 10_000, COST
    )  # split reads twice as fast
    (a,), q = assign_paths(
        [(long, 0, 1)], {0: 0}, {1: 1}, {0: 0, 1: 0}, mode=mode, block_tokens=BT, recompute=rule
    )
    k = a.recompute_blocks
    assert 0 < k < 8192 // BT
    assert k + a.pe_read_blocks + a.de_read_blocks == 8192 // BT
    assert a.path is not ReadPath.NONE
    assert sum(q.values()) == 8192 - k * BT  # the recomputed lead reads nothing
    if mode == "split":
        assert a.path is ReadPath.SPLIT and abs(q[0] - q[1]) <= BT


def test_a_wholly_recomputed_hit_reads_nothing_and_leaves_the_read_queue():
    hit = Request("a", "t", 1, 8192 + 64, 8192, 8)
    rule = RecomputeRule("auto", 10_000, COST)
    out, q = assign_paths(
        [(hit, 0, 1)], {0: 0}, {1: 1}, {0: 400_000, 1: 400_000}, mode="shorter",
        block_tokens=BT, recompute=rule,
    )  # fmt: skip
    (a,) = out
    assert (a.path, a.pe_read_blocks, a.de_read_blocks, a.recompute_blocks) == (
        ReadPath.NONE,
        0,
        0,
        8192 // BT,
    )
    assert q == {0: 400_000, 1: 400_000}


def test_bad_modes_are_refused_by_the_config():
    cfg = load_config("configs/paper.py:ds660b_2p4d")
    with pytest.raises(ConfigError, match="scheduler.recompute"):
        validate(apply_overrides(cfg, ["scheduler.recompute=maybe"]))


@pytest.mark.slow  # a simulator run per regime: the full tier
def test_the_simulator_recomputes_when_storage_is_slow_and_loads_when_fast():
    base = apply_overrides(load_config("configs/paper.py:ds660b_2p4d"), ["workload.agents=24"])
    jct = {}
    for snic in (5e10, 2e8):
        for mode in ("never", "auto", "always"):
            cfg = apply_overrides(
                base, [f"hardware.snic_bytes_per_s={snic}", f"scheduler.recompute={mode}"]
            )
            s = sim.simulate(cfg).summary
            jct[snic, mode] = s["jct_s"], s["recomputed_blocks"], s["cached_tokens"]
    assert jct[5e10, "auto"] == jct[5e10, "never"]  # fast storage: auto loads every hit
    assert jct[5e10, "always"][2] == 0 and jct[5e10, "always"][1] > 0
    slow_auto = jct[2e8, "auto"]
    assert slow_auto[1] > 0 and slow_auto[2] > 0  # some hits recomputed, some loaded
    assert slow_auto[0] < jct[2e8, "never"][0] and slow_auto[0] < jct[2e8, "always"][0]


def test_the_simulator_charges_a_recomputed_lead_and_reads_the_rest():
    base = apply_overrides(load_config("configs/paper.py:ds660b_2p4d"), ["workload.agents=12"])
    load = sim.simulate(base).summary
    lead = sim.simulate(
        apply_overrides(base, ["scheduler.recompute=always", "scheduler.recompute_max_blocks=2"])
    ).summary
    bt = base.store.block_tokens
    leads = lead["router"]["recompute_lead_hits"]
    assert leads > 0 and lead["router"]["recompute_hits"] >= leads
    # each round recomputed at most 2 leading blocks; the loaded tokens shrank by exactly those
    assert lead["recomputed_blocks"] <= 2 * lead["router"]["recompute_hits"]
    assert load["cached_tokens"] - lead["cached_tokens"] == lead["recomputed_blocks"] * bt
    assert lead["errors"] == 0 and lead["jct_s"] > 0
