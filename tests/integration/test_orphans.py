"""A LocalCluster whose owning process is killed (SIGKILL: no cleanup runs) leaves no processes:
the router and every engine watch their parent and stop once it is gone."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.multiprocess

_OWNER = textwrap.dedent(
    """
    import json, pathlib, sys, time
    from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
    from dualpath_jax.runtimes.local import LocalCluster
    from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2

    cfg = ExperimentConfig(model=TINY_QWEN2, cluster=ClusterConfig(decode_max_len=256, prefill_cost_json=TINY_CPU_PREFILL_COST.to_json()),
                           store=StoreConfig(block_tokens=16))
    workdir = pathlib.Path(sys.argv[1])
    cluster = LocalCluster(cfg, workdir / "cluster")
    cluster.start()
    (workdir / "pids.json").write_text(json.dumps({n: p.pid for n, p in cluster.procs.items()}))
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; its new parent reaps it


def test_cluster_processes_stop_when_their_owner_is_killed(tmp_path):
    if not pathlib.Path("/proc").is_dir():
        pytest.skip("needs /proc")
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path)], env=os.environ.copy())
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "pids.json").exists():
            assert owner.poll() is None, "the owning process died before the cluster started"
            assert time.monotonic() < deadline, "the cluster did not start"
            time.sleep(0.2)
        pids = json.loads((tmp_path / "pids.json").read_text())
        assert set(pids) == {"router", "pe0", "de1"}
        assert all(_alive(p) for p in pids.values())
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
        deadline = time.monotonic() + 60  # a liveness bound, not a speed claim
        while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = {n: p for n, p in pids.items() if _alive(p)}
        assert not survivors, f"processes outlived their owner: {survivors}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(30)
        for pid in pids.values():  # only the PIDs this test's cluster started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
