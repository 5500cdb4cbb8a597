"""Decode spans (`SimOptions.decode_macro_steps`): many decode steps per event give the same
run as one event per step, up to the span's mean-context timing."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_jax.config import Policy
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sched.types import Request
from dualpath_jax.sim import SimOptions, simulate
from dualpath_jax.sim.core import EventLoop
from dualpath_jax.sim.decode import DecodeSteps
from dualpath_jax.sim.leaders import Leader
from dualpath_jax.sim.state import HostBuffer, RoundState, SimEngine

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


# --------------------------------------------------------------------------- DecodeSteps alone


class StepCost:
    """A decode step of `dt` seconds whatever the batch and context."""

    def __init__(self, dt: float):
        self.dt = dt

    def decode_step_time(self, batch: int, context: int) -> float:
        return self.dt


def _de(hbm_tokens: int = 10_000, slots: int = 8) -> SimEngine:
    return SimEngine(0, 0, 0, "decode", HostBuffer(0), hbm_tokens=hbm_tokens, slots=slots)


def _waiting(de: SimEngine, name: str, prompt: int, gen: int) -> RoundState:
    st = RoundState(Request(name, "t", 0, prompt, 0, gen), 0, 0.0, lambda s: None)
    st.generated = 1  # the PE's first token
    de.waiting.append(st)
    return st


@pytest.mark.parametrize("macro", [False, True])
def test_requests_finish_after_their_own_steps(macro):
    loop, dt = EventLoop(), 0.01
    done: dict[str, float] = {}
    dec = DecodeSteps(
        loop,
        StepCost(dt),
        lambda de, st: done.__setitem__(st.request.id, loop.now),
        macro_steps=macro,
    )
    de = _de()
    a, b = _waiting(de, "a", 100, 3), _waiting(de, "b", 50, 5)
    dec.admit(de)
    assert de.stepping and de.hbm_used == a.request.hbm_tokens + b.request.hbm_tokens
    events = loop.run()
    # gen - 1 steps each after the PE's token; the second token at the first step's end.
    assert done == {"a": pytest.approx(2 * dt), "b": pytest.approx(4 * dt)}
    assert a.t_second == b.t_second == pytest.approx(dt)
    assert not de.active and not de.stepping and de.ctx_sum == 0 and de.steps == 4
    assert events == (2 if macro else 4)  # one event per span: up to each finish


def test_admission_mid_span_cuts_it_after_the_step_in_progress():
    loop, dt = EventLoop(), 0.01
    done: dict[str, float] = {}
    dec = DecodeSteps(loop, StepCost(dt), lambda de, st: done.__setitem__(st.request.id, loop.now))
    de = _de()
    _waiting(de, "long", 100, 11)
    dec.admit(de)
    assert de.span[2] == 10  # one span to the end
    late: list[RoundState] = []

    def arrive():
        late.append(_waiting(de, "late", 100, 3))
        dec.admit(de)

    loop.at(2.5 * dt, arrive)
    loop.run()
    # The late request joins at the third step's end: its two steps are the 4th and 5th.
    assert late[0].t_second == pytest.approx(4 * dt)
    assert done == {"long": pytest.approx(10 * dt), "late": pytest.approx(5 * dt)}


def test_admission_respects_hbm_and_slots_in_order():
    loop = EventLoop()
    dec = DecodeSteps(loop, StepCost(0.01), lambda de, st: None)
    de = _de(hbm_tokens=300, slots=2)
    for name in "abc":
        _waiting(de, name, 100, 4)  # 103 HBM tokens each
    dec.admit(de)
    assert [s.request.id for s in de.active.values()] == ["a", "b"]
    assert [s.request.id for s in de.waiting] == ["c"]
    loop.run()  # a and b finish, then c is admitted and decoded
    assert not de.waiting and not de.active and de.hbm_used == 0


def test_leader_timing_and_step_ends():
    loop, dt = EventLoop(), 0.01
    leader = Leader(period=0.05, phase=0.0)
    dec = DecodeSteps(
        loop, StepCost(dt), lambda de, st: None, leaders={0: leader}, fetch_interval_s=0.05
    )
    de = _de()
    _waiting(de, "a", 100, 11)
    loop.at(0.12, dec.admit, de)
    seen = {}

    def look():
        seen["last"] = leader.last
        seen["next_end"] = dec.step_end_after(de, 0.155)
        seen["beyond"] = dec.step_end_after(de, 1.0)

    loop.at(0.15, look)
    loop.run()
    # Going busy at 0.12: its last fetch is its last idle poll (0, 0.05, 0.10, ...).
    assert seen["last"] == pytest.approx(0.10)
    # One span of 10 steps from 0.12: step ends at 0.13, 0.14, ...; none past the span's end.
    assert seen["next_end"] == pytest.approx(0.16)
    assert seen["beyond"] == pytest.approx(0.22)
    # The loop's check at the span's end: an interval has passed, so it fetched then.
    assert leader.last == pytest.approx(0.22)
