"""Runs a workload on the simulated cluster and builds the same `summary.json` as the launchers.

    summary = simulate(cfg)                      # the cost model cfg names (roofline of hardware.gpu)
    summary = simulate(cfg, cost=fitted_model)   # e.g. a FittedCostModel of the CPU engines

Agents replay their trajectories per appendix A.3 (`sim.agents`): round i+1 is
submitted when round i is done, with prompt `A_1 G_1 ... A_{i+1}`. The hit of a round is what
the DE persisted for the previous round (every Full Block of its prompt + generated tokens but
the last, whose KV is never computed), less one block when it would cover the whole prompt
(the router's rule: at least one new token makes logits); a first round given as content pieces
(Mooncake and conversation traces) hits the prefix it shares with first rounds already finished
(`workload.sharing`). Offline: every agent starts at t = 0, JCT = time until the last round
finishes; online: agents arrive at `workload.arrivals.plan_agents` times (Poisson at
`workload.aps`, or a Mooncake trace's timestamps). Times are virtual seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import pathlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.metrics.summary import summarize
from dualpath_jax.presets.calibration import config_cost_model
from dualpath_jax.sched.cost import CostModel
from dualpath_jax.sim.agents import reference_request, schedule_agents
from dualpath_jax.sim.cluster import SimCluster
from dualpath_jax.sim.state import SimOptions
from dualpath_jax.workload.arrivals import plan_agents, plan_workload
from dualpath_jax.workload.trace import Trajectory


@dataclasses.dataclass
class SimRun:
    """What one simulation produced: the summary plus the raw pieces (for tests and plots)."""

    summary: dict[str, Any]
    cluster: SimCluster
    jct_s: float
    wall_s: float
    events: int


def build_agents(cfg: ExperimentConfig) -> tuple[list[Trajectory], list[float]]:
    """Every agent's trajectory (lengths only, never materialized) and its start time (s)."""
    return plan_agents(cfg)


def default_cost(cfg: ExperimentConfig, kv_format: str | None = None) -> CostModel:
    """The cost model `simulate` uses without one: the one the config names
    (`presets.config_cost_model`: the roofline of `hardware.gpu` with `hardware.calibration`,
    `fp8` and `kv_format`, routed experts spread over the GPUs of `hardware.ep_decode_nodes`
    decode nodes, by default all of them: the side that streams them every step). `kv_format`
    (`SimOptions.kv_format`) overrides `hardware.kv_format`."""
    return config_cost_model(cfg, kv_format=kv_format)


def simulate(
    cfg: ExperimentConfig,
    *,
    cost: CostModel | None = None,
    options: SimOptions | None = None,
    trajectories: Sequence[Trajectory] | None = None,
    arrivals: Sequence[float] | None = None,
    scheduler: Any = None,
    pause_gc: bool = True,
) -> SimRun:
    """Simulates `cfg`'s workload (or the given agents) and returns the run with its summary.

    `scheduler`: a `GlobalScheduler` to use as is, or a `GlobalScheduler` subclass that the
    cluster builds with its own alpha, beta and read rates (None: `GlobalScheduler`).

    `pause_gc`: Python's cyclic garbage collector is off for the whole call (workload, event
    loop, summary; back as it was after). The simulator frees its per-round objects by
    reference counting, making no reference cycles per round (`tests/sim/test_sim_cluster.py`),
    so the collector only traverses the run's live objects: 11% of the CPU time at 12P24D, 16%
    at 24P48D, and the summary of 2M rounds took 7.9 CPU s with it on against 4.3 off. Pass
    False when callbacks of your own (an `on_done`, a custom scheduler) make cycles as they go."""
    with _collector_paused(pause_gc):
        return _simulate(cfg, cost, options, trajectories, arrivals, scheduler)


def _simulate(
    cfg: ExperimentConfig,
    cost: CostModel | None,
    options: SimOptions | None,
    trajectories: Sequence[Trajectory] | None,
    arrivals: Sequence[float] | None,
    scheduler: Any,
) -> SimRun:
    record = None
    if trajectories is None:
        plan = plan_workload(cfg)
        trajectories, record = plan.trajectories, plan.record
        arrivals = plan.arrivals if arrivals is None else arrivals
    if arrivals is None:
        arrivals = [0.0] * len(trajectories)
    if len(arrivals) != len(trajectories):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trajectories)} agents")
    options = options or SimOptions()
    cost = cost or default_cost(cfg, options.kv_format)
    cluster = SimCluster(
        cfg, cost, options=options, scheduler=scheduler, ref_request=reference_request(trajectories)
    )
    done_at = schedule_agents(cluster, trajectories, arrivals)
    wall = time.perf_counter()
    cluster.loop.run()
    wall = time.perf_counter() - wall
    unfinished = sum(1 for a, d in enumerate(done_at) if math.isnan(d) and trajectories[a].rounds)
    finished = [d for d in done_at if not math.isnan(d)]
    jct = max(finished) - (min(arrivals) if arrivals else 0.0) if finished else 0.0
    w = cfg.workload
    summary = summarize(
        policy=cfg.scheduler.policy.value,
        mode=w.mode,
        emulated=cfg.hardware.emulated,
        agents=len(trajectories),
        results=cluster.results,
        errors=unfinished,
        jct_s=jct,
        reports=cluster.link_reports(cluster.loop.now),
        events=cluster.events,
        counters=dict(cluster.counters),
        ttft_slo_s=w.ttft_slo_s,
        tpot_slo_s=w.tpot_slo_s,
        window_s=options.window_s,
    )
    summary["config"] = cfg.name
    if record is not None:
        summary["workload"] = record
    summary["simulated"] = True
    summary["sim"] = {
        "events": cluster.loop.events,
        "wall_s": wall,
        "events_per_s": cluster.loop.events / wall if wall > 0 else 0.0,
        "alpha_tokens": cluster.alpha,
        "beta_tokens": cluster.beta,
        "kv_bytes_per_token": cluster.kvb,
        "quantum_s": options.quantum_s,
    }
    return SimRun(summary, cluster, jct, wall, cluster.loop.events)


@contextlib.contextmanager
def _collector_paused(pause: bool) -> Iterator[None]:
    was = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was:
            gc.enable()


def write_run(run: SimRun, workdir: str | pathlib.Path) -> None:
    """Writes `summary.json`, `outputs.jsonl` (lengths only: `{"id", "rounds": [gen, ...]}`, the
    simulator has no token ids) and `links/node<N>.json` (per-link series) to `workdir`."""
    wd = pathlib.Path(workdir)
    (wd / "links").mkdir(parents=True, exist_ok=True)
    for rep in run.cluster.link_reports(run.cluster.loop.now):
        (wd / "links" / f"node{rep['node']}.json").write_text(json.dumps(rep))
    rounds: dict[str, list[int]] = {}
    for r in run.cluster.results:
        traj = r.request.rsplit("/r", 1)[0]
        rounds.setdefault(traj, []).append(len(r.tokens))
    with open(wd / "outputs.jsonl", "w") as f:
        for tid, gens in rounds.items():
            f.write(json.dumps({"id": tid, "rounds": gens, "lengths_only": True}) + "\n")
    (wd / "summary.json").write_text(json.dumps(run.summary, indent=1, default=_jsonable))


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
