"""Loads `configs/NAME.py[:ARG]` experiment files (used by launchers, notebooks and tests)."""

from __future__ import annotations

import importlib.util
import pathlib

from dualpath_jax.config import ConfigError, ExperimentConfig, validate

# The repository's experiment files, beside the package in a clone (`pip install -e .`).
CONFIGS_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def load_config(spec: str) -> ExperimentConfig:
    """`path/to/file.py[:ARG]` -> the file's `get_config(ARG)` (or `get_config()` without ARG),
    which must be a valid ExperimentConfig (`validate`). A bare `NAME[:ARG]` (no directory, no
    `.py`) names one of the repository's `configs/NAME.py`, wherever the caller runs."""
    path, _, arg = spec.partition(":")
    p = pathlib.Path(path)
    if not p.is_file() and p.suffix == "" and p.name == path:
        named = CONFIGS_DIR / f"{path}.py"
        if not named.is_file():
            known = sorted(f.stem for f in CONFIGS_DIR.glob("*.py")) if CONFIGS_DIR.is_dir() else []
            raise ConfigError(f"no config named {path!r}; known: {known}")
        p = named
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
