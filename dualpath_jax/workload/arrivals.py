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

from dualpath_jax.config import ConfigError, ExperimentConfig, WorkloadConfig
from dualpath_jax.workload.synthetic import read_workload
from dualpath_jax.workload.trace import Round, Trajectory, expand, materialize, turn_specs


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


def schedule(
    cfg: WorkloadConfig, rng: np.random.Generator, trajectories: int | None = None
) -> Iterator[Arrival]:
    """The arrival schedule a `WorkloadConfig` asks for: offline `agents`, or online Poisson
    arrivals at `aps` for `duration_s` (or `agents` arrivals if `duration_s` is 0). `agents`
    None: one per trajectory (`trajectories`, the workload's count)."""
    agents = cfg.agents if cfg.agents is not None else trajectories
    if agents is None:
        raise ValueError("workload.agents is None (one per trajectory): pass the trajectory count")
    if cfg.mode == "offline":
        return offline_arrivals(agents)
    if cfg.mode == "online":
        return poisson_arrivals(
            cfg.aps,
            rng,
            duration_s=cfg.duration_s or None,
            count=None if cfg.duration_s else agents,
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
    return times if cfg.agents is None else times[: cfg.agents]


@dataclasses.dataclass(frozen=True)
class WorkloadPlan:
    """What `plan_workload` made: every agent's trajectory (not materialized), its start time in
    seconds, and `record`: how the source was turned into them (what `summary.json` keeps under
    `workload`: the source, how many trajectories it held, the agents run and how many of them
    are synthetic copies, the scaling and cuts applied, how they arrive)."""

    trajectories: list[Trajectory]
    arrivals: list[float]
    record: dict


def plan_workload(cfg: ExperimentConfig, *, vocab_size: int | None = None) -> WorkloadPlan:
    """Every agent's trajectory and start time: a timed trace online arrives at its own times
    (`trace_arrivals`); otherwise agents arrive by `schedule` and replay the workload's
    trajectories, expanded to one per agent (`agent_trajectories`) when `agents` asks for more."""
    w = cfg.workload
    rng = np.random.default_rng(w.seed)
    base, start_s, truncated = read_workload(w, vocab_size=vocab_size)
    if start_s is not None and w.mode == "online":
        arrivals = trace_arrivals(start_s, w)
        agents = tool_gaps(base[: len(arrivals)], w)
        how = "recorded" if w.aps <= 0 else f"recorded, clock scaled to {w.aps:g} agents/s"
    else:
        arrivals = [a.time_s for a in schedule(w, rng, len(base))]
        agents = tool_gaps(
            agent_trajectories(base, len(arrivals), rng, max_len=w.max_len or None), w
        )
        how = "offline" if w.mode == "offline" else f"poisson at {w.aps:g} agents/s"
    record = {
        "source": w.trace_format if w.trace else f"synthetic {w.preset}",
        **({"trace": w.trace} if w.trace else {}),
        "trajectories": len(base),
        "agents": len(agents),
        "expanded": max(0, len(agents) - len(base)),
        "length_scale": w.length_scale,
        "max_len": w.max_len,
        "truncated": truncated,
        "max_turns": w.max_turns,
        "arrivals": how,
        "longest_request": max((t.total_len for t in agents), default=0),
    }
    return WorkloadPlan(agents, arrivals, record)


def plan_agents(
    cfg: ExperimentConfig, *, vocab_size: int | None = None
) -> tuple[list[Trajectory], list[float]]:
    """Every agent's trajectory (not materialized) and its start time in seconds
    (`plan_workload` without the record)."""
    plan = plan_workload(cfg, vocab_size=vocab_size)
    return plan.trajectories, plan.arrivals


def check_context(cfg: ExperimentConfig, trajs: Sequence[Trajectory]) -> None:
    """Raises `ConfigError` naming the longest request (trajectory, round, tokens) when it needs
    more context than the cluster holds (`model.max_seq_len`, `cluster.decode_max_len`), and the
    settings that would make it fit."""
    limit = min(cfg.model.max_seq_len, cfg.cluster.decode_max_len)
    if not trajs:
        return
    t = max(trajs, key=lambda t: t.total_len)
    if t.total_len <= limit:
        return
    last = turn_specs(t)[-1]
    which = (
        "cluster.decode_max_len"
        if cfg.cluster.decode_max_len <= cfg.model.max_seq_len
        else "model.max_seq_len"
    )
    w = cfg.workload
    raise ConfigError(
        f"the longest request, round {last.turn} of trajectory {t.id!r}, needs {t.total_len}"
        f" tokens ({last.prompt} prompt + {last.gen} generated) but the cluster holds {limit}"
        f" ({which}): raise {which}, or scale the workload down with --set"
        f" workload.length_scale=... (now {w.length_scale:g}) or cut it with --set"
        f" workload.max_len=... (now {w.max_len or 'none'})"
    )


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


def build_workload(cfg: ExperimentConfig) -> WorkloadPlan:
    """`plan_workload` with every trajectory materialized (token ids)."""
    plan = plan_workload(cfg, vocab_size=cfg.model.vocab_size)
    trajs = [materialize(t, cfg.model.vocab_size, cfg.workload.seed) for t in plan.trajectories]
    return dataclasses.replace(plan, trajectories=trajs)


def build_trajectories(cfg: ExperimentConfig) -> tuple[list[Trajectory], list[float]]:
    """The materialized trajectory of every agent and its start time (seconds)."""
    plan = build_workload(cfg)
    return plan.trajectories, plan.arrivals


def as_rounds(trajs: Sequence[Trajectory]) -> list[tuple[str, list[tuple]]]:
    """Materialized trajectories as tuples (the form `rollout.run_trajectories` took before it
    took the `Trajectory` records themselves; it converts them for one release, deprecated):
    `(id, [(append token ids, gen), ...])`, a round with a tool call `(ids, gen, gap_s)`, one
    that waits for other trajectories `(ids, gen, gap_s, waits_for)`, one whose gap is a user's
    think time rather than a tool call `(ids, gen, gap_s, waits_for, False)`; a trajectory that
    starts after another's round (`Trajectory.after`) `(id, rounds, after)`."""
    return [
        (t.id, [_round_tuple(r) for r in t.rounds], *((t.after,) if t.after else ())) for t in trajs
    ]


def _round_tuple(r: Round) -> tuple:
    if not r.tool_call and r.gap_s:
        return (list(r.append), r.gen, r.gap_s, r.waits_for, False)
    if r.waits_for:
        return (list(r.append), r.gen, r.gap_s, r.waits_for)
    return (list(r.append), r.gen, *((r.gap_s,) if r.gap_s else ()))
