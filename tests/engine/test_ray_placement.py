"""RayCluster's checks that need no Ray: resource requests (`ray.*_resources`), the actor
options a bundle becomes, and the configs refused on a Ray cluster of several nodes or hosts."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_jax.config import (
    ConfigError,
    ExperimentConfig,
    RayConfig,
    StoreConfig,
    apply_overrides,
    parse_resources,
    validate,
)
from dualpath_jax.runtimes.ray_cluster import (
    RayCluster,
    actor_options,
    check_ray_nodes,
    local_ray_kwargs,
)


def test_resources_parse_and_bad_ones_name_their_key():
    assert parse_resources("CPU=1, GPU=2,pool_a=0.5") == {"CPU": 1.0, "GPU": 2.0, "pool_a": 0.5}
    cfg = apply_overrides(ExperimentConfig(), ["ray.decode_resources=TPU=4,tpu_pool=1"])
    assert validate(cfg).ray.decode_resources == "TPU=4,tpu_pool=1"
    for value, message in [
        ("GPU", "ray.prefill_resources: resources 'GPU': expected"),
        ("GPU=0", "ray.prefill_resources: resources 'GPU=0': GPU must be > 0"),
        ("GPU=1,GPU=2", "ray.prefill_resources: resources 'GPU=1,GPU=2' names GPU twice"),
        ("", "ray.prefill_resources: must name a resource"),
    ]:
        cfg = dataclasses.replace(ExperimentConfig(), ray=RayConfig(prefill_resources=value))
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        assert str(e.value).startswith(message), str(e.value)
    with pytest.raises(ConfigError, match="ray.strategy: must be one of"):
        validate(apply_overrides(ExperimentConfig(), ["ray.strategy=pack"]))


def test_a_bundle_becomes_the_actor_options_that_ask_for_all_of_it():
    assert actor_options({"CPU": 2, "GPU": 1, "TPU": 4, "pool": 1, "memory": 1e9}) == {
        "num_cpus": 2,
        "num_gpus": 1,
        "memory": 1e9,
        "resources": {"TPU": 4, "pool": 1},
    }
    assert actor_options({"pool": 1}) == {"num_cpus": 0, "num_gpus": 0, "resources": {"pool": 1}}


def test_a_local_ray_holds_the_bundles_it_is_started_for():
    bundles = [{"CPU": 1.0}, {"CPU": 1.0, "pool_a": 1.0}, {"CPU": 0.5, "GPU": 1.0, "pool_a": 1.0}]
    assert local_ray_kwargs(bundles) == {
        "num_cpus": 3,
        "resources": {"pool_a": 2.0},
        "object_store_memory": 128 << 20,
    }


def test_the_runtimes_are_named_when_one_is_not_known():
    assert validate(apply_overrides(ExperimentConfig(), ["cluster.runtime=ray"]))
    with pytest.raises(ConfigError, match='cluster.runtime: must be "process", "thread" or "ray"'):
        validate(apply_overrides(ExperimentConfig(), ["cluster.runtime=actors"]))


def node(ip: str, alive: bool = True) -> dict:
    return {"NodeManagerAddress": ip, "Alive": alive}


def test_a_local_store_on_several_nodes_is_refused():
    cfg = ExperimentConfig()
    check_ray_nodes(cfg, [node("10.0.0.1")])  # one node: its own files are everyone's
    check_ray_nodes(cfg, [node("10.0.0.1"), node("10.0.0.2", alive=False)])
    with pytest.raises(ConfigError, match="local file root on a Ray cluster of 2 nodes"):
        check_ray_nodes(cfg, [node("10.0.0.1"), node("10.0.0.1")])
    shared = dataclasses.replace(cfg, ray=RayConfig(shared_filesystem=True))
    check_ray_nodes(shared, [node("10.0.0.1"), node("10.0.0.1")])
    memory = dataclasses.replace(shared, store=StoreConfig(kind="memory"))
    with pytest.raises(ConfigError, match="store.kind='memory' on a Ray cluster of 2 nodes"):
        check_ray_nodes(memory, [node("10.0.0.1"), node("10.0.0.1")])


def test_loopback_addresses_on_several_hosts_are_refused():
    cfg = dataclasses.replace(ExperimentConfig(), ray=RayConfig(shared_filesystem=True))
    hosts = [node("10.0.0.1"), node("10.0.0.2")]
    with pytest.raises(ConfigError, match="cluster.host='127.0.0.1' is loopback .* 2 hosts"):
        check_ray_nodes(cfg, hosts)
    check_ray_nodes(
        dataclasses.replace(cfg, ray=RayConfig(shared_filesystem=True, bind_node_ip=True)), hosts
    )


def test_what_a_spanning_engine_cannot_have_is_refused_before_ray_starts(tmp_path):
    span = ["cluster.decode_mesh=tensor=4", "cluster.decode_processes=2"]
    RayCluster(apply_overrides(ExperimentConfig(), [*span, "cluster.platform=cpu"]), tmp_path)
    tpu = apply_overrides(ExperimentConfig(), [*span, "cluster.platform=tpu"])
    with pytest.raises(ConfigError, match="with cluster.platform cpu or gpu, not 'tpu'"):
        RayCluster(tpu, tmp_path)
    # on GPUs each process's bundle asks for its share of the engine's devices
    gpu = apply_overrides(
        ExperimentConfig(), [*span, "cluster.platform=gpu", "ray.prefill_resources=GPU=1"]
    )
    with pytest.raises(ConfigError, match="decode_resources asks for GPU=0; .* ask for GPU=2"):
        RayCluster(gpu, tmp_path)
    RayCluster(apply_overrides(gpu, ["ray.decode_resources=GPU=2"]), tmp_path)
    with pytest.raises(ConfigError, match="ray.span_strategy: must be one of"):
        validate(apply_overrides(ExperimentConfig(), ["ray.span_strategy=gang"]))


class _SlowRouter:
    """A client whose router answers after `silent` unanswered stats calls."""

    def __init__(self, silent: int, kind: str = "connection"):
        self.silent, self.kind, self.calls = silent, kind, 0

    def stats(self, timeout_s: float = 30.0):  # noqa: ARG002 - Client.stats' signature
        from dualpath_jax.wire.client import RolloutError

        self.calls += 1
        if self.calls <= self.silent:
            raise RolloutError("no answer from the router for 7.2 s", self.kind)
        return {"engines": {"0": {"alive": True}, "1": {"alive": True}}}


def test_waiting_for_engines_asks_a_router_that_does_not_answer_yet_again(monkeypatch):
    """A router starting (or restarting) on a loaded host may miss a stats call: the wait asks
    again until its deadline; another error, or the deadline, is a ClusterError at once."""
    import time

    from dualpath_jax.runtimes import local

    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    client = _SlowRouter(silent=2)
    local.wait_registered(client, 2, lambda: None, time.monotonic() + 60)
    assert client.calls == 3
    with pytest.raises(local.ClusterError, match="the router did not answer"):
        local.engine_stats(_SlowRouter(silent=1, kind="auth"), time.monotonic() + 60)
    with pytest.raises(local.ClusterError, match="the router did not answer"):
        local.engine_stats(_SlowRouter(silent=5), time.monotonic() - 1)
