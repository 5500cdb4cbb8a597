"""Loads `configs/NAME.py[:ARG]` experiment files (used by launchers and tests)."""

from __future__ import annotations

import importlib.util
import pathlib

from dualpath_jax.config import ConfigError, ExperimentConfig, validate


def load_config(spec: str) -> ExperimentConfig:
    """`path/to/file.py[:ARG]` -> the file's `get_config(ARG)` (or `get_config()` without ARG),
    which must be a valid ExperimentConfig (`validate`)."""
    path, _, arg = spec.partition(":")
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    mod_spec = importlib.util.spec_from_file_location(f"_dp_config_{p.stem}", p)
    assert mod_spec and mod_spec.loader
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} defines no get_config(arg)")
    cfg = module.get_config(arg) if arg else module.get_config()
    if not isinstance(cfg, ExperimentConfig):
        raise ConfigError(
            f"{path}:get_config returned {type(cfg).__name__}, expected an ExperimentConfig"
        )
    return validate(cfg)
