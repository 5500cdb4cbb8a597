"""`bench/paper_figures.py` and `bench/paper_runs.py`: one simulated run reduced to the figures'
numbers, the run cache, and every figure plus the headline table drawn from run results.

The full figures take hours; here one tiny real run of each mode (DS 27B 1P1D, a few agents, two
turns) gives the results' shape, and a runner that answers every spec with a copy of them, its
JCT and latencies scaled per policy and rate, drives every figure's code path in seconds.
"""

from __future__ import annotations

import copy
import json
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench(bench_modules):
    with bench_modules("paper_runs", "paper_figures") as mods:
        yield mods


@pytest.fixture(scope="module")
def tiny(bench):
    runs, _ = bench
    off = runs.Spec("ds27b", 1, 1, "dualpath", agents=4, max_turns=2)
    on = runs.Spec(
        "ds27b", 1, 1, "dualpath", 0, mode="online", aps=0.2, duration_s=40.0, max_turns=2
    )
    return {"offline": (off, runs.execute(off)), "online": (on, runs.execute(on))}


def test_execute_reduces_a_run_to_the_figures_numbers(tiny):
    spec, res = tiny["offline"]
    assert res["errors"] == 0
    assert res["requests"] == res["measured_rounds"] == 4 * 2
    assert res["jct_s"] > 0 and res["events"] > 0
    assert 0 < res["ttft_s"]["p50"] <= res["ttft_s"]["p90"] <= res["ttft_s"]["p99"]
    assert res["agent_jct_mean_s"] <= res["jct_s"]
    assert 0.0 <= res["slo_attainment"] <= 1.0
    # One storage-NIC series per node (two nodes at 1P1D), balance keys per window size.
    assert sorted(res["snic_series"]) == ["snic_rx:node0", "snic_rx:node1"]
    assert {"all_1s", "busy_10s", "run"} <= set(res["snic_balance"])
    assert res["spec"]["model"] == "ds27b"
    json.dumps(res)  # cached as JSON
    spec, res = tiny["online"]
    assert res["errors"] == 0
    # Online: only rounds submitted in the second half of the arrivals are measured.
    assert 0 < res["measured_rounds"] <= res["requests"]


def test_spec_names_are_unique_per_setting(bench):
    runs, _ = bench
    base = runs.Spec("ds660b", 2, 4, "dualpath", 2048)
    variants = [
        base,
        runs.Spec("ds660b", 2, 4, "basic", 2048),
        runs.Spec("ds660b", 2, 4, "dualpath", 1024),
        runs.Spec("ds660b", 2, 4, "dualpath", 2048, preset="32k"),
        runs.Spec("ds660b", 2, 4, "dualpath", 2048, append_scale=2.0),
        runs.Spec("ds660b", 2, 4, "dualpath", 2048, gen_scale=0.5),
        runs.Spec("ds660b", 2, 4, "dualpath", 2048, max_turns=24),
        runs.Spec("ds660b", 2, 4, "dualpath", 2048, snic_gbps=168.0),
        runs.Spec("ds660b", 2, 4, "dualpath", 2048, ep_decode_nodes=4),
        runs.Spec("ds660b", 2, 4, "dualpath", 0, mode="online", aps=0.4, duration_s=900.0),
        runs.Spec("ds660b", 2, 4, "dualpath", 0, mode="online", aps=0.4, duration_s=3600.0),
    ]
    assert len({v.name for v in variants}) == len(variants)
    assert base.name == "ds660b_2p4d_dualpath_64k_n2048"


def test_runner_caches_runs_and_applies_its_storage_rate(bench, tiny, tmp_path, monkeypatch):
    runs, _ = bench
    spec, res = tiny["offline"]
    calls = []

    def fake_execute(s):
        calls.append(s)
        return {**res, "spec": {"snic_gbps": s.snic_gbps}}

    monkeypatch.setattr(runs, "execute", fake_execute)
    runner = runs.Runner(tmp_path, jobs=1, snic_gbps=168.0)
    got = runner.get([spec, spec])
    assert len(calls) == 1 and calls[0].snic_gbps == 168.0
    assert got[spec]["spec"]["snic_gbps"] == 168.0  # keyed by the spec asked for
    assert (tmp_path / "runs" / f"{calls[0].name}.json").exists()
    runner.get([spec])
    assert len(calls) == 1  # the second ask reads the cache
    with pytest.raises(runs.Collected) as c:
        runs.Runner(tmp_path, jobs=1, collect=True).get([spec])
    assert c.value.specs == [spec]


POLICY_SCALE = {
    "basic": 1.6,
    "layerwise": 1.4,
    "dualpath_rr": 1.15,
    "dualpath": 1.0,
    "oracle": 0.97,
}


class ScaledRunner:
    """Answers every spec with a copy of the tiny run of its mode: offline JCT scaled per policy,
    online latencies growing with the rate (so the capacity search meets a failing rate)."""

    def __init__(self, tiny, asked):
        self.tiny = tiny
        self.asked = asked

    def get(self, specs):
        out = {}
        for s in specs:
            self.asked.append(s)
            r = copy.deepcopy(self.tiny[s.mode][1])
            f = POLICY_SCALE[s.policy] * (s.d / s.p) ** -0.1
            r["jct_s"] *= f * (1 + s.agents / 4096)
            if s.mode == "online":
                r["ttft_s"] = {k: 10.0 * s.aps * f for k in ("p50", "p90", "p99", "mean")}
                r["slo_attainment"] = max(0.0, 1.0 - s.aps * f)
            out[s] = r
        return out


def test_every_figure_and_the_headline_table_draw_from_run_results(bench, tiny, tmp_path):
    runs, figures = bench
    plan = figures.Plan(quick=True, large=False)
    asked: list = []
    runner = ScaledRunner(tiny, asked)
    results = {}
    for name in figures.FIGURES:
        results[name] = getattr(figures, name)(plan, runner, tmp_path)
    drawn = sorted(p.name.split("_")[0] for p in tmp_path.glob("*.png"))
    assert drawn == ["fig10", "fig11", "fig12", "fig13", "fig7", "fig8", "fig9"]
    assert (tmp_path / "table3.md").exists()
    # Every figure asked for runs of its own; the quick plan's sizes reached the specs.
    assert all(s.max_turns == plan.turns for s in asked)
    assert {s.model for s in asked} == {"ds27b", "ds660b", "qwen32b"}
    # Numbers follow the runs: fig7's speedup is Basic's JCT over DualPath's.
    row = results["fig7"]["rows"][0]
    assert row["speedup"] == pytest.approx(row["basic"] / row["dualpath"])
    assert row["speedup"] == pytest.approx(1.6)
    red = results["fig12"]["reduction_pct"]
    assert red["dualpath"] == pytest.approx(100 * (1 - 1.0 / 1.6))
    rows = figures.headline(results, plan)
    assert rows and all({"what", "ours", "paper", "target_met"} <= set(r) for r in rows)
    table = figures.markdown(rows)
    assert table.count("\n") >= len(rows) + 1
    json.dumps(results, default=str)  # figures.json
