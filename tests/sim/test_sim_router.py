"""The simulated router's bookkeeping: what each engine message changes in the loads it reports."""

from __future__ import annotations

import dataclasses

import pytest
from trace_helpers import CPU_COST

from dualpath_jax.config import Policy
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.sched.types import Assignment, ReadPath, Request
from dualpath_jax.sim.cluster import SimCluster


def _cluster(leader_phases: bool = True) -> SimCluster:
    from dualpath_jax.sim import SimOptions

    cfg = emulated_cpu_experiment(1, 1, "tiny")
    cfg = dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy.DUALPATH)
    )
    return SimCluster(cfg, CPU_COST, options=SimOptions(leader_phases=leader_phases))


def test_each_message_moves_the_loads_the_scheduler_will_see():
    cl = _cluster()
    router, pe, de = cl.router, cl.pes[0], cl.des[0]
    r = Request("t/r0", "t", 0, prompt_tokens=96, cached_tokens=64, gen_tokens=8)
    a = Assignment(r, pe.id, de.id, ReadPath.DE, pe_read_blocks=0, de_read_blocks=4)

    router.assigned(a, pe, 0, 64)
    assert (pe.seq, pe.tok) == (1, 96)
    assert router.read_q[de.node] == 64 and router.read_q[pe.node] == 0
    assert cl.counters["path_de"] == 1
    # The DE node's read queue reaches the scheduler with its next report.
    router._report_des()
    assert router._load(de).read_q == 64

    router.reads_done(de.node, 64)
    assert router.read_q[de.node] == 0
    router.prefilled(pe, r)
    assert (pe.seq, pe.tok) == (0, 0)

    de.seq, de.tok, de.hbm_promised = 1, r.tokens, r.hbm_tokens  # as a DE fetch leaves them
    router.done(de, r)
    assert (de.seq, de.tok, de.hbm_promised) == (0, 0, 0)
    router._report_des()
    assert router._de_loads[de.id].seq_e == 0
    assert router._load(de).free_hbm_tokens == de.hbm_tokens


@pytest.mark.parametrize("leader_phases", [True, False])
def test_a_submitted_round_is_placed_at_a_fetch_and_every_load_returns_to_idle(leader_phases):
    cl = _cluster(leader_phases)
    r = Request("t/r0", "t", 0, prompt_tokens=96, cached_tokens=0, gen_tokens=4)
    placed: list[int] = []
    place = cl.router._place
    cl.router._place = lambda req, e: (placed.append(e.id), place(req, e))
    cl.submit_round(r, 0, lambda st: None)
    assert placed == []  # placed at a later fetch (the group leader's, or the next pass)
    cl.loop.run()
    assert placed == [cl.des[0].id]
    assert len(cl.results) == 1 and cl.results[0].request == r.id
    # Every load is back to idle once the round is done.
    for e in (*cl.pes, *cl.des):
        assert (e.seq, e.tok, e.hbm_promised) == (0, 0, 0)
    assert not any(cl.router.read_q.values())
