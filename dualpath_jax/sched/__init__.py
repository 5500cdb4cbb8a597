"""Scheduling: request/load value objects, inter-engine cores and policies, the GlobalScheduler
shell, intra-engine batching under the compute quota, and cost models (the maths; GPU presets,
the roofline's calibration and `make_cost_model` are `dualpath_jax.presets`).

The router and the simulator call these same functions; nothing here reads a clock, a socket,
a flag or the environment.
"""

from dualpath_jax.sched.cost import (
    CostModel,
    FittedCostModel,
    GpuSpec,
    ModelCost,
    RooflineCostModel,
    derive_alpha,
    derive_alpha_beta,
    derive_beta,
    engines_beta,
)
from dualpath_jax.sched.inter import (
    assign_paths,
    choose_read_path,
    de_fetch,
    de_route,
    pe_fetch,
    split_blocks,
    z_threshold,
)
from dualpath_jax.sched.intra import (
    BatchPlan,
    PendingPrefill,
    PrefillChunk,
    PrefillQueue,
    admit_decode,
    pack_prefill_batch,
)
from dualpath_jax.sched.policy import (
    POLICY_SPECS,
    EngineChoice,
    InterEnginePolicy,
    PathMode,
    PolicySpec,
    make_policy,
    policy_spec,
)
from dualpath_jax.sched.scheduler import GlobalScheduler, QueueFull
from dualpath_jax.sched.types import (
    Assignment,
    ClusterView,
    EngineLoad,
    FetchResult,
    ReadPath,
    Request,
)

__all__ = [
    "Assignment",
    "BatchPlan",
    "ClusterView",
    "CostModel",
    "EngineChoice",
    "EngineLoad",
    "FetchResult",
    "FittedCostModel",
    "GlobalScheduler",
    "GpuSpec",
    "InterEnginePolicy",
    "ModelCost",
    "POLICY_SPECS",
    "PathMode",
    "PendingPrefill",
    "PolicySpec",
    "PrefillChunk",
    "PrefillQueue",
    "QueueFull",
    "ReadPath",
    "Request",
    "RooflineCostModel",
    "admit_decode",
    "assign_paths",
    "choose_read_path",
    "de_fetch",
    "de_route",
    "derive_alpha",
    "derive_alpha_beta",
    "derive_beta",
    "engines_beta",
    "make_policy",
    "pack_prefill_batch",
    "pe_fetch",
    "policy_spec",
    "split_blocks",
    "z_threshold",
]
