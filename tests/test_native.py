"""The compiled core (`dualpath_jax.native`): a fresh build gives the same simulations as the pure
modules, passes the scheduler's and the simulator's tests, and a stale build is never used.

Each check runs in a subprocess pointed at a build in a temporary directory (the build itself,
at -O0, takes about half a minute on two cores), so this process and a build in
the source tree are left alone. Skipped where mypy or a C compiler is missing.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# one worker builds the core for all of them (the build is module-scoped)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("native_build")]


def _have_compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("mypyc")
    if not _have_compiler():
        pytest.skip("no C compiler")
    from dualpath_jax import native

    # -O0: the C compiler takes seconds instead of minutes; these tests check results, not speed
    return native.build(tmp_path_factory.mktemp("native") / "build", opt_level="0")


_SIMULATE = """
import json, sys
from dualpath_jax import native
native.use(sys.argv[1], sys.argv[2])
from dualpath_jax.presets import paper_experiment
from dualpath_jax.sim import SimOptions, simulate
import dualpath_jax.sim.cluster as C

out = {"active": native.active(), "cluster_file": C.__file__, "runs": {}}
for policy in ("basic", "dualpath", "dualpath_rr", "split", "oracle"):
    for fast in (True, False):
        cfg, cost = paper_experiment("ds660b", 2, 4, policy=policy, agents=48, max_turns=6)
        run = simulate(cfg, cost=cost, options=SimOptions(kv_format="fp8_flashmla", fast_links=fast))
        s = run.summary
        out["runs"][f"{policy}/{fast}"] = [s["jct_s"], s["ttft_s"], s["tpot_s"],
                                           s["snic_max_over_avg"], s["requests"], run.events]
print(json.dumps(out))
"""


def _simulate(mode: str, where: pathlib.Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SIMULATE, mode, str(where)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compiled_simulations_equal_the_pure_ones(build_dir):
    compiled = _simulate("on", build_dir)
    pure = _simulate("off", build_dir)
    assert compiled["active"] and compiled["cluster_file"].endswith(
        sysconfig.get_config_var("EXT_SUFFIX")
    )
    assert not pure["active"] and pure["cluster_file"].endswith(".py")
    assert compiled["runs"] == pure["runs"]  # every number, to the last bit


def test_scheduler_and_simulator_tests_pass_compiled(build_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            f"--native-dir={build_dir}",
            "tests/sim",
            "tests/sched",
            "tests/transfer/test_links.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_a_stale_build_is_not_used(build_dir, tmp_path):
    stale = tmp_path / "stale"
    shutil.copytree(build_dir, stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    manifest["modules"]["dualpath_jax.sim.network"]["sha256"] = "0" * 64  # "an edited source"
    (stale / "manifest.json").write_text(json.dumps(manifest))
    code = (
        "import json, sys; from dualpath_jax import native; native.install(sys.argv[1]); "
        "import dualpath_jax.sim.network as n; print(json.dumps([native.active(), n.__file__]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(stale)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    active, path = json.loads(proc.stdout)
    assert not active and path.endswith("network.py")
    assert "stale" in proc.stderr and "network.py" in proc.stderr
