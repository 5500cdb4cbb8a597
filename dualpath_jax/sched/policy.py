"""Inter-engine policies behind one factory, `make_policy`.

A policy is an engine choice (the paper's load-aware fetches, or round robin) plus a read-path
mode. The launcher-level `config.Policy` values map onto them:

| config.Policy | policy      | engines    | read path                     | layerwise |
|---------------|-------------|------------|-------------------------------|-----------|
| basic         | pe_only     | load aware | PE side always                | no        |
| layerwise     | pe_only     | load aware | PE side always                | yes       |
| dualpath_rr   | round_robin | round robin| PE and DE side in turn        | yes       |
| dualpath      | dualpath    | load aware | shorter read queue            | yes       |
| split         | split       | load aware | both, by queue drain time     | yes       |
| oracle        | oracle      | load aware | nothing is read               | yes       |

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
from dualpath_jax.sched.types import Assignment, EngineLoad, FetchResult, Request


class PolicyName(enum.StrEnum):
    DUALPATH = "dualpath"
    ROUND_ROBIN = "round_robin"
    PE_ONLY = "pe_only"
    SPLIT = "split"
    ORACLE = "oracle"


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
    name: PolicyName
    engine_choice: EngineChoice
    path_mode: PathMode
    layerwise: bool = True  # layerwise prefill (off only for Basic)


POLICY_SPECS: dict[PolicyName, PolicySpec] = {
    PolicyName.DUALPATH: PolicySpec(PolicyName.DUALPATH, EngineChoice.LOAD_AWARE, PathMode.SHORTER),
    PolicyName.ROUND_ROBIN: PolicySpec(
        PolicyName.ROUND_ROBIN, EngineChoice.ROUND_ROBIN, PathMode.ALTERNATE
    ),
    PolicyName.PE_ONLY: PolicySpec(PolicyName.PE_ONLY, EngineChoice.LOAD_AWARE, PathMode.PE),
    PolicyName.SPLIT: PolicySpec(PolicyName.SPLIT, EngineChoice.LOAD_AWARE, PathMode.SPLIT),
    PolicyName.ORACLE: PolicySpec(PolicyName.ORACLE, EngineChoice.LOAD_AWARE, PathMode.NONE),
}

LAUNCHER_POLICIES: dict[Policy, PolicySpec] = {
    Policy.BASIC: dataclasses.replace(POLICY_SPECS[PolicyName.PE_ONLY], layerwise=False),
    Policy.LAYERWISE: POLICY_SPECS[PolicyName.PE_ONLY],
    Policy.DUALPATH_RR: POLICY_SPECS[PolicyName.ROUND_ROBIN],
    Policy.DUALPATH: POLICY_SPECS[PolicyName.DUALPATH],
    Policy.SPLIT: POLICY_SPECS[PolicyName.SPLIT],
    Policy.ORACLE: POLICY_SPECS[PolicyName.ORACLE],
}


def policy_spec(policy: SchedulerConfig | Policy | PolicyName | PolicySpec | str) -> PolicySpec:
    """Resolves a config, launcher policy, policy name or spec to a `PolicySpec`."""
    if isinstance(policy, PolicySpec):
        return policy
    if isinstance(policy, SchedulerConfig):
        policy = policy.policy
    if isinstance(policy, Policy):
        return LAUNCHER_POLICIES[policy]
    if isinstance(policy, PolicyName):
        return POLICY_SPECS[policy]
    if isinstance(policy, str):
        if policy in Policy._value2member_map_:
            return LAUNCHER_POLICIES[Policy(policy)]
        if policy in PolicyName._value2member_map_:
            return POLICY_SPECS[PolicyName(policy)]
        known = sorted({*Policy._value2member_map_, *PolicyName._value2member_map_})
        raise ValueError(f"unknown policy {policy!r}; known: {known}")
    raise TypeError(f"cannot make a policy from {type(policy).__name__}")


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
        )


# `PathMode.value` by member (the enum's `value` property runs as interpreted code)
_MODE_VALUE = {m: m.value for m in PathMode}


def make_policy(
    policy: SchedulerConfig | Policy | PolicyName | PolicySpec | str,
) -> InterEnginePolicy:
    """The one factory for inter-engine policies (see the module table for the mapping)."""
    return InterEnginePolicy(policy_spec(policy))
