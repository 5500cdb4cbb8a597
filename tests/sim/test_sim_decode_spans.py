"""Decode spans (`SimOptions.decode_macro_steps`): many decode steps per event give the same
run as one event per step, up to the span's mean-context timing."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_jax.config import Policy
from dualpath_jax.hardware import emulated_cpu_experiment
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sim import SimOptions, simulate

COST = FittedCostModel(prefill=(0.02, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-6))


@pytest.mark.parametrize("policy", ["basic", "dualpath", "oracle"])
def test_spans_match_per_step_events(policy):
    cfg = emulated_cpu_experiment(1, 2, "")
    cfg = dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
    )
    step = simulate(cfg, cost=COST, options=SimOptions(decode_macro_steps=False))
    span = simulate(cfg, cost=COST, options=SimOptions(decode_macro_steps=True))
    a, b = step.summary, span.summary
    assert b["requests"] == a["requests"] and b["errors"] == a["errors"] == 0
    assert b["tokens_generated"] == a["tokens_generated"]
    assert b["jct_s"] == pytest.approx(a["jct_s"], rel=0.01)
    assert b["tpot_s"]["mean"] == pytest.approx(a["tpot_s"]["mean"], rel=0.01)
    assert b["ttst_s"]["mean"] == pytest.approx(a["ttst_s"]["mean"], rel=0.02)
    assert span.events < step.events
