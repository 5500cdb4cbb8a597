"""RayCluster on a local Ray cluster of three emulated nodes (`ray.cluster_utils.Cluster`), each
advertising a custom resource that names it (`head`, `pool_a`, `pool_b`), so where Ray placed an
actor is observable: the config puts the router on `head`, the PE on `pool_a`, the DE on
`pool_b`.

One Ray cluster serves the module (it takes a while to start on a small host). The first
RayCluster goes through its life: placement as configured; the DE's node is removed while the DE
holds a request, and no trajectory is lost (requeued, the reference model's tokens); the DE
comes back on the node that replaces it; an `update_params` by checkpoint and one streamed over
the transfer layer reach every engine, the restarted one included; the router's actor killed is
restarted by Ray at its address and serves on (the engines rejoin it, the client reconnects);
what the processes wrote (events, link reports) is in the workdir, and no process is left after
`stop`. Then `run_local` with `cluster.runtime=ray` gives the thread runtime's tokens, and a
decode engine spanning two processes runs as one gang of actors on a node added for it.

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
    PINNED_COST,
    RESULT_TIMEOUT_S,
    busy_engines,
    cluster_config,
    make_trajectories,
    read_events,
)
from trace_helpers import records  # noqa: E402

from dualpath_jax import apply_overrides, load_config  # noqa: E402
from dualpath_jax.cluster import RayCluster  # noqa: E402
from dualpath_jax.config import RayConfig  # noqa: E402
from dualpath_jax.experiment import read_outputs, run_local  # noqa: E402
from dualpath_jax.model.generation import reference_generate  # noqa: E402
from dualpath_jax.model.runner import ModelRunner  # noqa: E402
from dualpath_jax.model.transformer import init_model  # noqa: E402
from dualpath_jax.presets import TINY_QWEN2  # noqa: E402
from dualpath_jax.rollout import Session, run_trajectories  # noqa: E402

pytestmark = pytest.mark.multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

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


FAULT = make_trajectories("ray-fault", n=4, rounds=3, seed=2, gen=(8, 16))


def freeze_busy_decode(workdir: pathlib.Path, pid: int, runner: threading.Thread) -> None:
    """Once two rounds are answered, freezes the DE (SIGSTOP) while it holds a request, so it
    cannot finish the request behind the test's back."""
    while True:
        events = read_events(workdir)
        if sum(e["kind"] == "done" for e in events) >= 2 and busy_engines(events, "decode"):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)  # what it sent before the freeze reaches the router's log
            if busy_engines(read_events(workdir), "decode"):
                return
            os.kill(pid, signal.SIGCONT)
        assert runner.is_alive(), "the run ended before the DE held a request"
        time.sleep(0.005)


def test_a_ray_cluster_places_survives_a_node_and_updates_params(
    ray_nodes, tmp_path, reference_tokens
):
    ray_cluster, nodes = ray_nodes
    # Engines wait longer for a silent router than the router for a silent engine: they
    # outlive its restart.
    cfg = ray_config("dualpath", heartbeat_timeout_s=5.0, router_timeout_s=60.0)
    with RayCluster(cfg, tmp_path) as cluster:
        where = cluster.where()
        assert {name: w["node_id"] for name, w in where.items()} == {
            "router": nodes["head"].node_id,
            "pe0": nodes["pool_a"].node_id,
            "de1": nodes["pool_b"].node_id,
        }
        client = cluster.client()
        box: dict[str, list] = {}
        runner = threading.Thread(
            target=lambda: box.setdefault(
                "out",
                run_trajectories(
                    client, records(FAULT), progress=False, timeout_s=RESULT_TIMEOUT_S
                ),
            )
        )
        runner.start()
        try:
            de_pid = where["de1"]["pid"]
            freeze_busy_decode(tmp_path, de_pid, runner)
            # The node goes (raylet, workers, and the engine process with them) ...
            ray_cluster.remove_node(nodes["pool_b"], allow_graceful=False)
            os.kill(de_pid, signal.SIGKILL)
            # ... and a node of the same pool replaces it: Ray places the DE's bundle there.
            replacement = ray_cluster.add_node(**NODE, resources={"pool_b": 1})
        finally:
            runner.join(RESULT_TIMEOUT_S + 10)
        outputs = box["out"]
        assert [o.error for o in outputs] == [""] * len(FAULT)
        assert [o.rounds for o in outputs] == [reference_tokens(t) for t in FAULT]
        cluster.restart("de1")  # returns once the restarted DE has registered
        assert cluster.where()["de1"]["node_id"] == replacement.node_id

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
        assert streamed.last_params_update["via"] == "transfer"
        after = make_trajectories("ray-after", n=2, rounds=2, seed=5)
        outs = run_trajectories(
            streamed, records(after), progress=False, timeout_s=RESULT_TIMEOUT_S
        )
        assert [o.rounds for o in outs] == [reference_tokens(t) for t in after]
        stats = client.stats()

        # The router's actor is killed: Ray restarts it, at its address, serving step-2; the
        # engines register with it again and the client reconnects.
        cluster.kill("router")
        cluster.restart("router")
        restarted = client.stats()
        assert restarted["epoch"] != stats["epoch"] and client.router_restarts >= 1
        assert restarted["params_version"] == "step-2"
        later = make_trajectories("ray-restarted", n=2, rounds=2, seed=6)
        outs = run_trajectories(client, records(later), progress=False, timeout_s=RESULT_TIMEOUT_S)
        assert [o.rounds for o in outs] == [reference_tokens(t) for t in later]
        router_pid = cluster.where()["router"]["pid"]

    assert stats["params_version"] == "step-2"
    assert stats["counters"]["engine_deaths"] == 1
    assert stats["counters"]["requeued"] >= 1, stats["counters"]
    assert stats["counters"]["errors"] == 0
    assert stats["engines"]["1"]["alive"] is True
    assert {p.name for p in (tmp_path / "links").glob("*.json")} == {"pe0.json", "de1.json"}
    assert wait_gone([w["pid"] for w in where.values()] + [router_pid]) == []


def test_run_local_on_ray_replays_a_trace_with_the_thread_runtimes_tokens(ray_nodes, tmp_path):
    """`cluster.runtime=ray`: `run_local` (launch/rollout.py, bench/compare_policies.py) runs
    its cluster as a `RayCluster` on the Ray this process is connected to, writes the run's
    files, and replays the trace with the tokens of `cluster.runtime=thread`, under Basic."""
    cfg = apply_overrides(
        load_config(str(ROOT / "configs/cpu_1p1d.py:tiny")),
        [
            f"cluster.prefill_cost_json={PINNED_COST}",
            "scheduler.policy=basic",  # the first test replays under dualpath
            "workload.agents=2",
            "workload.trajectories=2",
            "workload.max_turns=2",
            "workload.max_len=256",
            "ray.shared_filesystem=true",  # the emulated nodes share this host's file system
        ],
    )
    summary = run_local(
        apply_overrides(cfg, ["cluster.runtime=ray"]), tmp_path / "ray", progress=False
    )
    assert ray.is_initialized()  # the driver's Ray: joined, not shut down
    run_local(apply_overrides(cfg, ["cluster.runtime=thread"]), tmp_path / "thread", progress=False)

    assert summary["errors"] == 0
    assert sorted(p.name for p in (tmp_path / "ray" / "links").glob("*.json")) == [
        "de1.json",
        "pe0.json",
    ]
    on_ray = read_outputs(tmp_path / "ray" / "outputs.jsonl")
    assert len(on_ray) == 2
    assert on_ray == read_outputs(tmp_path / "thread" / "outputs.jsonl")


# A node for an engine spanning two processes: two CPUs, and a resource pinning the gang there.
SPAN_NODE = {"num_cpus": 2, "object_store_memory": 80 << 20, "resources": {"pool_c": 2}}
SPANNED = make_trajectories("ray-span", n=2, rounds=2, seed=3)
RESPANNED = make_trajectories("ray-respan", n=2, rounds=2, seed=4)


def test_a_decode_engine_spanning_two_processes_is_placed_and_restarted_as_one(
    ray_nodes, tmp_path, reference_tokens
):
    """`cluster.decode_processes=2`: the DE is two actors (`de1`, the engine the router knows,
    and `de1.1`, its follower) in a placement group of their own, STRICT_PACK on one node, each
    with one CPU device of the `tensor=2` mesh, one `jax.distributed` world. Its tokens are the
    reference model's; when the follower dies the whole engine is restarted (both processes
    anew) and serves the reference tokens again; a params update reaches both processes."""
    ray_cluster, _ = ray_nodes
    pool_c = ray_cluster.add_node(**SPAN_NODE)
    cfg = ray_config(
        "dualpath",
        heartbeat_timeout_s=5.0,
        platform="cpu",
        decode_mesh="tensor=2",
        decode_processes=2,
    )
    cfg = dataclasses.replace(
        cfg, ray=dataclasses.replace(PLACED, decode_resources="CPU=1,pool_c=1")
    )
    env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}  # the tests' compile flags
    try:
        with RayCluster(cfg, tmp_path, env=env) as cluster:
            where = cluster.where()
            assert sorted(where) == ["de1", "de1.1", "pe0", "router"]
            assert where["de1"]["node_id"] == where["de1.1"]["node_id"] == pool_c.node_id
            client = cluster.client()
            engines = client.stats()["engines"]
            first = run_trajectories(
                client, records(SPANNED), progress=False, timeout_s=RESULT_TIMEOUT_S
            )
            cluster.kill("de1.1")  # the follower dies: the engine's every process restarts
            cluster.restart("de1")  # returns once the new leader has registered
            again = cluster.where()
            second = run_trajectories(
                client, records(RESPANNED), progress=False, timeout_s=RESULT_TIMEOUT_S
            )
            b = init_model(TINY_QWEN2, seed=32)
            assert client.update_params(b, version="span-1") == "span-1"
            prompt = list(range(5, 45))
            after_b = Session(client, "span-after-b").step(prompt, 5, RESULT_TIMEOUT_S)
            stats = client.stats()
    finally:
        ray_cluster.remove_node(pool_c)

    assert len(engines) == 2  # the follower is no engine of its own
    de = engines[str(cluster.engine_ids["de1"])]
    assert (de["role"], de["mesh"], len(de["devices"])) == ("decode", "tensor=2", 2), de
    assert [o.error for o in first + second] == [""] * 4
    assert [o.rounds for o in first] == [reference_tokens(t) for t in SPANNED]
    assert [o.rounds for o in second] == [reference_tokens(t) for t in RESPANNED]
    for name in ("de1", "de1.1"):  # both processes anew, in the gang's bundles
        assert again[name]["pid"] != where[name]["pid"]
        assert again[name]["node_id"] == pool_c.node_id
    assert after_b == reference_generate(ModelRunner(b), prompt, 5)
    assert stats["counters"]["engine_deaths"] == 1
    assert stats["counters"]["errors"] == 0
    assert wait_gone([w["pid"] for w in [*where.values(), *again.values()]]) == []
