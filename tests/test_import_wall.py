"""The package's import wall: importing `dualpath_jax` (or any public namespace) changes no module
and reads no environment; the compiled core runs only where a program asks for it; the serving
path without a fault plan never imports the test fault injection (`dualpath_jax.testing`)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dualpath_jax"

_PROBE = """
import json, sys
import dualpath_jax
from dualpath_jax import cluster, model, rollout, sim
from dualpath_jax._compiled import MODULES, _Finder, active
import dualpath_jax.sim.cluster, dualpath_jax.sched.scheduler
print(json.dumps({
    # the project's compiled modules (other packages, e.g. filelock 4, have `_native` ones too)
    "native_modules": [m for m in sys.modules
                       if m.startswith("dualpath_jax") and "_native" in m],
    "finders": [type(f).__name__ for f in sys.meta_path if isinstance(f, _Finder)],
    "active": active(),
    "compiled_files": [m for m in MODULES if m in sys.modules
                       and not str(sys.modules[m].__file__).endswith(".py")],
    # RayCluster is in the namespace, Ray is not imported until one starts
    "ray_cluster": cluster.RayCluster.__name__,
    "ray_modules": [m for m in sys.modules if m == "ray" or m.startswith("ray.")],
}))
"""


def test_importing_the_package_installs_nothing(tmp_path):
    # Run from a directory without a build and with the variables the old loader read set: they
    # must change nothing.
    env = {
        "PATH": "/usr/bin:/bin",
        "DUALPATH_JAX_NATIVE": "1",
        "DUALPATH_JAX_NATIVE_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "native_modules": [],
        "finders": [],
        "active": False,
        "compiled_files": [],
        "ray_cluster": "RayCluster",
        "ray_modules": [],
    }


# The process boundaries that read the environment (STYLE.md habit 1), each at most this often.
_BOUNDARIES = {
    "native.py": None,  # the compiled core's builder passes the environment to its compiler
    "runtimes/local.py": 1,  # LocalCluster builds its processes' environments from its own
}


def test_the_library_reads_no_environment():
    pattern = re.compile(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(|\benviron\[")
    offenders, boundary = [], {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                if rel in _BOUNDARIES:
                    boundary[rel] = boundary.get(rel, 0) + 1
                else:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []
    too_many = {
        k: n for k, n in boundary.items() if _BOUNDARIES[k] is not None and n > _BOUNDARIES[k]
    }
    assert too_many == {}, f"more environment reads than the boundary needs: {too_many}"


def test_use_checks_its_mode_and_off_installs_nothing():
    from dualpath_jax import native

    with pytest.raises(ValueError, match="native mode"):
        native.use("fast")
    assert native.use("off") is native.active()


def test_on_without_a_build_is_a_clear_error(tmp_path):
    code = "import sys; from dualpath_jax import native; native.use('on', sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "the compiled core cannot be used: no build in" in proc.stderr


# The serving path without a fault plan: import the engine process and the HTTP server, run a
# router (it opens its store through the fault hook) until it listens, then list what is loaded.
_SERVING_PROBE = """
import json, pathlib, sys, threading, time
import dualpath_jax.runtimes.process as process
import dualpath_jax.serving.server
from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engines.fault_hook import NoFaults, fault_injection
from dualpath_jax.presets import TINY_QWEN2

workdir = pathlib.Path(sys.argv[1])
spec = process.ProcessSpec("router", str(workdir), address_file=str(workdir / "address"))
router = threading.Thread(
    target=process.run_router, args=(ExperimentConfig(model=TINY_QWEN2), spec), daemon=True
)
router.start()
deadline = time.monotonic() + 120
while not (workdir / "address").exists() and router.is_alive() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({
    "listening": (workdir / "address").exists(),
    "no_faults": isinstance(fault_injection("", "pe0"), NoFaults),
    "testing_modules": sorted(m for m in sys.modules if m.startswith("dualpath_jax.testing")),
}))
"""


def test_serving_without_a_fault_plan_imports_no_test_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _SERVING_PROBE, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"listening": True, "no_faults": True, "testing_modules": []}
