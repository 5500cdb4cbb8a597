"""Shared test setup: CPU JAX with a persistent compilation cache, and tiny-model fixtures."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache")
)
# Every compile is cached, in the cluster processes tests start too (they inherit the
# environment; JAX's default caches only compiles over a second): each PE of every cluster
# calibrates on the same few shapes when it starts.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# The tests run tiny models, where compiling costs far more than running. XLA's backend (LLVM)
# optimizations and the CPU backend's fusion emitters (MLIR) cost most of that compile time and
# buy nothing measurable at these sizes: without them a tiny DeepSeek's greedy run compiles in
# 7 s instead of 16 s, and the suite runs about a third faster from an empty cache. Engine
# processes and subprocesses inherit the flags; a flag already in XLA_FLAGS is left as it is.
_TEST_XLA_FLAGS = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_use_fusion_emitters": "false",
}
for _flag, _value in _TEST_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_flag}={_value}").strip()

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"

import jax  # noqa: E402
import pytest  # noqa: E402
from tiers import family_params  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--native-dir",
        default=None,
        help="run against the compiled core built in this directory (dualpath_jax.native)",
    )


@functools.cache
def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def pytest_runtest_setup(item):
    if item.get_closest_marker("ipv6") and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Tests that start engine processes form one xdist group: under `--dist loadgroup` one
    worker runs them all, one after the other (one cluster of processes alive at a time), while
    the other workers run the rest."""
    for item in items:
        if item.get_closest_marker("multiprocess") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("engine_processes"))


def pytest_configure(config):
    where = config.getoption("--native-dir")
    if where:  # before any test module imports the scheduler or the simulator
        from dualpath_jax import native

        native.install(where, required=True)


jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

from dualpath_jax.presets import (  # noqa: E402
    TINY_DEEPSEEK,
    TINY_DEEPSEEK_V2,
    TINY_QWEN2,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
)

FAMILIES = {"qwen2": TINY_QWEN2, "deepseek": TINY_DEEPSEEK}
# Every family's tiny model. The equivalence tests (layerwise == monolithic, decode == reference)
# run over all of them (`family_runner`); the rest over the GQA and the MLA/MoE one above.
ALL_FAMILIES = {
    **FAMILIES,
    "qwen3": TINY_QWEN3,
    "qwen3_moe": TINY_QWEN3_MOE,
    "deepseek_v2": TINY_DEEPSEEK_V2,
}


@functools.cache
def _tiny_runner(family: str):
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model

    return ModelRunner(init_model(ALL_FAMILIES[family], seed=0))


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_runner(request):
    """A ModelRunner over a randomly initialised tiny model of Qwen2 and of DeepSeek-V3."""
    return _tiny_runner(request.param)


@pytest.fixture(scope="session", params=["qwen2", pytest.param("deepseek", marks=pytest.mark.slow)])
def tiny_runner_gqa_first(request):
    """`tiny_runner` whose DeepSeek case runs in the full tier only: for costly tests whose MLA
    path the fast tier covers elsewhere."""
    return _tiny_runner(request.param)


# The fast tier runs the equivalence tests on the GQA and the MLA/MoE family; the full tier on
# every family (the other three are marked slow).
FAMILY_PARAMS = family_params(sorted(ALL_FAMILIES), fast=FAMILIES)


@pytest.fixture(scope="session", params=FAMILY_PARAMS)
def family_runner(request):
    """A ModelRunner over a randomly initialised tiny model of each family."""
    return _tiny_runner(request.param)


@contextlib.contextmanager
def _import_bench(*names: str):
    import importlib
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        yield tuple(importlib.import_module(n) for n in names)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="session")
def bench_modules():
    """`with bench_modules("name", ...) as modules:` imports scripts of `bench/` as modules
    (bench/ on sys.path only meanwhile). A fixture, not an import: the test directories have
    conftest files of their own, so `from conftest import ...` finds whichever came first."""
    return _import_bench


def _run_on_cpu_devices(cases: pathlib.Path, devices: int) -> None:
    """Runs the test file `cases` in a pytest process of its own with `devices` CPU devices (the
    XLA flag must be set before JAX starts; the rest of the suite runs on one device) and
    asserts that every case ran and passed, with the subprocess's output on failure."""
    import subprocess
    import sys

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        env=env,
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


@pytest.fixture(scope="session")
def run_on_cpu_devices():
    """`run_on_cpu_devices(cases_path, devices)`: a test file of cases that need several
    devices (`mesh_cases.py` files, not collected by a plain run) in a process that has them.
    A fixture, not an import, for the reason `bench_modules` gives."""
    return _run_on_cpu_devices
