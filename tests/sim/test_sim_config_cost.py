"""`simulate(cfg)` without `cost=` builds the cost model the config names, so a config alone
reproduces a run of the paper's testbeds; an explicit `cost=` (and `SimOptions.kv_format`) wins."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_jax.presets import PAPER_CONFIGS, PAPER_MODELS, paper_config, paper_experiment
from dualpath_jax.sim import SimOptions, simulate
from dualpath_jax.sim.run import default_cost


def _same(a: dict, b: dict) -> None:
    skip = {"sim"}  # wall-clock timings
    assert {k: v for k, v in a.items() if k not in skip} == {
        k: v for k, v in b.items() if k not in skip
    }
    assert a["sim"]["events"] == b["sim"]["events"]


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_a_paper_config_alone_reproduces_the_explicit_run(name):
    key = name.split("_")[0]
    cfg = paper_config(f"{name},agents=6,max_turns=2")
    _, cost = paper_experiment(key, agents=6, max_turns=2)
    assert default_cost(cfg) == cost
    explicit = simulate(
        cfg, cost=cost, options=SimOptions(kv_format=PAPER_MODELS[key].kv_format or None)
    )
    alone = simulate(cfg)
    _same(alone.summary, explicit.summary)
    assert alone.cluster.kvb == explicit.cluster.kvb  # the config's KV format sizes transfers


def test_an_explicit_cost_model_and_kv_format_win():
    cfg = paper_config("ds27b_1p1d,agents=4,max_turns=2")
    bare = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, calibration="none"))
    _, cost = paper_experiment("ds27b", agents=4, max_turns=2)
    # The config names the bare roofline, but the calibrated cost model given wins.
    _same(simulate(bare, cost=cost).summary, simulate(cfg).summary)
    assert simulate(bare).summary["jct_s"] != simulate(cfg).summary["jct_s"]
    # SimOptions.kv_format overrides hardware.kv_format, for the transfers and the cost model.
    run = simulate(cfg, options=SimOptions(kv_format="bfloat16"))
    assert run.cluster.kvb == 2 * 576 * 30 and simulate(cfg).cluster.kvb == 656 * 30
