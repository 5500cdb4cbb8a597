"""The compiled core: the simulator's hot modules and the pure cores they call, as C extensions.

The modules in `MODULES` (the scheduler's pure cores, the link arbiter, the data paths and the
simulator's event loop, links, engines and router) are ordinary typed Python. `build()` compiles
them with mypyc (one C extension per module plus one shared library) into a directory with a
manifest of the sources' SHA-256. Using a build is an explicit choice of the program, never a side
effect of importing the package:

- `install(directory=None)` (or `use("auto" | "on" | "off")`, what the `--native` flag of
  `launch/simulate.py` and the simulator benchmarks calls) puts a finder in front of the import
  system that loads every module of `MODULES` from the build, all of them or none;
- only when called before any module of the set is imported, and only when the manifest matches
  this interpreter and every source byte for byte (an edited source makes the whole set stale: a
  warning says so and the pure modules run; `use("on")` raises instead);
- from `directory`, default `dualpath_jax/_native/` beside this file (`native_dir()`).

Results are the same either way (`tests/test_native.py` runs the simulator's and the
scheduler's tests against a fresh build and compares simulations with the pure modules); only the
speed differs (`bench/sim_speed.py` reports which ran). Building needs `mypy` (the `native`
extra) and a C compiler:

    make native                                  # or: python -m dualpath_jax.native build [DIR]
    python -m dualpath_jax.native status [DIR]   # what is built, whether it can be used
    python -m dualpath_jax.native clean [DIR]

The compiled modules are checked more strictly than Python: an argument of the wrong type (a
`float` where an `int` is declared, a numpy integer for an `int`) raises `TypeError` at the call.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from typing import Any

from dualpath_jax._compiled import (
    _MANIFEST,
    _PACKAGE,
    MODES,
    MODULES,
    _abi,
    _find,
    _relpath,
    _sha256,
    active,
    install,
    native_dir,
    status,
    use,
)

__all__ = [
    "MODES",
    "MODULES",
    "active",
    "build",
    "check",
    "clean",
    "install",
    "native_dir",
    "status",
    "use",
]


# --------------------------------------------------------------------------- building

_SETUP = """
import os
import sys
from mypyc.build import mypycify
from setuptools import setup

opt_level, paths = sys.argv[1], sys.argv[2:]
jobs = str(os.cpu_count() or 1)
sys.argv = [sys.argv[0], "build_ext", "--build-lib", "out", "--build-temp", "tmp", "-j", jobs]
setup(
    name="dualpath_jax_native",
    ext_modules=mypycify(paths + ["--config-file=mypy_native.ini"],
                         opt_level=opt_level, debug_level="0", multi_file=True,
                         target_dir="c"),
)
"""

# What mypy reads while mypyc compiles: the package's own modules (types of the calls between
# them), never a third-party package's sources. Following those (jax, IPython, matplotlib through
# the simulator package's imports) took mypyc about ten times as long and changes nothing
# compiled: a value of a foreign type is a Python object to mypyc either way.
_MYPY_INI = """
[mypy]
follow_imports = skip
ignore_missing_imports = True

[mypy-dualpath_jax.*]
follow_imports = silent
"""


def build(
    out: pathlib.Path | None = None, *, quiet: bool = True, opt_level: str = "3"
) -> pathlib.Path:
    """Compiles `MODULES` into `out` (default `native_dir()`), replacing what is there. The
    sources are copied first, so the manifest's hashes are those of what was compiled. Raises
    RuntimeError (with mypyc's and the compiler's output) if the build fails. `opt_level` is the
    C compiler's ("0" builds several times faster and runs slower: what the tests use, since
    they check results, not speed)."""
    try:
        import mypyc  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "building the compiled core needs mypy: pip install 'dualpath_jax[native]'"
        ) from e
    out = (out or native_dir()).resolve()
    with tempfile.TemporaryDirectory(prefix="dualpath_native_") as tmp:
        work = pathlib.Path(tmp)
        pkg = work / "dualpath_jax"
        shutil.copytree(
            _PACKAGE, pkg, ignore=shutil.ignore_patterns("_native", "__pycache__", "*.so")
        )
        rel = [str(_relpath(m)) for m in MODULES]
        (work / "setup_native.py").write_text(_SETUP)
        (work / "mypy_native.ini").write_text(_MYPY_INI)
        proc = subprocess.run(
            [sys.executable, "setup_native.py", opt_level, *rel],
            cwd=work,
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"mypyc build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        if not quiet:
            print(proc.stdout[-2000:])
        built = work / "out"
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        shared = [p for p in built.glob(f"*__mypyc{suffix}")]
        if len(shared) != 1:
            raise RuntimeError(f"expected one shared library in {built}, found {shared}")
        manifest: dict[str, Any] = {
            "abi": _abi(),
            "shared": {"name": shared[0].name[: -len(suffix)], "file": shared[0].name},
            "modules": {},
        }
        for m, r in zip(MODULES, rel):
            ext = pathlib.Path(r).with_suffix("")
            ext = ext.with_name(ext.name + suffix)
            if not (built / ext).exists():
                raise RuntimeError(f"the build made no {ext}")
            manifest["modules"][m] = {"file": str(ext), "sha256": _sha256(work / r)}
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(built, out)
        (out / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def clean(out: pathlib.Path | None = None) -> None:
    """Removes a build (`install()` then finds none and the pure modules run)."""
    out = out or native_dir()
    if out.exists():
        shutil.rmtree(out)


def check(directory: pathlib.Path | None = None) -> str:
    """Why the build in `directory` (default `native_dir()`) cannot be used in this process, or ""
    when `install()` would use it."""
    return _find(directory or native_dir())[1]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = args[0] if args else "status"
    where = pathlib.Path(args[1]) if len(args) > 1 else None
    if cmd == "build":
        where = build(where, quiet=False)
        print(f"built {len(MODULES)} modules into {where}")
        return 0
    if cmd == "clean":
        clean(where)
        return 0
    if cmd == "status":
        why = check(where)
        print(
            json.dumps(
                {"dir": str(where or native_dir()), "usable": not why, "why_not": why}, indent=1
            )
        )
        return 0
    print("usage: python -m dualpath_jax.native [build|status|clean] [DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
