"""Inter-engine policies behind one factory, `make_policy`.

`config.Policy` is the one name of a policy, in configs, flags and code. Here, and only here, each
is resolved to the scheduler's internal `PolicySpec`: an engine choice (the paper's load-aware
fetches, or round robin), a read-path mode and whether prefill is layerwise:

| config.Policy | engines    | read path                     | layerwise |
|---------------|------------|-------------------------------|-----------|
| basic         | load aware | PE side always                | no        |
| layerwise     | load aware | PE side always                | yes       |
| dualpath_rr   | round robin| PE and DE side in turn        | yes       |
| dualpath      | load aware | shorter read queue            | yes       |
| split         | load aware | both, by queue drain time     | yes       |
| oracle        | load aware | nothing is read               | yes       |

`dualpath_rr` is the paper's "dual-path loading" ablation step and its round-robin baseline
for storage-NIC balance (Figure 13): both read paths are used, but neither the engines nor the
read side look at loads or read queues. Basic keeps the load-aware engine choice so that Basic vs DualPath isolates the read path; use
`dataclasses.replace(spec, engine_choice=EngineChoice.ROUND_ROBIN)` for a round-robin Basic.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence

from dualpath_jax.config import Policy, SchedulerConfig
from dualpath_jax.sched import inter
from dualpath_jax.sched.types import Assignment, EngineLoad, FetchResult, ReadPath, Request


class EngineChoice(enum.StrEnum):
    LOAD_AWARE = "load_aware"  # Algorithm 1 + the two-level DE fetch
    ROUND_ROBIN = "round_robin"


class PathMode(enum.StrEnum):
    SHORTER = "shorter"  # the side with the shorter read queue (paper 6.1)
    PE = "pe"  # always the PE read path (Basic)
    ALTERNATE = "alternate"  # PE side and DE side in turn (round robin)
    SPLIT = "split"  # divide each request's blocks between both sides
    NONE = "none"  # no reads (Oracle)


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What a policy does, as the scheduling cores see it (derived from `config.Policy`)."""

    engine_choice: EngineChoice
    path_mode: PathMode
    layerwise: bool = True  # layerwise prefill (off only for Basic)


POLICY_SPECS: dict[Policy, PolicySpec] = {
    Policy.BASIC: PolicySpec(EngineChoice.LOAD_AWARE, PathMode.PE, layerwise=False),
    Policy.LAYERWISE: PolicySpec(EngineChoice.LOAD_AWARE, PathMode.PE),
    Policy.DUALPATH_RR: PolicySpec(EngineChoice.ROUND_ROBIN, PathMode.ALTERNATE),
    Policy.DUALPATH: PolicySpec(EngineChoice.LOAD_AWARE, PathMode.SHORTER),
    Policy.SPLIT: PolicySpec(EngineChoice.LOAD_AWARE, PathMode.SPLIT),
    Policy.ORACLE: PolicySpec(EngineChoice.LOAD_AWARE, PathMode.NONE),
}


def policy_spec(policy: Policy | SchedulerConfig) -> PolicySpec:
    """The scheduler's spec of a policy (or of a scheduler config's policy)."""
    if isinstance(policy, SchedulerConfig):
        policy = policy.policy
    if not isinstance(policy, Policy):
        raise TypeError(
            f"a policy is a config.Policy (e.g. Policy.DUALPATH or Policy('dualpath')), got "
            f"{policy!r}; known: {[p.value for p in Policy]}"
        )
    return POLICY_SPECS[policy]


@dataclasses.dataclass(frozen=True)
class InterEnginePolicy:
    """The pure inter-engine decisions of one policy. Stateless: round-robin cursors are passed
    in and returned, so `GlobalScheduler` (or a test) owns them."""

    spec: PolicySpec

    @property
    def layerwise(self) -> bool:
        return self.spec.layerwise

    @property
    def reads(self) -> bool:
        """False for Oracle: storage reads are bypassed."""
        return self.spec.path_mode is not PathMode.NONE

    def pe_fetch(
        self,
        queue: Iterable[Request],
        pes: Sequence[EngineLoad],
        *,
        alpha: float,
        beta: float,
        cursor: int = 0,
    ) -> FetchResult:
        if self.spec.engine_choice is EngineChoice.ROUND_ROBIN:
            return inter.rr_pe_fetch(queue, pes, beta=beta, cursor=cursor)
        return inter.pe_fetch(queue, pes, alpha=alpha, beta=beta)

    def de_route(
        self,
        queue: Iterable[Request],
        group_tok: Mapping[int, int] | inter.GroupTotals,
        *,
        cursor: int = 0,
    ) -> tuple[tuple[tuple[Request, int], ...], int]:
        """Phase 1. Returns `(request, group)` routes and the next round-robin cursor."""
        if self.spec.engine_choice is EngineChoice.ROUND_ROBIN:
            return inter.rr_de_route(queue, sorted(group_tok), cursor=cursor)
        return inter.de_routes(queue, group_tok), cursor

    def de_fetch(
        self,
        queue: Iterable[Request],
        des: Sequence[EngineLoad],
        *,
        z_factor: float,
        cursor: int = 0,
        max_seqs: int = 0,
    ) -> FetchResult:
        if self.spec.engine_choice is EngineChoice.ROUND_ROBIN:
            return inter.rr_de_fetch(queue, des, cursor=cursor, max_seqs=max_seqs)
        return inter.de_fetch(queue, des, z_factor=z_factor, max_seqs=max_seqs)

    def assign_paths(
        self,
        pairs: Iterable[tuple[Request, int, int]],
        pe_node: Mapping[int, int],
        de_node: Mapping[int, int],
        read_q: Mapping[int, int],
        *,
        block_tokens: int,
        pe_read_rate: float = 1.0,
        de_read_rate: float = 1.0,
        turns: Mapping[int, int] | None = None,
        recompute: inter.RecomputeRule | None = None,
        held: Mapping[str, tuple[int, int, ReadPath]] | None = None,
    ) -> tuple[tuple[Assignment, ...], dict[int, int]]:
        return inter.assign_paths(
            pairs,
            pe_node,
            de_node,
            read_q,
            mode=_MODE_VALUE[self.spec.path_mode],
            block_tokens=block_tokens,
            pe_read_rate=pe_read_rate,
            de_read_rate=de_read_rate,
            turns=turns,
            recompute=recompute if self.reads else None,
            held=held if self.reads else None,
        )


# `PathMode.value` by member (the enum's `value` property runs as interpreted code)
_MODE_VALUE = {m: m.value for m in PathMode}


def make_policy(policy: Policy | SchedulerConfig) -> InterEnginePolicy:
    """The one factory for inter-engine policies (see the module table for the mapping)."""
    return InterEnginePolicy(policy_spec(policy))
