"""dualpath_jax: DualPath PD-disaggregated agentic inference with dual-path KV loading, in JAX."""

from dualpath_jax.config import (
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
    validate,
)
from dualpath_jax.configs_loader import load_config

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
    "load_config",
    "validate",
]
