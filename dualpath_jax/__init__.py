"""dualpath_jax: DualPath PD-disaggregated agentic inference with dual-path KV loading, in JAX."""

# First: the compiled core, when a fresh build exists, replaces its modules before any is imported.
from dualpath_jax import _compiled

_compiled.install()

from dualpath_jax.config import (  # noqa: E402 (after the compiled core is installed)
    ClusterConfig,
    ConfigError,
    ExperimentConfig,
    HardwareConfig,
    ModelConfig,
    ModelFamily,
    Policy,
    SchedulerConfig,
    StoreConfig,
    WorkloadConfig,
    apply_overrides,
)

__version__ = "0.1.0"

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "ExperimentConfig",
    "HardwareConfig",
    "ModelConfig",
    "ModelFamily",
    "Policy",
    "SchedulerConfig",
    "StoreConfig",
    "WorkloadConfig",
    "apply_overrides",
]
