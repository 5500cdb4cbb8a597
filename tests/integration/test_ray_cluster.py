"""RayCluster on a local Ray cluster of three emulated nodes (`ray.cluster_utils.Cluster`), each
advertising a custom resource that names it (`head`, `pool_a`, `pool_b`), so where Ray placed an
actor is observable: the config puts the router on `head`, the PE on `pool_a`, the DE on
`pool_b`.

One DualPath cluster: placement as configured, tokens equal to the reference model's, an
`update_params` by checkpoint and one streamed over the transfer layer, what the processes wrote
(events, link reports) in the workdir, and no process left after `stop`. One Basic cluster: the
DE's node is removed while the DE holds a request; no trajectory is lost (requeued, the
reference tokens), and the DE comes back on the node that replaces it.

Full tier (multiprocess); skipped without the `ray` extra.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from test_cluster import (  # noqa: E402
    RESULT_TIMEOUT_S,
    busy_engines,
    cluster_config,
    make_trajectories,
    read_events,
)

from dualpath_jax.cluster import RayCluster  # noqa: E402
from dualpath_jax.config import RayConfig  # noqa: E402
from dualpath_jax.model.decode import reference_generate  # noqa: E402
from dualpath_jax.model.runner import ModelRunner  # noqa: E402
from dualpath_jax.model.transformer import init_model  # noqa: E402
from dualpath_jax.presets import TINY_QWEN2  # noqa: E402
from dualpath_jax.rollout import Session, run_trajectories  # noqa: E402

pytestmark = pytest.mark.multiprocess

# Each emulated node: one CPU, a small object store (nothing large goes through it).
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
# A dead node is noticed within about two seconds (Ray's default takes longer).
HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
}
PLACED = RayConfig(
    router_resources="CPU=1,head=1",
    prefill_resources="CPU=1,pool_a=1",
    decode_resources="CPU=1,pool_b=1",
    shared_filesystem=True,  # the emulated nodes share this host's file system
)


@pytest.fixture(scope="module")
def ray_nodes():
    """The Ray cluster (`cluster_utils.Cluster`) and its nodes by the resource each holds."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **NODE,
            "resources": {"head": 1},
            "include_dashboard": False,
            "_system_config": HEALTH,
        },
    )
    try:
        nodes = {
            "head": cluster.head_node,
            "pool_a": cluster.add_node(**NODE, resources={"pool_a": 1}),
            "pool_b": cluster.add_node(**NODE, resources={"pool_b": 1}),
        }
        ray.init(address=cluster.address)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def ray_config(policy: str, **cluster: object):
    return dataclasses.replace(cluster_config(policy, **cluster), ray=PLACED)


def wait_gone(pids: list[int]) -> list[int]:
    """The processes of `pids` still running (not zombies) after up to 30 s."""
    deadline = time.monotonic() + 30

    def running(pid: int) -> bool:
        status = pathlib.Path(f"/proc/{pid}/status")
        try:
            return "\nState:\tZ" not in status.read_text()
        except OSError:
            return False

    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if running(p)]


SWEEP = make_trajectories("ray", n=3, rounds=3, seed=1)


def test_placement_tokens_and_params_updates(ray_nodes, tmp_path, reference_tokens):
    _, nodes = ray_nodes
    cfg = ray_config("dualpath")
    with RayCluster(cfg, tmp_path) as cluster:
        where = cluster.where()
        assert {name: w["node_id"] for name, w in where.items()} == {
            "router": nodes["head"].node_id,
            "pe0": nodes["pool_a"].node_id,
            "de1": nodes["pool_b"].node_id,
        }
        client = cluster.client()
        outs = run_trajectories(client, SWEEP, progress=False, timeout_s=RESULT_TIMEOUT_S)
        assert [o.error for o in outs] == [""] * len(SWEEP)
        assert [o.rounds for o in outs] == [reference_tokens(t) for t in SWEEP]

        # An update by checkpoint (workdir/params, on the shared file system) ...
        b = init_model(TINY_QWEN2, seed=32)
        assert client.update_params(b, version="step-1") == "step-1"
        prompt = list(range(5, 45))
        assert Session(client, "after-b").step(prompt, 5, RESULT_TIMEOUT_S) == reference_generate(
            ModelRunner(b), prompt, 5
        )
        # ... and one streamed over the transfer layer (a cluster without a shared file system).
        streamed = cluster.client(params_dir=None)
        a = init_model(TINY_QWEN2, seed=cfg.seed)
        assert streamed.update_params(a, version="step-2") == "step-2"
        assert streamed.last_params_update["via"] != "checkpoint"
        again = make_trajectories("ray-again", n=1, rounds=2, seed=5)
        outs = run_trajectories(streamed, again, progress=False, timeout_s=RESULT_TIMEOUT_S)
        assert [o.rounds for o in outs] == [reference_tokens(t) for t in again]
        stats = client.stats()
        assert stats["params_version"] == "step-2"
        assert stats["counters"]["errors"] == 0

    assert any(e["kind"] == "done" for e in read_events(tmp_path))
    assert {p.name for p in (tmp_path / "links").glob("*.json")} == {"pe0.json", "de1.json"}
    assert wait_gone([w["pid"] for w in where.values()]) == []


FAULT = make_trajectories("ray-fault", n=4, rounds=3, seed=2, gen=(8, 16))


def test_a_node_that_dies_loses_no_trajectory_and_its_engine_comes_back(
    ray_nodes, tmp_path, reference_tokens
):
    ray_cluster, nodes = ray_nodes
    cfg = ray_config("basic", heartbeat_timeout_s=5.0)
    with RayCluster(cfg, tmp_path) as cluster:
        client = cluster.client()
        box: dict[str, list] = {}
        runner = threading.Thread(
            target=lambda: box.setdefault(
                "out", run_trajectories(client, FAULT, progress=False, timeout_s=RESULT_TIMEOUT_S)
            )
        )
        runner.start()
        try:
            # Once two rounds are answered, freeze the DE while it holds a request (so it
            # cannot finish it behind our back), then take its node away: raylet, workers and
            # the engine process with them.
            de_pid = cluster.where()["de1"]["pid"]
            while True:
                events = read_events(tmp_path)
                if sum(e["kind"] == "done" for e in events) >= 2 and busy_engines(events, "decode"):
                    os.kill(de_pid, signal.SIGSTOP)
                    time.sleep(0.2)
                    if busy_engines(read_events(tmp_path), "decode"):
                        break
                    os.kill(de_pid, signal.SIGCONT)
                assert runner.is_alive(), "the run ended before the DE held a request"
                time.sleep(0.005)
            ray_cluster.remove_node(nodes["pool_b"], allow_graceful=False)
            os.kill(de_pid, signal.SIGKILL)  # it dies with its node
            # A node of the same pool replaces it: Ray places the DE's bundle and actor there.
            replacement = ray_cluster.add_node(**NODE, resources={"pool_b": 1})
        finally:
            runner.join(RESULT_TIMEOUT_S + 10)
        cluster.restart("de1")  # returns once the restarted DE has registered
        assert cluster.where()["de1"]["node_id"] == replacement.node_id
        after = make_trajectories("ray-after", n=1, rounds=2, seed=6)
        outs_after = run_trajectories(client, after, progress=False, timeout_s=RESULT_TIMEOUT_S)
        stats = client.stats()

    outputs = box["out"]
    assert [o.error for o in outputs] == [""] * len(FAULT)
    assert [o.rounds for o in outputs] == [reference_tokens(t) for t in FAULT]
    assert [o.rounds for o in outs_after] == [reference_tokens(t) for t in after]
    assert stats["counters"]["engine_deaths"] == 1
    assert stats["counters"]["requeued"] >= 1, stats["counters"]
    assert stats["engines"]["1"]["alive"] is True
