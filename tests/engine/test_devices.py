"""`runtimes.devices`: the environment that gives each engine process its own devices."""

from __future__ import annotations

import doctest

import pytest

from dualpath_jax.config import ClusterConfig, ConfigError, ExperimentConfig
from dualpath_jax.runtimes import devices
from dualpath_jax.runtimes.local import LocalCluster

HOST8 = [str(i) for i in range(8)]


def cluster(**kw) -> ClusterConfig:
    return ClusterConfig(**kw)


def test_cpu_engines_get_their_mesh_size_of_host_devices_and_keep_other_xla_flags():
    c = cluster(platform="cpu", prefill_mesh="data=1,tensor=4", decode_mesh="tensor=2")
    parent = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"}
    pe, de = (devices.engine_env(c, k, (), parent) for k in (0, 1))
    assert pe == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    assert de["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
    # one-device engines get one host device each; no XLA_FLAGS before is fine
    one = devices.engine_env(cluster(platform="cpu"), 1, (), {})
    assert one == {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}


def test_gpu_engines_get_disjoint_runs_of_the_host_gpus_prefill_first():
    c = cluster(
        platform="gpu", prefill_nodes=2, decode_nodes=1, prefill_mesh="tensor=2",
        decode_mesh="data=2,tensor=2",
    )  # fmt: skip
    assert devices.assign_devices(c, HOST8) == [("0", "1"), ("2", "3"), ("4", "5", "6", "7")]
    envs = [devices.engine_env(c, k, HOST8, {}) for k in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3", "4,5,6,7"]
    assert all(set(e) == {"CUDA_VISIBLE_DEVICES"} for e in envs)
    # the ids are the host's, as the launching environment names them
    host = devices.host_devices("gpu", {"CUDA_VISIBLE_DEVICES": "4, 5,6,7,2,3"})
    assert host == ("4", "5", "6", "7", "2", "3")
    one_one = cluster(platform="gpu", prefill_mesh="tensor=2", decode_mesh="tensor=4")
    assert devices.engine_env(one_one, 1, host, {})["CUDA_VISIBLE_DEVICES"] == "6,7,2,3"


def test_too_few_devices_is_an_error_naming_the_settings():
    c = cluster(platform="gpu", prefill_mesh="tensor=4", decode_mesh="tensor=4")
    with pytest.raises(ConfigError) as e:
        devices.assign_devices(c, HOST8[:6])
    assert str(e.value) == (
        "1 prefill engine(s) of 4 device(s) (cluster.prefill_mesh) and 1 decode engine(s) of 4"
        " (cluster.decode_mesh) need 8 gpu devices; the host has 6: 0,1,2,3,4,5"
    )
    with pytest.raises(ConfigError, match="name the devices the cluster may use in"):
        devices.host_devices("gpu", {})
    with pytest.raises(ConfigError, match="TPU_VISIBLE_CHIPS"):
        devices.host_devices("tpu", {"CUDA_VISIBLE_DEVICES": "0"})
    assert devices.host_devices("cpu", {}) == devices.host_devices("", {}) == ()


def test_tpu_engines_get_chips_bounds_and_a_port_each():
    c = cluster(platform="tpu", prefill_mesh="tensor=2", decode_mesh="tensor=2")
    pe, de = (devices.engine_env(c, k, ["0", "1", "2", "3"], {}) for k in (0, 1))
    assert pe == {
        "TPU_VISIBLE_CHIPS": "0,1",
        "TPU_VISIBLE_DEVICES": "0,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,2,1",
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{devices.TPU_PORT_BASE}",
        "TPU_MESH_CONTROLLER_PORT": str(devices.TPU_PORT_BASE),
    }
    assert de["TPU_VISIBLE_CHIPS"] == "2,3"
    assert de["TPU_MESH_CONTROLLER_PORT"] == str(devices.TPU_PORT_BASE + 1)
    odd = cluster(platform="tpu", prefill_mesh="tensor=3")
    with pytest.raises(ConfigError, match=r"holds \[1, 2, 4, 8\] chips, not 3"):
        devices.engine_env(odd, 0, HOST8, {})


def test_shared_devices_allow_only_one_device_engines():
    assert devices.engine_env(cluster(), 0, (), {"XLA_FLAGS": "--x"}) == {}
    with pytest.raises(ConfigError, match=r"cluster.decode_mesh='tensor=2' spans 2 devices: set"):
        devices.assign_devices(cluster(decode_mesh="tensor=2"), ())


def test_memory_fraction_on_every_platform():
    for platform in devices.PLATFORMS:
        c = cluster(platform=platform, device_memory_fraction=0.45)
        env = devices.engine_env(c, 0, HOST8, {})
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in devices.engine_env(cluster(), 0, (), {})


def test_one_engine_launched_by_hand():
    """`launch/engine.py`: its own devices (or, without them, what the host shows)."""
    c = cluster(platform="gpu", decode_mesh="tensor=2")
    assert devices.device_env(c, "decode", ["3", "5"], {}) == {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert devices.device_env(c, "decode", None, {}) == {}
    with pytest.raises(ConfigError, match=r"cluster.decode_mesh='tensor=2' spans 2 device\(s\)"):
        devices.device_env(c, "decode", ["3"], {})
    with pytest.raises(ValueError, match="unknown engine role"):
        devices.device_env(c, "router", None, {})


def test_local_cluster_checks_devices_before_starting_anything(tmp_path):
    cfg = ExperimentConfig(
        cluster=cluster(platform="gpu", prefill_mesh="tensor=2", decode_mesh="tensor=2")
    )
    with pytest.raises(ConfigError, match="need 4 gpu devices; the host has 2: 0,1"):
        LocalCluster(cfg, tmp_path / "run", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert not (tmp_path / "run").exists()
    lc = LocalCluster(
        cfg, tmp_path / "run", env={"PATH": "/bin"}, host_devices=["0", "1", "2", "3"]
    )
    assert [e[0]["CUDA_VISIBLE_DEVICES"] for e in lc.engine_envs] == ["0,1", "2,3"]
    assert all(e[0]["PATH"] == "/bin" for e in lc.engine_envs)
    # the router keeps off the engines' devices
    assert lc.router_env == {"PATH": "/bin", "JAX_PLATFORMS": "cpu"}
    assert devices.router_env(cluster()) == {}


def test_module_examples():
    assert doctest.testmod(devices).failed == 0


def test_a_one_device_engine_reports_its_device():
    from dualpath_jax.engines.common import runner_devices
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import TINY_QWEN2

    assert runner_devices(ModelRunner(init_model(TINY_QWEN2))) == (["cpu:0"], "")
