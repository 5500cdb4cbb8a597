"""`config.validate`: every rule names its key; every shipped config and preset passes."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import subprocess
import sys
import typing

import pytest

from dualpath_jax import config
from dualpath_jax.config import validation
from dualpath_jax.configs_loader import load_config
from dualpath_jax.presets import HOPPER_NODE, PAPER_MODELS, PRESETS, TINY_DEEPSEEK, paper_experiment

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((ROOT / "configs").glob("*.py"))
SECTIONS = {
    f.name: typing.get_type_hints(config.ExperimentConfig)[f.name]
    for f in dataclasses.fields(config.ExperimentConfig)
    if dataclasses.is_dataclass(typing.get_type_hints(config.ExperimentConfig)[f.name])
}


def with_value(
    key: str, value: object, cfg: config.ExperimentConfig | None = None
) -> config.ExperimentConfig:
    """`cfg` (default ExperimentConfig()) with the dotted `key` set, no type coercion."""
    cfg = cfg or config.ExperimentConfig()
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(
        cfg, **{head: dataclasses.replace(getattr(cfg, head), **{rest: value})}
    )


def numeric_keys(tp: type) -> list[str]:
    keys = [k for k in ("seed",) if tp is typing.get_type_hints(config.ExperimentConfig)[k]]
    for section, cls in SECTIONS.items():
        keys += [f"{section}.{n}" for n, t in typing.get_type_hints(cls).items() if t is tp]
    return keys


def rejects(cfg: config.ExperimentConfig, message: str) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.validate(cfg)
    assert str(e.value).startswith(message), str(e.value)


# --------------------------------------------------------------------------- what passes


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    spec = importlib.util.spec_from_file_location(f"_validate_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    assert config.validate(cfg) is cfg
    assert load_config(str(path)) == cfg


def test_defaults_presets_and_paper_runs_validate():
    assert config.validate(config.ExperimentConfig()) == config.ExperimentConfig()
    for model in PRESETS.values():
        config.validate(config.ExperimentConfig(model=model, hardware=HOPPER_NODE))
    for key in PAPER_MODELS:
        config.validate(paper_experiment(key)[0])
        config.validate(paper_experiment(key, mode="online", aps=1.0)[0])


def test_table_names_real_fields():
    for key in [*validation._BOUND_OF, *validation._CHOICES]:
        obj = config.ExperimentConfig()
        for part in key.split("."):
            assert hasattr(obj, part), key
            obj = getattr(obj, part)
        expected = str if key in validation._CHOICES else (int, float)
        assert isinstance(obj, expected) and not isinstance(obj, bool), key


# --------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("cluster.decode_slots", -4, "cluster.decode_slots: must be >= 1, got -4"),
        ("cluster.decode_nodes", 0, "cluster.decode_nodes: must be >= 1, got 0"),
        ("model.num_kv_heads", 0, "model.num_kv_heads: must be >= 1, got 0"),
        ("store.block_tokens", 0, "store.block_tokens: must be >= 1, got 0"),
        ("workload.agents", 0, "workload.agents: must be >= 1 unless an online run ends after"),
        ("cluster.heartbeat_s", 0.0, "cluster.heartbeat_s: must be > 0, got 0.0"),
        ("cluster.fetch_interval_s", 0, "cluster.fetch_interval_s: must be > 0, got 0"),
        ("store.timeout_s", -1.0, "store.timeout_s: must be > 0, got -1.0"),
        ("hardware.snic_bytes_per_s", -1.0, "hardware.snic_bytes_per_s: must be >= 0, got -1.0"),
        ("cluster.decode_queue", -1, "cluster.decode_queue: must be >= 0, got -1"),
        ("store.capacity_bytes", -2, "store.capacity_bytes: must be >= -1 (-1: unlimited), got -2"),
        ("store.capacity_fraction", 0.0, "store.capacity_fraction: must lie in (0, 1], got 0.0"),
        ("store.capacity_fraction", 1.5, "store.capacity_fraction: must lie in (0, 1], got 1.5"),
        ("cluster.router_port", 65536, "cluster.router_port: must lie in [0, 65535], got 65536"),
        ("cluster.router_port", -1, "cluster.router_port: must lie in [0, 65535], got -1"),
        ("seed", -1, "seed: must lie in [0, 2**63), got -1"),
        ("workload.seed", 2**63, "workload.seed: must lie in [0, 2**63)"),
        ("hardware.hbm_bytes", math.nan, "hardware.hbm_bytes: must be finite, got nan"),
        ("scheduler.z_factor", math.inf, "scheduler.z_factor: must be finite, got inf"),
        ("workload.aps", -math.inf, "workload.aps: must be finite, got -inf"),
        ("store.kind", "s3", "store.kind: must be one of ['file', 'memory', 'spec'], got 's3'"),
        ("workload.mode", "batch", "workload.mode: must be one of ['offline', 'online']"),
        (
            "cluster.host_buffer_memory",
            "hbm",
            "cluster.host_buffer_memory: must be one of ['pinned_host', 'pageable']",
        ),
        ("cluster.platform", "cuda", "cluster.platform: must be one of ['', 'cpu', 'gpu', 'tpu']"),
        (
            "cluster.device_memory_fraction",
            1.5,
            "cluster.device_memory_fraction: must lie in [0, 1], got 1.5",
        ),
        (
            "cluster.prefill_mesh",
            "model=4",
            "cluster.prefill_mesh: mesh axis 'model' is not one of ('data', 'tensor', 'expert')"
            " (a mesh is written 'data=2,tensor=4'; empty: one device), got 'model=4'",
        ),
        ("cluster.decode_mesh", "tensor", "cluster.decode_mesh: mesh 'tensor': expected 'axis="),
        ("cluster.decode_mesh", "tensor=0", "cluster.decode_mesh: mesh axis 'tensor' has size 0"),
        (
            "cluster.prefill_mesh",
            "data=2,data=2",
            "cluster.prefill_mesh: mesh 'data=2,data=2' names",
        ),
    ],
)
def test_bad_value_names_its_key(key, value, message):
    rejects(with_value(key, value), message)


@pytest.mark.parametrize("key", numeric_keys(int) + numeric_keys(float))
def test_every_numeric_field_rejects_negative(key):
    low = -2 if key == "store.capacity_bytes" else -1  # -1: an unlimited store
    rejects(with_value(key, low), f"{key}: must ")


@pytest.mark.parametrize("key", numeric_keys(float))
def test_every_float_field_rejects_nan_and_inf(key):
    rejects(with_value(key, math.nan), f"{key}: must be finite, got nan")
    rejects(with_value(key, math.inf), f"{key}: must be finite, got inf")


def test_zero_means_unbounded_where_documented():
    for key in ["cluster.prefill_max_batch", "cluster.prefill_max_tokens", "store.capacity_bytes"]:
        config.validate(with_value(key, 0))
    config.validate(with_value("store.capacity_bytes", -1))  # unlimited, whatever the disk
    timed = config.WorkloadConfig(mode="online", aps=1.0, duration_s=60.0, agents=0)
    config.validate(config.ExperimentConfig(workload=timed))
    rejects(
        config.ExperimentConfig(workload=dataclasses.replace(timed, duration_s=0.0)),
        "workload.agents: must be >= 1 unless an online run ends after workload.duration_s, got 0",
    )


# --------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("cluster.decode_slots", "8", "cluster.decode_slots: expected an int, got str '8'"),
        ("cluster.decode_slots", 8.0, "cluster.decode_slots: expected an int, got float 8.0"),
        ("cluster.decode_slots", True, "cluster.decode_slots: expected an int, got bool True"),
        ("cluster.heartbeat_s", "1", "cluster.heartbeat_s: expected a number, got str '1'"),
        ("hardware.emulated", 1, "hardware.emulated: expected a bool, got int 1"),
        ("store.root", None, "store.root: expected a string, got NoneType None"),
        ("scheduler.policy", "dualpath", "scheduler.policy: expected a Policy, got str"),
        ("model.family", "qwen2", "model.family: expected a ModelFamily, got str"),
        ("cluster", config.StoreConfig(), "cluster: expected a ClusterConfig, got StoreConfig"),
        ("name", 3, "name: expected a string, got int 3"),
    ],
)
def test_wrong_type_names_its_key(key, value, message):
    rejects(with_value(key, value), message)


def test_mesh_settings_pass_and_round_trip():
    cfg = config.apply_overrides(
        config.ExperimentConfig(),
        [
            "cluster.prefill_mesh=data=2,tensor=2",
            "cluster.decode_mesh=tensor=2",
            "cluster.platform=cpu",
            "cluster.device_memory_fraction=0.45",
        ],
    )
    config.validate(cfg)
    c = cfg.cluster
    assert (c.prefill_mesh, c.decode_mesh, c.platform, c.device_memory_fraction) == (
        "data=2,tensor=2",
        "tensor=2",
        "cpu",
        0.45,
    )
    assert config.from_json(config.ExperimentConfig, config.to_json(cfg)) == cfg
    assert config.mesh_size(c.prefill_mesh) == 4 and config.mesh_size("") == 1


def test_int_passes_for_a_float_field():
    config.validate(with_value("cluster.heartbeat_s", 2))


def test_not_an_experiment_config():
    with pytest.raises(config.ConfigError, match="expected an ExperimentConfig, got ClusterConfig"):
        config.validate(config.ClusterConfig())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- relations


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"cluster.heartbeat_timeout_s": 1.0},
            "cluster.heartbeat_timeout_s: must be > cluster.heartbeat_s (1.0), got 1.0",
        ),
        ({"workload.mode": "online"}, "workload.aps: must be > 0 in online mode, got 0.0"),
        ({"model.num_kv_heads": 3}, "model.num_heads: must be a multiple of model.num_kv_heads"),
    ],
)
def test_relations(overrides, message):
    cfg = config.ExperimentConfig()
    for key, value in overrides.items():
        cfg = with_value(key, value, cfg)
    rejects(cfg, message)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model.kv_lora_rank", 0, "model.kv_lora_rank: must be >= 1 for MLA, got 0"),
        ("model.qk_rope_head_dim", 0, "model.qk_rope_head_dim: must be >= 1 for MLA"),
        ("model.v_head_dim", 0, "model.v_head_dim: must be >= 1 for MLA"),
        ("model.num_experts_per_tok", 9, "model.num_experts_per_tok: must lie in [1, model."),
        ("model.num_experts_per_tok", 0, "model.num_experts_per_tok: must lie in [1, model."),
        ("model.moe_intermediate_size", 0, "model.moe_intermediate_size: must be >= 1 with"),
        (
            "model.n_routed_experts",
            7,
            "model.n_routed_experts: must be a multiple of model.n_group",
        ),
        ("model.topk_group", 3, "model.topk_group: must be <= model.n_group (2), got 3"),
        # top_k 2 from topk_group 1 of 2 groups of 4 experts: at most 4.
        ("model.num_experts_per_tok", 5, "model.num_experts_per_tok: must be <= the experts in"),
        ("model.dense_layers", (0, 3), "model.dense_layers: must be a tuple of layer indices"),
        ("model.dense_layers", [1], "model.dense_layers: must be a tuple of layer indices"),
        ("model.qk_norm", True, "model.qk_norm: applies to GQA attention only"),
        ("model.moe_layer_step", 0, "model.moe_layer_step: must be >= 1, got 0"),
        ("model.moe_scoring", "relu", "model.moe_scoring: must be one of ['sigmoid', 'softmax']"),
        ("model.topk_method", "top2", "model.topk_method: must be one of ['greedy',"),
        ("model.rope_type", "llama3", "model.rope_type: must be one of ['default', 'yarn']"),
    ],
)
def test_model_relations(key, value, message):
    rejects(with_value(key, value, config.ExperimentConfig(model=TINY_DEEPSEEK)), message)


def test_yarn_needs_its_original_length_and_a_factor():
    yarn = dataclasses.replace(TINY_DEEPSEEK, rope_type="yarn", rope_factor=4.0)
    rejects(
        config.ExperimentConfig(model=yarn),
        "model.rope_original_max_len: must be >= 1 with yarn RoPE, got 0",
    )
    yarn = dataclasses.replace(yarn, rope_original_max_len=1024, rope_factor=0.5)
    rejects(config.ExperimentConfig(model=yarn), "model.rope_factor: must be >= 1 with yarn RoPE")


def test_model_presets_round_trip_through_json_and_overrides():
    for model in PRESETS.values():
        assert config.from_json(config.ModelConfig, config.to_json(model)) == model
    cfg = config.apply_overrides(config.ExperimentConfig(), ["model.dense_layers=[0, 2]"])
    assert cfg.model.dense_layers == (0, 2) and config.validate(cfg) is cfg


# --------------------------------------------------------------------------- where it is called


def test_overrides_then_validate():
    cfg = config.apply_overrides(config.ExperimentConfig(), ["cluster.decode_slots=-4"])
    rejects(cfg, "cluster.decode_slots: must be >= 1, got -4")


def test_from_json_validates_experiment_configs():
    text = config.to_json(with_value("cluster.decode_slots", -4))
    with pytest.raises(config.ConfigError, match="cluster.decode_slots: must be >= 1, got -4"):
        config.from_json(config.ExperimentConfig, text)


def test_get_config_must_return_an_experiment_config(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def get_config(arg=''):\n    return {'name': 'x'}\n")
    with pytest.raises(config.ConfigError, match=r"x.py:get_config returned dict, expected an Exp"):
        load_config(str(path))


def test_load_config_validates(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        "import dataclasses\n"
        "from dualpath_jax.config import ExperimentConfig, StoreConfig\n"
        "def get_config(arg=''):\n"
        "    return ExperimentConfig(store=StoreConfig(block_tokens=0))\n"
    )
    with pytest.raises(config.ConfigError, match="store.block_tokens: must be >= 1, got 0"):
        load_config(str(path))


def test_launcher_fails_at_once_on_a_bad_override(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "rollout.py"),
            "--config=configs/tiny.py",
            "--set=cluster.decode_slots=-4",
            f"--workdir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "cluster.decode_slots: must be >= 1, got -4" in proc.stderr
    assert not (tmp_path / "config.json").exists()
