"""Fixtures for tests that start LocalClusters (router + engine processes on this host).

Every cluster is started through the `start_cluster` fixture, which records its processes (a
final session check asserts that none of them survived) and its workdir: a failing test reports
the tail of each of its processes' logs (`workdir/logs/*.log`). Tests that start processes
themselves register their workdir with `report_logs`.
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
from collections.abc import Iterator, Sequence

import pytest

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.runtimes.inprocess import InProcessCluster
from dualpath_jax.runtimes.local import LocalCluster

# Every process any LocalCluster of this session started (checked at the end of the session).
_STARTED: list[tuple[str, subprocess.Popen]] = []
# Workdirs whose logs a failing test reports: clusters running now or stopped during the test.
_RUNNING: list[pathlib.Path] = []
_STOPPED_IN_TEST: list[pathlib.Path] = []


def log_tails(workdir: str | pathlib.Path, chars: int = 2500) -> str:
    """The last `chars` characters of every process log of a cluster's workdir."""
    logs = sorted((pathlib.Path(workdir) / "logs").glob("*.log"))
    return "\n".join(f"----- {p} -----\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


class _Cluster(LocalCluster):
    """A LocalCluster that remembers which engines a test killed on purpose."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.killed: set[str] = set()

    def kill(self, name: str) -> None:
        self.killed.add(name)
        super().kill(name)


class _ThreadCluster(InProcessCluster):
    """An InProcessCluster that remembers which engines a test killed on purpose."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.killed: set[str] = set()

    def kill(self, name: str) -> None:
        self.killed.add(name)
        super().kill(name)


@contextlib.contextmanager
def _running_cluster(
    cfg: ExperimentConfig, workdir: str | pathlib.Path, runtime: str = "process"
) -> Iterator[LocalCluster | InProcessCluster]:
    """`runtime`: "process" (a LocalCluster) or "thread" (an InProcessCluster)."""
    if runtime == "thread":
        yield from _running_threads(cfg, workdir)
        return
    if runtime != "process":
        raise ValueError(f"runtime {runtime!r}: process or thread")
    cluster = _Cluster(cfg, workdir)
    _RUNNING.append(cluster.workdir)
    try:
        with cluster:
            yield cluster
    finally:
        _STARTED.extend(cluster.procs.items())
        _RUNNING.remove(cluster.workdir)
        _STOPPED_IN_TEST.append(cluster.workdir)
    alive = {name: p.pid for name, p in cluster.procs.items() if p.poll() is None}
    assert not alive, f"processes still running after the cluster stopped: {alive}"
    # a clean stop: every process not killed on purpose exits with status 0
    codes = {name: p.returncode for name, p in cluster.procs.items() if name not in cluster.killed}
    assert set(codes.values()) <= {0}, f"exit statuses after the cluster stopped: {codes}"


def _running_threads(cfg: ExperimentConfig, workdir: str | pathlib.Path):
    cluster = _ThreadCluster(cfg, workdir)
    _RUNNING.append(cluster.workdir)
    try:
        with cluster:
            yield cluster
    finally:
        _RUNNING.remove(cluster.workdir)
        _STOPPED_IN_TEST.append(cluster.workdir)
    # a clean stop: every thread ended, none with an error
    alive = [name for name, up in cluster.alive().items() if up]
    assert not alive, f"threads still running after the cluster stopped: {alive}"
    assert not cluster.errors, f"threads that failed: {cluster.errors!r}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _STOPPED_IN_TEST.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test reports the log tail of every process of its clusters."""
    outcome = yield
    report = outcome.get_result()
    workdirs = dict.fromkeys([*_STOPPED_IN_TEST, *_RUNNING])
    if report.failed and workdirs:
        report.sections.append(("cluster process logs", "\n".join(log_tails(w) for w in workdirs)))


@pytest.fixture(scope="session")
def start_cluster():
    """`with start_cluster(cfg, workdir[, runtime]) as cluster:` starts a LocalCluster
    (`runtime="process"`, the default) or an InProcessCluster (`"thread"`); on exit it checks
    that every process it started has ended, with status 0 unless the test killed it (every
    thread ended without an error)."""
    return _running_cluster


@pytest.fixture
def report_logs():
    """`report_logs(workdir)`: a failing test also reports the tails of `workdir/logs/*.log`
    (for tests that start their processes themselves)."""
    return lambda workdir: _STOPPED_IN_TEST.append(pathlib.Path(workdir))


@pytest.fixture(scope="session", autouse=True)
def no_process_survives():
    """After the session: every process a cluster started has exited (survivors are killed, by
    PID, and reported)."""
    yield
    survivors = {}
    for name, p in _STARTED:
        if p.poll() is None:
            survivors[name] = p.pid
            p.kill()
            p.wait(10)
    assert not survivors, f"cluster processes survived the test session: {survivors}"


@pytest.fixture(scope="session")
def reference_tokens():
    """`reference_tokens(trajectory)`: the greedy tokens of each round from the monolithic
    reference model (no KV cache) on the full context, with the engines' parameters (seed 0)."""
    from dualpath_jax.model.generation import reference_rounds
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model

    runner = ModelRunner(init_model(TINY_QWEN2, seed=ExperimentConfig().seed))
    cache: dict[tuple, list[list[int]]] = {}

    def rounds(traj: tuple[str, Sequence[tuple[Sequence[int], int]]]) -> list[list[int]]:
        key = tuple((tuple(a), g) for a, g in traj[1])
        if key not in cache:
            cache[key] = reference_rounds(runner, traj[1])
        return cache[key]

    return rounds
