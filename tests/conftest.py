"""Shared test setup: CPU JAX with a persistent compilation cache, and tiny-model fixtures."""

from __future__ import annotations

import contextlib
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

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--native-dir",
        default=None,
        help="run against the compiled core built in this directory (dualpath_jax.native)",
    )


def pytest_configure(config):
    where = config.getoption("--native-dir")
    if where:  # before any test module imports the scheduler or the simulator
        from dualpath_jax import native

        native.install(where, required=True)


jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2  # noqa: E402

FAMILIES = {"qwen2": TINY_QWEN2, "deepseek": TINY_DEEPSEEK}


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_runner(request):
    """A ModelRunner over a randomly initialised tiny model of each family."""
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model

    return ModelRunner(init_model(FAMILIES[request.param], seed=0))


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
