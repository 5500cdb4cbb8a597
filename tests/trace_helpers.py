"""What the trace tests share: where the public traces sit (beside the repository; tests that
read them skip when absent), a CPU cost model for the simulator, Weka-format request and
subagent entries for the sessions the tests build, and `records` (the tests' `(id, [(ids,
gen), ...])` pairs as the `Trajectory` records `run_trajectories` takes)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.workload.trace import Round, Trajectory

ROOT = pathlib.Path(__file__).resolve().parents[1]
REAL_TRACES = ROOT.parent / "shared" / "real_traces"
WEKA_SESSIONS = REAL_TRACES / "weka_claude_code_sessions"
# A tiny model's fitted costs on a CPU: fast enough that simulated runs end in milliseconds.
CPU_COST = FittedCostModel(prefill=(0.02, 2e-5, 5e-9), decode=(0.005, 1e-4, 1e-8))


def req(t, n_in, n_out, ids, think=0.0, api=1.0, stop=None) -> dict:
    """A Weka request entry (`api` None leaves out api_time, `stop` None leaves out stop)."""
    out = {"t": t, "type": "n", "in": n_in, "out": n_out, "hash_ids": ids, "think_time": think}
    if api is not None:
        out["api_time"] = api
    if stop is not None:
        out["stop"] = stop
    return out


def sub(agent, t, requests, duration_s=None) -> dict:
    """A Weka subagent entry (`duration_s` None leaves out duration_ms)."""
    out = {"t": t, "type": "subagent", "agent_id": agent, "requests": requests}
    if duration_s is not None:
        out["duration_ms"] = duration_s * 1000
    return out


def records(trajs: Sequence[tuple[str, Sequence[tuple[Sequence[int], int]]]]) -> list[Trajectory]:
    """The cluster tests' trajectories, `(id, [(token ids, gen), ...])` pairs (what their
    lock-step and reference helpers index), as `run_trajectories`' `Trajectory` records."""
    return [Trajectory(tid, tuple(Round(tuple(a), g) for a, g in rounds)) for tid, rounds in trajs]
