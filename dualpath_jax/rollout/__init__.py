"""The RL-facing API: sessions of multi-turn trajectories, sync or async, and batch rollout.

    with LocalCluster(cfg, workdir) as cluster:
        session = Session(cluster.client(), "traj-0")
        tokens = session.step(append_tokens, gen_tokens)   # exactly gen_tokens new tokens

`run_trajectories(backend, trajectories)` replays many `workload.trace.Trajectory` records
concurrently (each one's rounds in order, appendix A.3) with a progress bar. Every backend
implements one contract, `Backend` (wire/backend.py): `Client` (a cluster's router) and
`InProcessBackend` (one model in this process, no disaggregation, for quick experiments); what a
backend cannot do raises `RolloutError(kind="unsupported")`.

Sampling: each round is drawn with one `SamplingParams` (`dualpath_jax.model.sampling_params`),
which the keywords `temperature`, `top_p` and `key` build (`round_sampling`): `temperature=0` is
greedy; above 0 pass an explicit JAX key (`Session.step(..., temperature=1.0, key=key)`), which
gives the round's seed; a round's tokens depend only on the params, the context and the key.
Every round's outcome is a `RoundResult`; with `logprobs=True` (or k, for k alternatives per
token) it carries each token's log-probabilities (`RoundResult.logprobs`, a `Logprobs`), and
`Session.step` returns a `Step` (tokens and logprobs) instead of the bare ids. RL loops push new
params between iterations with `update_params(params)` or `update_params_from_checkpoint(path)`
on either backend (see docs/rl.md).

Where things are: `session` (`Session`, `Step`, `step_group`, `round_sampling`),
`trajectories` (`run_trajectories`, `workload_trajectories`) over `schedule` (waits and starts)
and `replay` (a run's state, `TrajectoryOutput`), `inprocess` (`InProcessBackend`) and
`inprocess_batch` (its batch worker), `toy` (the RL notebooks' tiny policy and toy task).
"""

from __future__ import annotations

from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.results import Logprobs, RoundResult
from dualpath_jax.rollout.inprocess import InProcessBackend
from dualpath_jax.rollout.replay import TrajectoryOutput
from dualpath_jax.rollout.session import Session, Step, round_sampling, step_group
from dualpath_jax.rollout.trajectories import run_trajectories, workload_trajectories
from dualpath_jax.wire.backend import Backend
from dualpath_jax.wire.client_checks import RolloutError
from dualpath_jax.workload.trace import Round, Trajectory

# The name before this release (docs/api.md, "Moved and renamed"); kept for one release.
InProcessEngine = InProcessBackend

__all__ = [
    "Backend",
    "InProcessBackend",
    "InProcessEngine",
    "Logprobs",
    "RolloutError",
    "Round",
    "RoundResult",
    "SamplingParams",
    "Session",
    "Step",
    "Trajectory",
    "TrajectoryOutput",
    "round_sampling",
    "run_trajectories",
    "step_group",
    "workload_trajectories",
]
