"""Config dataclasses: JSON round trip, typed overrides with clear errors, every config file."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from dualpath_jax import config
from dualpath_jax.configs_loader import load_config

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


def test_json_round_trip():
    cfg = config.ExperimentConfig()
    cfg = config.apply_overrides(cfg, ["scheduler.policy=split", "model.num_layers=5", "name=x"])
    back = config.from_json(config.ExperimentConfig, config.to_json(cfg))
    assert back == cfg
    assert back.scheduler.policy is config.Policy.SPLIT


def test_overrides_are_typed():
    cfg = config.apply_overrides(
        config.ExperimentConfig(),
        [
            "hardware.snic_bytes_per_s=64e6",
            "hardware.emulated=true",
            "cluster.decode_nodes=2",
            "store.block_tokens=32",
            "workload.length_scale=0.25",
            "model.family=deepseek",
        ],
    )
    assert cfg.hardware.snic_bytes_per_s == 64e6 and cfg.hardware.emulated is True
    assert cfg.cluster.decode_nodes == 2 and isinstance(cfg.cluster.decode_nodes, int)
    assert cfg.store.block_tokens == 32
    assert cfg.model.family is config.ModelFamily.DEEPSEEK


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.nope=1", "unknown key 'nope'"),
        ("bogus=1", "unknown key 'bogus'"),
        ("cluster.decode_nodes=two", "expected an int"),
        ("cluster.decode_nodes=1.5", "expected an int"),
        ("hardware.emulated=maybe", "expected a bool"),
        ("scheduler.policy=fastest", "not one of"),
        ("hardware.cnic_bytes_per_s=fast", "expected a number"),
        ("model.num_layers", "expected key=value"),
        ("model.num_layers.x=1", "has no fields"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(config.ConfigError, match=message):
        config.apply_overrides(config.ExperimentConfig(), [override])


def test_from_dict_rejects_unknown_and_mistyped():
    with pytest.raises(config.ConfigError, match="unknown key"):
        config.from_dict(config.StoreConfig, {"kind": "file", "rooot": "/x"})
    with pytest.raises(config.ConfigError, match="block_tokens: expected an int"):
        config.from_dict(config.StoreConfig, {"block_tokens": "64"})


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ExperimentConfig().name = "x"  # type: ignore[misc]


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.py")), ids=lambda p: p.name)
def test_every_config_file_builds(path):
    cfg = load_config(str(path))
    assert isinstance(cfg, config.ExperimentConfig)
    assert config.from_json(config.ExperimentConfig, config.to_json(cfg)) == cfg


def test_config_arg_and_errors():
    assert load_config(f"{CONFIG_DIR}/tiny.py:deepseek").model.name == "tiny-deepseek"
    for arg in ("qwen3", "qwen3_moe", "deepseek_v2"):
        cfg = load_config(f"{CONFIG_DIR}/tiny.py:{arg}")
        assert cfg.model.family.value == arg and config.validate(cfg) is cfg
    with pytest.raises(ValueError, match="ARG must be one of"):
        load_config(f"{CONFIG_DIR}/tiny.py:gpt")
    with pytest.raises(config.ConfigError, match="does not exist"):
        load_config("configs/missing.py")


def test_a_bare_name_is_a_repository_config_wherever_the_caller_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("cpu_1p1d:tiny") == load_config(f"{CONFIG_DIR}/cpu_1p1d.py:tiny")
    with pytest.raises(config.ConfigError, match=r"no config named 'nope'; known: \[.*'cpu_1p1d'"):
        load_config("nope")
