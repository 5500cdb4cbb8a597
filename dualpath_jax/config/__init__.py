"""Frozen configuration dataclasses, JSON round trip and typed `key=value` overrides.

Every part of dualpath_jax takes its configuration as one of these dataclasses; nothing in the
library reads flags or environment variables. Experiment files in `configs/` build an
`ExperimentConfig` with `get_config(arg)`, and launchers apply `--set section.key=value` overrides
through `apply_overrides`.

Every name is imported from here (`dualpath_jax.config.X`); the modules behind it:
- `schema`: the dataclasses (`ExperimentConfig` and its sections), their enums, `ConfigError`;
- `validation`: `validate`, each field's type, range and relations to other fields;
- `serialize`: the JSON round trip (`to_json`, `from_json`, ...) and `apply_overrides`;
- `specs`: the strings with a grammar of their own, mesh shapes and ZeroMQ endpoints.
"""

from __future__ import annotations

from dualpath_jax.config.schema import (
    KV_SCALE_TILE,
    SOURCE_KNOBS,
    ClusterConfig,
    ConfigError,
    ExperimentConfig,
    HardwareConfig,
    ModelConfig,
    ModelFamily,
    Policy,
    RayConfig,
    SchedulerConfig,
    StoreConfig,
    WorkloadConfig,
)
from dualpath_jax.config.serialize import (
    apply_overrides,
    from_dict,
    from_json,
    to_dict,
    to_json,
)
from dualpath_jax.config.specs import (
    MESH_AXES,
    ROLES,
    mesh_size,
    parse_endpoint,
    parse_mesh,
    parse_resources,
)
from dualpath_jax.config.validation import validate

__all__ = [
    "KV_SCALE_TILE",
    "MESH_AXES",
    "ROLES",
    "SOURCE_KNOBS",
    "ClusterConfig",
    "ConfigError",
    "ExperimentConfig",
    "HardwareConfig",
    "ModelConfig",
    "ModelFamily",
    "Policy",
    "RayConfig",
    "SchedulerConfig",
    "StoreConfig",
    "WorkloadConfig",
    "apply_overrides",
    "from_dict",
    "from_json",
    "mesh_size",
    "parse_endpoint",
    "parse_mesh",
    "parse_resources",
    "to_dict",
    "to_json",
    "validate",
]
