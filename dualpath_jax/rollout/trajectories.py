"""Many trajectories at once: `run_trajectories` replays `workload.trace.Trajectory` records
concurrently on any backend, each one's rounds in order (appendix A.3), with their tool-call
gaps, subagent waits and starts; `workload_trajectories(cfg)` is a config's workload as such
records. Re-exported by `dualpath_jax.rollout`."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from dualpath_jax.rollout.replay import Replay, RunOptions, TrajectoryOutput
from dualpath_jax.rollout.schedule import Schedule
from dualpath_jax.rollout.session import check_backend, round_sampling
from dualpath_jax.wire.backend import Backend
from dualpath_jax.workload.trace import Round, Trajectory


def workload_trajectories(cfg: Any) -> tuple[list[Trajectory], list[float]]:
    """The config's workload as `run_trajectories` input: one materialized `Trajectory` per
    agent (the Table 2 preset or trace file of `cfg.workload`, scaled, its appends token ids),
    and each agent's start time in seconds (all 0 offline; Poisson arrivals online)."""
    from dualpath_jax.workload.arrivals import build_trajectories

    trajs, arrivals = build_trajectories(cfg)
    return list(trajs), arrivals


def run_trajectories(
    backend: Backend,
    trajectories: Iterable[Trajectory],
    *,
    max_concurrent: int = 0,
    arrivals: Sequence[float] | None = None,
    progress: bool = True,
    timeout_s: float | None = None,
    temperature: float = 0.0,
    key: Any = None,
    top_p: float = 1.0,
    logprobs: bool | int = False,
    release: bool = False,
    priority: int | Sequence[int] = 0,
    ttl_s: float = -1.0,
    tool_calls: bool = False,
    stop_tokens: Sequence[int] = (),
) -> list[TrajectoryOutput]:
    """Replays `trajectories` (`workload.trace.Trajectory` records whose rounds' appends are
    token ids: `materialize` a trace's first) concurrently, each one's rounds in order.

    A round is submitted `Round.gap_s` seconds after the previous one finished (a tool call;
    with `tool_calls` the session gets a `tool_call` hint of that length as the gap begins, so
    its KV may be prefetched, `scheduler.prefetch`, unless `Round.tool_call` is False: a user's
    think time). A round whose `waits_for` names trajectories of this call also waits until each
    has ended (its subagents; finished or failed), its gap then counted from the last of those
    ends (`workload.trace.submit_time`; ids not in the call are ignored). A trajectory whose
    `after` is `(parent id, round index, delay_s)` starts `delay_s` after that round of that
    trajectory of this call ended, or when the parent ends without it (a parent not in the call
    leaves it to its arrival). A cycle of waits, or a round waiting for a trajectory that starts
    after it, is a ValueError.

    `max_concurrent` bounds how many trajectories run at once (0: all; with it, a trajectory may
    wait only for earlier ones, which hold their slots first, and none may start after another's
    round); `arrivals` gives each trajectory's start time in seconds after the call (online
    replay; default: all at once). With `temperature > 0`, round i of trajectory k is sampled
    with `fold_in(fold_in(key, k), i)` (and `top_p`; `round_sampling`); with `logprobs` each
    round's result carries its tokens' log-probabilities; `stop_tokens` end any round early
    (`Session.step_async`). `priority` (one for all, or one per trajectory) and `ttl_s` set each
    session's KV retention (`Session`). Each trajectory's session is closed when it ends (its
    stored blocks are the first to go under capacity pressure); with `release=True` the sessions
    are closed together at the end instead, deleting their stored blocks (until then later
    trajectories can hit prefixes they share with earlier ones). After `timeout_s` no round
    starts and the unfinished trajectories' sessions are closed. Returns one output per
    trajectory, in input order; a failed round ends its trajectory with `error` set.

    Deprecated, for one release: trajectories as tuples `(id, [(append, gen[, gap_s[,
    waits_for[, tool_call]]]), ...][, after])` are converted at the door (`as_trajectories`)
    with a DeprecationWarning.
    """
    round_sampling(temperature, top_p, key, logprobs)  # bad keywords fail the call
    check_backend(backend)
    trajs = as_trajectories(trajectories)
    if arrivals is not None and len(arrivals) != len(trajs):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trajs)} trajectories")
    if isinstance(priority, numbers.Integral):
        priorities = [int(priority)] * len(trajs)
    else:
        priorities = [int(p) for p in priority]
    if len(priorities) != len(trajs):
        raise ValueError(f"{len(priorities)} priorities for {len(trajs)} trajectories")
    schedule = Schedule.plan(trajs, max_concurrent)
    if not trajs:
        return []
    opts = RunOptions(
        temperature=temperature, key=key, top_p=top_p, logprobs=logprobs,
        stop_tokens=tuple(stop_tokens), priorities=priorities, ttl_s=ttl_s, release=release,
        tool_calls=tool_calls, max_concurrent=max_concurrent,
    )  # fmt: skip
    return Replay(backend, trajs, schedule, opts, progress).run(arrivals, timeout_s)


def as_trajectories(trajectories: Iterable[Trajectory | tuple]) -> list[Trajectory]:
    """`run_trajectories`' input as `Trajectory` records, checked: every append must be token
    ids (ValueError: an int append is a length, `materialize` it). A tuple (the form before
    `Trajectory` records, kept for one release) is converted with a DeprecationWarning."""
    out, legacy = [], False
    for t in trajectories:
        if not isinstance(t, Trajectory):
            legacy = True
            t = _from_tuple(t)
        for i, r in enumerate(t.rounds):
            if isinstance(r.append, int):
                raise ValueError(
                    f"round {i} of {t.id!r} appends {r.append} tokens, not token ids:"
                    " materialize the trajectory first (workload.trace.materialize)"
                )
        out.append(t)
    if legacy:
        warnings.warn(
            "run_trajectories takes workload.trace.Trajectory records; trajectories as tuples"
            " are deprecated and will be refused in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
    return out


def _from_tuple(t: tuple) -> Trajectory:
    """`(id, rounds[, after])` with rounds `(append, gen[, gap_s[, waits_for[, tool_call]]])`
    as a `Trajectory` (ValueError for what the records refuse)."""
    rounds = []
    for i, rd in enumerate(t[1]):
        waits = rd[3] if len(rd) > 3 else ()
        if isinstance(waits, str):
            raise ValueError(f"round {i} of {t[0]!r}: waits_for must be a sequence of ids")
        rounds.append(
            Round(
                tuple(rd[0]),
                rd[1],
                gap_s=float(rd[2]) if len(rd) > 2 else 0.0,
                waits_for=tuple(waits),
                tool_call=bool(rd[4]) if len(rd) > 4 else True,
            )
        )
    after = tuple(t[2]) if len(t) > 2 and t[2] else None
    return Trajectory(t[0], tuple(rounds), after)
