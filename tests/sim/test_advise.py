"""The deployment advisor picks what direct simulator runs say is best, and reports the
bottleneck-free range beside it."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_jax.presets import (
    HOPPER_NODE,
    PAPER_MODELS,
    emulated_cpu_experiment,
    paper_experiment,
)
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sim import SimOptions, simulate
from dualpath_jax.sim.advisor import (
    AdviseSpace,
    advise,
    bottleneck_free_range,
    candidate_config,
    format_report,
    parse_pd,
    pd_splits,
)

COST = FittedCostModel(prefill=(0.02, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-8))


def _base():
    cfg = emulated_cpu_experiment(1, 1, "tiny")
    return dataclasses.replace(
        cfg, workload=dataclasses.replace(cfg.workload, agents=4, trajectories=4, max_turns=4)
    )


def _direct(cfg, p, d, alpha_s, beta_s, **workload):
    c = dataclasses.replace(
        cfg,
        cluster=dataclasses.replace(cfg.cluster, prefill_nodes=p, decode_nodes=d),
        scheduler=dataclasses.replace(cfg.scheduler, alpha_s=alpha_s, beta_s=beta_s),
        workload=dataclasses.replace(cfg.workload, **workload),
    )
    return simulate(c, cost=COST).summary


def test_offline_best_is_the_lowest_jct_of_direct_runs():
    cfg = _base()
    space = AdviseSpace(pd=pd_splits(3), alpha_s=(0.5, 3.0), beta_s=(5.0,))
    report = advise(cfg, space, cost=COST)
    assert len(report["candidates"]) == 4
    direct = {
        (p, d, a): _direct(cfg, p, d, a, 5.0)["jct_s"]
        for p, d in [(1, 2), (2, 1)]
        for a in (0.5, 3.0)
    }
    for row in report["candidates"]:
        assert row["jct_s"] == pytest.approx(
            direct[(row["prefill_nodes"], row["decode_nodes"], row["alpha_s"])], rel=1e-12
        )
    best = report["best"]
    assert best["jct_s"] == min(direct.values())
    # storage-bound tiny cluster: more decode nodes pool more storage NICs for DualPath
    assert (best["prefill_nodes"], best["decode_nodes"]) == (1, 2)
    assert report["bottleneck_free_range"]["lower_str"] == "1/7"
    assert "best: 1P2D" in format_report(report)


def test_online_capacity_matches_direct_runs():
    base = _base()
    cfg = dataclasses.replace(
        base,
        workload=dataclasses.replace(
            base.workload, agents=8, trajectories=8, ttft_slo_s=2.0, tpot_slo_s=10.0
        ),
    )
    rates = (0.05, 0.2, 0.5, 1.0, 2.0)
    report = advise(
        cfg,
        AdviseSpace(pd=((1, 1), (1, 2)), alpha_s=(3.0,), beta_s=(5.0,)),
        cost=COST,
        objective="capacity",
        aps=rates,
        attainment=0.9,
    )
    for row in report["candidates"]:
        cap = 0.0
        for aps in rates:
            s = _direct(
                cfg, row["prefill_nodes"], row["decode_nodes"], 3.0, 5.0, mode="online", aps=aps
            )
            if s["slo_attainment"] < 0.9 or s["errors"]:
                break
            cap = aps
        assert row["capacity_aps"] == cap
    caps = {
        (r["prefill_nodes"], r["decode_nodes"]): r["capacity_aps"] for r in report["candidates"]
    }
    assert caps[(1, 2)] > caps[(1, 1)] > 0  # the extra decode node's storage NIC raises capacity
    assert (report["best"]["prefill_nodes"], report["best"]["decode_nodes"]) == (1, 2)


def test_gpu_preset_candidates_get_their_own_default_cost():
    """Without `cost`, each split runs with the roofline of its own expert-parallel width, the
    same as a direct `simulate(candidate, cost=None)`; a factory is called with each candidate."""
    cfg, cost_1p1d = paper_experiment("ds27b", 1, 1, agents=2, max_turns=3, snic_bytes_per_s=1e9)
    options = SimOptions(kv_format=PAPER_MODELS["ds27b"].kv_format)
    space = AdviseSpace(pd=((1, 1), (1, 3)), alpha_s=(3.0,), beta_s=(5.0,))
    report = advise(cfg, space, options=options)
    seen = []
    factory = advise(
        cfg, space, cost=lambda c: seen.append(c.cluster.decode_nodes) or COST, options=options
    )
    assert seen == [1, 3]
    for row, fixed in zip(report["candidates"], factory["candidates"]):
        c = candidate_config(cfg, row["prefill_nodes"], row["decode_nodes"], 3.0, 5.0)
        assert row["jct_s"] == simulate(c, options=options).summary["jct_s"]
        assert fixed["jct_s"] == simulate(c, cost=COST, options=options).summary["jct_s"]
    wide = candidate_config(cfg, 1, 3, 3.0, 5.0)  # 24 expert-parallel GPUs, not 1P1D's 8
    assert (
        report["candidates"][1]["jct_s"]
        != simulate(wide, cost=cost_1p1d, options=options).summary["jct_s"]
    )


def test_paper_hardware_range_and_splits():
    r = bottleneck_free_range(HOPPER_NODE)
    assert r is not None and r.lower == pytest.approx(1 / 7) and r.upper == pytest.approx(3.5)
    assert r.contains(2, 4) and not r.contains(4, 1)
    assert bottleneck_free_range(dataclasses.replace(HOPPER_NODE, snic_bytes_per_s=0.0)) is None
    assert pd_splits(4) == ((1, 3), (2, 2), (3, 1))
    assert parse_pd("1p2d, 2P4D") == ((1, 2), (2, 4))


@pytest.mark.parametrize("bad", ["", "1p", "p2d", "1x2"])
def test_bad_pd_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        parse_pd(bad)


def test_bad_spaces_are_rejected():
    with pytest.raises(ValueError):
        AdviseSpace(pd=((0, 2),), alpha_s=(3.0,), beta_s=(5.0,))
    with pytest.raises(ValueError):
        pd_splits(1)
    with pytest.raises(ValueError, match="needs arrival rates"):
        advise(
            _base(),
            AdviseSpace(pd=((1, 1),), alpha_s=(3.0,), beta_s=(5.0,)),
            cost=COST,
            objective="capacity",
        )


def test_configure_gives_each_split_its_own_hardware():
    """A paper preset's HBM-for-KV depends on the split (weights per GPU under expert
    parallelism over the decode GPUs): `configure` builds each split's config, and the
    candidate equals a direct run of that config."""
    kw = dict(agents=2, max_turns=3, snic_bytes_per_s=1e9)
    cfg, _ = paper_experiment("ds660b", 2, 4, **kw)
    options = SimOptions(kv_format=PAPER_MODELS["ds660b"].kv_format)
    space = AdviseSpace(pd=((2, 4), (3, 3)), alpha_s=(3.0,), beta_s=(5.0,))
    built = []

    def configure(p, d):
        c, _ = paper_experiment("ds660b", p, d, **kw)
        built.append(c.hardware.hbm_bytes)
        return c

    report = advise(cfg, space, configure=configure, options=options)
    assert len(built) == 2 and built[0] != built[1]
    for row in report["candidates"]:
        p, d = row["prefill_nodes"], row["decode_nodes"]
        direct = candidate_config(paper_experiment("ds660b", p, d, **kw)[0], p, d, 3.0, 5.0)
        assert row["jct_s"] == simulate(direct, options=options).summary["jct_s"]
    with pytest.raises(ValueError, match="workload"):
        advise(
            cfg,
            space,
            configure=lambda p, d: paper_experiment("ds660b", p, d, agents=3)[0],
            options=options,
        )


def test_a_split_whose_weights_do_not_fit_is_infeasible():
    kw = dict(agents=2, max_turns=3, snic_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="does not fit"):
        paper_experiment("ds660b", 5, 1, **kw)
    cfg, _ = paper_experiment("ds660b", 2, 4, **kw)
    space = AdviseSpace(pd=((5, 1), (2, 4)), alpha_s=(3.0,), beta_s=(5.0,))
    report = advise(
        cfg,
        space,
        configure=lambda p, d: paper_experiment("ds660b", p, d, **kw)[0],
        options=SimOptions(kv_format=PAPER_MODELS["ds660b"].kv_format),
    )
    bad, good = report["candidates"]
    assert "no HBM for KV" in bad["infeasible"] and "infeasible" not in good
    assert report["best"] is good
    assert "infeasible" in format_report(report)
