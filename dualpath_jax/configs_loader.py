"""Loads `configs/NAME.py[:ARG]` experiment files (used by launchers, notebooks and tests)."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Callable
from types import ModuleType

from dualpath_jax.config import ConfigError, ExperimentConfig, validate

# The repository's experiment files, beside the package in a clone (`pip install -e .`).
CONFIGS_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def _load(spec: str) -> tuple[ModuleType, str, str]:
    """The experiment file's module, its ARG and the path as given."""
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
    return module, arg, path


def _checked(cfg: object, where: str) -> ExperimentConfig:
    if not isinstance(cfg, ExperimentConfig):
        raise ConfigError(f"{where} returned {type(cfg).__name__}, expected an ExperimentConfig")
    return validate(cfg)


def load_config(spec: str) -> ExperimentConfig:
    """`path/to/file.py[:ARG]` -> the file's `get_config(ARG)` (or `get_config()` without ARG),
    which must be a valid ExperimentConfig (`validate`). A bare `NAME[:ARG]` (no directory, no
    `.py`) names one of the repository's `configs/NAME.py`, wherever the caller runs."""
    module, arg, path = _load(spec)
    return _checked(module.get_config(arg) if arg else module.get_config(), f"{path}:get_config")


def split_configurer(spec: str) -> Callable[[int, int], ExperimentConfig] | None:
    """`(P, D) -> config` of the same experiment on another P/D split, when the file defines
    `config_for_split(arg, prefill_nodes, decode_nodes)` (hardware that depends on the split,
    e.g. `configs/paper.py`'s HBM for KV); None when it does not (then replacing the node counts
    is the whole change). The deployment advisor's `configure`."""
    module, arg, path = _load(spec)
    hook = getattr(module, "config_for_split", None)
    if hook is None:
        return None
    return lambda p, d: _checked(hook(arg, p, d), f"{path}:config_for_split")
