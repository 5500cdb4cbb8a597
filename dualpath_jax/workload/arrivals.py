"""Agent arrival schedules: offline (N agents at t=0) and online (Poisson arrivals at APS).

Pure generators over an injected `numpy.random.Generator`; times are seconds from the start of
the run, so a real clock (router) and a simulated clock (simulator) consume the same schedule.
Each arrival starts one agent, which replays one trajectory round by round. A trace with
arrival times (Mooncake) keeps them online: `trace_arrivals`. Between its rounds an agent waits
its rounds' `gap_s` (tool calls): from the trace, or drawn by `tool_gaps`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from dualpath_jax.config import ExperimentConfig, WorkloadConfig
from dualpath_jax.workload.synthetic import load_workload
from dualpath_jax.workload.trace import Trajectory, expand, materialize


@dataclasses.dataclass(frozen=True)
class Arrival:
    time_s: float
    agent: int  # index into the agents' trajectory list


def offline_arrivals(n_agents: int) -> Iterator[Arrival]:
    """Every agent starts at t = 0 (offline batch inference; JCT = time until all finish)."""
    if n_agents < 1:
        raise ValueError(f"n_agents must be >= 1, got {n_agents}")
    for i in range(n_agents):
        yield Arrival(0.0, i)


def poisson_arrivals(
    aps: float,
    rng: np.random.Generator,
    *,
    duration_s: float | None = None,
    count: int | None = None,
    start_s: float = 0.0,
) -> Iterator[Arrival]:
    """Poisson agent arrivals at `aps` agents per second, until `duration_s` has passed or
    `count` agents arrived (at least one bound is required). Inter-arrival times are
    exponential, drawn from `rng` one at a time."""
    if aps <= 0:
        raise ValueError(f"aps must be > 0, got {aps}")
    if duration_s is None and count is None:
        raise ValueError("poisson_arrivals needs duration_s or count")
    t = start_s
    i = 0
    while count is None or i < count:
        t += float(rng.exponential(1.0 / aps))
        if duration_s is not None and t > start_s + duration_s:
            return
        yield Arrival(t, i)
        i += 1


def agent_trajectories(
    trajectories: Sequence[Trajectory],
    n_agents: int,
    rng: np.random.Generator,
    *,
    max_len: int | None = None,
) -> list[Trajectory]:
    """One trajectory per agent: the originals, then appendix A.3 expansions (see `expand`)."""
    return expand(trajectories, n_agents, rng, max_len=max_len)


def schedule(cfg: WorkloadConfig, rng: np.random.Generator) -> Iterator[Arrival]:
    """The arrival schedule a `WorkloadConfig` asks for: offline `agents`, or online Poisson
    arrivals at `aps` for `duration_s` (or `agents` arrivals if `duration_s` is 0)."""
    if cfg.mode == "offline":
        return offline_arrivals(cfg.agents)
    if cfg.mode == "online":
        return poisson_arrivals(
            cfg.aps,
            rng,
            duration_s=cfg.duration_s or None,
            count=None if cfg.duration_s else cfg.agents,
        )
    raise ValueError(f"workload.mode must be 'offline' or 'online', got {cfg.mode!r}")


def trace_arrivals(start_s: Sequence[float], cfg: WorkloadConfig) -> list[float]:
    """Online arrivals of a trace with start times (seconds from its first request, ascending):
    as recorded, or with `aps > 0` on a clock scaled so the whole trace arrives at `aps` agents
    per second on average; then those before `duration_s` (if set), else the first `agents`."""
    times = [t - start_s[0] for t in start_s] if start_s else []
    if cfg.aps > 0 and len(times) > 1 and times[-1] > 0:
        k = (len(times) - 1) / times[-1] / cfg.aps
        times = [t * k for t in times]
    if cfg.duration_s:
        return [t for t in times if t <= cfg.duration_s]
    return times[: cfg.agents]


def plan_agents(
    cfg: ExperimentConfig, *, vocab_size: int | None = None
) -> tuple[list[Trajectory], list[float]]:
    """Every agent's trajectory (not materialized) and its start time in seconds: a timed trace
    online arrives at its own times (`trace_arrivals`); otherwise agents arrive by `schedule` and
    replay the workload's trajectories, expanded to one per agent (`agent_trajectories`)."""
    w = cfg.workload
    rng = np.random.default_rng(w.seed)
    base, start_s = load_workload(w, vocab_size=vocab_size)
    if start_s is not None and w.mode == "online":
        arrivals = trace_arrivals(start_s, w)
        return tool_gaps(base[: len(arrivals)], w), arrivals
    arrivals = [a.time_s for a in schedule(w, rng)]
    agents = agent_trajectories(base, len(arrivals), rng, max_len=w.max_len or None)
    return tool_gaps(agents, w), arrivals


def tool_gaps(trajs: Sequence[Trajectory], cfg: WorkloadConfig) -> list[Trajectory]:
    """Gives every round after the first that has no `gap_s` a tool call of `tool_gap_s` seconds
    on average: log-normal with shape `tool_gap_sigma` (0: always the mean), seeded by `seed`.
    Unchanged when `tool_gap_s` is 0."""
    if cfg.tool_gap_s <= 0:
        return list(trajs)
    rng = np.random.default_rng((cfg.seed, 0x6A9))
    sigma = cfg.tool_gap_sigma
    out = []
    for t in trajs:
        draws = rng.lognormal(-sigma * sigma / 2, sigma, len(t.rounds)) * cfg.tool_gap_s
        rounds = tuple(
            r if i == 0 or r.gap_s else dataclasses.replace(r, gap_s=float(g))
            for i, (r, g) in enumerate(zip(t.rounds, draws))
        )
        out.append(Trajectory(t.id, rounds))
    return out


def build_trajectories(cfg: ExperimentConfig) -> tuple[list[Trajectory], list[float]]:
    """The materialized trajectory of every agent and its start time (seconds)."""
    trajs, arrivals = plan_agents(cfg, vocab_size=cfg.model.vocab_size)
    w = cfg.workload
    return [materialize(t, cfg.model.vocab_size, w.seed) for t in trajs], arrivals


def as_rounds(trajs: Sequence[Trajectory]) -> list[tuple[str, list[tuple]]]:
    """Materialized trajectories as `rollout.run_trajectories` takes them:
    `(id, [(append token ids, gen), ...])`, a round with a tool call `(ids, gen, gap_s)`."""
    return [
        (t.id, [(list(r.append), r.gen, *((r.gap_s,) if r.gap_s else ())) for r in t.rounds])
        for t in trajs
    ]
