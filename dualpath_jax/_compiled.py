"""Loads the compiled core (`dualpath_jax.native`) in place of its modules' sources.

Nothing happens on import: a program opts in by calling `install()` (or `use(mode)`) before it
imports any module of `MODULES`; then, when a fresh build exists, a finder put in front of the
import system loads every module of the set from it (all of them or none). The simulator
launcher and the simulator benchmarks opt in (`--native=auto|on|off`); the library itself never
does, and reads no environment. See `dualpath_jax.native` and docs/simulator.md for the rules.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import pathlib
import sys
import sysconfig
import warnings
from typing import Any

try:  # mypyc's class options; without mypy installed (nothing is compiled) they do nothing
    from mypy_extensions import mypyc_attr
except ImportError:  # pragma: no cover - depends on the environment

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Any:  # type: ignore[no-redef]
        return lambda cls: cls


# Compiled together (mypyc's calls between them are direct): a module of this set may only import
# others of it or pure modules outside it, never be loaded alone.
MODULES = (
    "dualpath_jax.sched.types",
    "dualpath_jax.sched.cost",
    "dualpath_jax.sched.inter",
    "dualpath_jax.sched.intra",
    "dualpath_jax.sched.policy",
    "dualpath_jax.sched.scheduler",
    "dualpath_jax.transfer.links",
    "dualpath_jax.transfer.paths",
    "dualpath_jax.sim.core",
    "dualpath_jax.sim.state",
    "dualpath_jax.sim.leaders",
    "dualpath_jax.sim.decode",
    "dualpath_jax.sim.network",
    "dualpath_jax.sim.router",
    "dualpath_jax.sim.cluster",
    "dualpath_jax.sim.agents",
)

_PACKAGE = pathlib.Path(__file__).resolve().parent
_MANIFEST = "manifest.json"
MODES = ("auto", "on", "off")


def native_dir() -> pathlib.Path:
    """Where the compiled modules are built and looked for by default (`dualpath_jax/_native/`)."""
    return _PACKAGE / "_native"


def _relpath(module: str) -> pathlib.Path:
    """A module's source file relative to the directory that holds the package."""
    return pathlib.Path(*module.split(".")).with_suffix(".py")


def _source(module: str) -> pathlib.Path:
    return _PACKAGE.parent / _relpath(module)


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _abi() -> str:
    return f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}"


# --------------------------------------------------------------------------- loading


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and their shared library) by full name; nothing else."""

    def __init__(self, files: dict[str, pathlib.Path]):
        self.files = files

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        f = self.files.get(name)
        if f is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, str(f))
        return importlib.util.spec_from_file_location(name, f, loader=loader)


def _check(manifest: dict[str, Any], where: pathlib.Path) -> tuple[dict[str, pathlib.Path], str]:
    """The module -> extension file table of a fresh build, or ({}, why it cannot be used)."""
    if manifest.get("abi") != _abi():
        return {}, f"built for {manifest.get('abi')!r}, this interpreter is {_abi()!r}"
    mods = manifest.get("modules", {})
    if sorted(mods) != sorted(MODULES):
        return {}, "built for another set of modules"
    files = {}
    for name, entry in mods.items():
        src = _source(name)
        if not src.exists() or _sha256(src) != entry["sha256"]:
            return {}, f"{src.name} ({name}) changed since the build"
        files[name] = where / entry["file"]
    files[manifest["shared"]["name"]] = where / manifest["shared"]["file"]
    missing = [str(f) for f in files.values() if not f.exists()]
    if missing:
        return {}, f"missing {missing[0]}"
    return files, ""


_state: dict[str, Any] = {"installed": False, "why": "not asked for (native.install)", "dir": None}


def install(directory: str | pathlib.Path | None = None, *, required: bool = False) -> bool:
    """Puts the compiled modules in front of the sources if a fresh build exists in `directory`
    (default `native_dir()`). Call it before any module of `MODULES` is imported. Returns whether
    they will be used; a stale build warns and the pure modules run, unless `required`, where
    anything but success raises RuntimeError."""
    if _state["installed"]:
        return True
    where = pathlib.Path(directory) if directory is not None else native_dir()
    _state["dir"] = str(where)
    files, why = _find(where)
    if not files:
        _state["why"] = why
        if required:
            raise RuntimeError(f"the compiled core cannot be used: {why}")
        if (where / _MANIFEST).exists():  # a build exists but cannot be used: say so
            warnings.warn(
                f"the compiled core in {where} is stale or unusable: {why}; running the pure Python "
                "modules (rebuild: make native, or python -m dualpath_jax.native build)",
                stacklevel=2,
            )
        return False
    sys.meta_path.insert(0, _Finder(files))
    _state.update(installed=True, why="")
    return True


def _find(where: pathlib.Path) -> tuple[dict[str, pathlib.Path], str]:
    path = where / _MANIFEST
    if not path.exists():
        return {}, f"no build in {where}"
    already = [m for m in MODULES if m in sys.modules]
    if already:  # a compiled module must not meet a pure one of the set
        return {}, f"{already[0]} was imported before dualpath_jax.native.install()"
    try:
        return _check(json.loads(path.read_text()), where)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return {}, f"unreadable manifest ({e})"


def use(mode: str = "auto", directory: str | pathlib.Path | None = None) -> bool:
    """A launcher's `--native` flag: "auto" uses a fresh build if there is one, "on" requires it
    (RuntimeError otherwise), "off" runs the pure modules. Returns whether compiled modules run."""
    if mode not in MODES:
        raise ValueError(f"native mode must be one of {MODES}, got {mode!r}")
    if mode == "off":
        if not _state["installed"]:
            _state.update(why="turned off (--native=off)", dir=str(directory or native_dir()))
        return bool(_state["installed"])
    return install(directory, required=mode == "on")


def active() -> bool:
    """True when the compiled modules are (or, once imported, will be) the ones in use."""
    return bool(_state["installed"])


def status() -> dict[str, Any]:
    """Whether the compiled core is in use, where it is looked for, and why not if not."""
    pure = {
        m: str(getattr(sys.modules[m], "__file__", "")).endswith(".py")
        for m in MODULES
        if m in sys.modules
    }
    return {
        "active": active(),
        "dir": _state["dir"] or str(native_dir()),
        "why_not": _state["why"],
        "compiled_loaded": [m for m, p in pure.items() if not p],
        "pure_loaded": [m for m, p in pure.items() if p],
    }
