"""`configs/paper.py`: the paper's testbeds as config files, and the cost-model fields of
`HardwareConfig` (`calibration`, `fp8`, `ep_decode_nodes`, `kv_format`) that let a config name
its cost model: parsing, validation, the JSON round trip, and the cost model built from it."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from dualpath_jax import config
from dualpath_jax.config import validation
from dualpath_jax.configs_loader import load_config
from dualpath_jax.presets import (
    CALIBRATIONS,
    HOPPER_NODE,
    PAPER_CONFIGS,
    PAPER_MODELS,
    TINY_DEEPSEEK,
    config_cost_model,
    get_preset,
    hopper_calibration,
    make_cost_model,
    paper_config,
    paper_cost_model,
    paper_experiment,
)
from dualpath_jax.sched.cost import RooflineCostModel

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs" / "paper.py"


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_the_config_file_is_paper_experiment(name):
    key, split = name.split("_")
    m = PAPER_MODELS[key]
    assert split == f"{m.prefill_nodes}p{m.decode_nodes}d"
    cfg = load_config(f"{PAPER}:{name}")
    want, cost = paper_experiment(key)
    assert cfg == want
    # The config names its cost model: the same calibrated roofline, rebuilt from it alone.
    assert config_cost_model(cfg) == cost == paper_cost_model(key, m.decode_nodes)
    assert cfg.hardware.hbm_bytes == cost.kv_hbm_bytes()
    hw = cfg.hardware
    assert (hw.calibration, hw.fp8, hw.ep_decode_nodes) == ("hopper", m.fp8, 0)
    assert hw.kv_format == m.kv_format == ("" if key == "qwen32b" else "fp8_flashmla")
    assert config.from_json(config.ExperimentConfig, config.to_json(cfg)) == cfg


def test_the_default_is_ds660b_2p4d():
    assert load_config(str(PAPER)) == paper_experiment("ds660b")[0]
    assert load_config(str(PAPER)).name == "paper_ds660b_2p4d"


def test_arg_options_are_paper_experiment_keywords():
    cfg = load_config(
        f"{PAPER}:ds660b_48p96d,ep_decode_nodes=4,preset=32k,agents=2_048,max_turns=3,"
        "snic_gbps=168,policy=basic,seed=7,append_scale=2,gen_scale=0.5"
    )
    want, cost = paper_experiment(
        "ds660b",
        48,
        96,
        ep_decode_nodes=4,
        preset="32k",
        agents=2048,
        max_turns=3,
        snic_bytes_per_s=168 / 8 * 1e9,
        policy="basic",
        seed=7,
        append_scale=2.0,
        gen_scale=0.5,
    )
    assert cfg == want and cfg.hardware.ep_decode_nodes == 4
    # 2P4D's expert-parallel group, replicated: 2P4D's weights per GPU and cost model.
    assert config_cost_model(cfg) == cost == paper_experiment("ds660b", 2, 4)[1]
    online = paper_config("ds27b_1p1d,mode=online,aps=0.25,duration_s=600,agents=0")
    assert (
        online == paper_experiment("ds27b", mode="online", aps=0.25, duration_s=600.0, agents=0)[0]
    )
    assert paper_config("qwen32b") == paper_experiment("qwen32b")[0]


@pytest.mark.parametrize(
    "arg, message",
    [
        ("ds99b_2p4d", "configs/paper.py: unknown testbed 'ds99b_2p4d'"),
        ("ds660b_2x4", "configs/paper.py: unknown testbed 'ds660b_2x4'"),
        ("ds660b_2p4d,agents", "configs/paper.py: bad option 'agents'"),
        ("ds660b_2p4d,turns=2", "configs/paper.py: bad option 'turns=2'"),
        ("ds660b_2p4d,agents=many", "configs/paper.py: option agents: expected int, got 'many'"),
    ],
)
def test_bad_args_are_config_errors(arg, message):
    with pytest.raises(config.ConfigError) as e:
        load_config(f"{PAPER}:{arg}")
    assert str(e.value).startswith(message), str(e.value)


def test_a_split_that_does_not_fit_says_so():
    with pytest.raises(ValueError, match="ds660b 5P1D does not fit"):
        paper_config("ds660b_5p1d")


def test_cost_model_fields_override_and_round_trip():
    cfg = paper_config("ds660b_2p4d")
    new = config.apply_overrides(
        cfg,
        [
            "hardware.calibration=none",
            "hardware.fp8=false",
            "hardware.ep_decode_nodes=2",
            "hardware.kv_format=bfloat16",
        ],
    )
    hw = new.hardware
    assert (hw.calibration, hw.fp8, hw.ep_decode_nodes, hw.kv_format) == (
        "none",
        False,
        2,
        "bfloat16",
    )
    assert config.apply_overrides(cfg, ["hardware.fp8=null"]).hardware.fp8 is None
    assert config.from_json(config.ExperimentConfig, config.to_json(new)) == config.validate(new)
    data = config.to_dict(cfg)["hardware"]
    assert (data["calibration"], data["fp8"], data["kv_format"]) == ("hopper", True, "fp8_flashmla")
    # Missing keys (a config.json written before these fields) keep the defaults.
    old = config.from_json(config.ExperimentConfig, '{"hardware": {"gpu": "h800"}}').hardware
    assert (old.calibration, old.fp8, old.ep_decode_nodes, old.kv_format) == ("hopper", None, 0, "")


def test_the_config_builds_the_cost_model_it_names():
    cfg = paper_config("ds660b_2p4d")
    cost = config_cost_model(cfg)
    assert isinstance(cost, RooflineCostModel)
    assert cost.expert_parallel == 4 * 8 and cost.fp8
    assert cost.model.kv_bytes_per_token_per_layer == 656  # FP8 FlashMLA
    cal = hopper_calibration()
    assert cost.prefill_efficiency == cal.prefill_efficiency

    # Each field changes what it names.
    def built(*overrides):
        out = config_cost_model(config.apply_overrides(cfg, list(overrides)))
        assert isinstance(out, RooflineCostModel)
        return out

    bare = built("hardware.calibration=none")
    assert bare.prefill_efficiency == 0.0 and bare.decode_overhead_s == 0.0
    assert dataclasses.replace(bare, prefill_efficiency=cost.prefill_efficiency,
                               decode_overhead_s=cost.decode_overhead_s) == cost  # fmt: skip
    assert not built("hardware.fp8=false").fp8
    assert built("hardware.ep_decode_nodes=2").expert_parallel == 2 * 8
    assert built("hardware.kv_format=").model.kv_bytes_per_token_per_layer == 576  # float8 latent
    # An explicit kv_format (SimOptions.kv_format) wins over the config's.
    assert config_cost_model(cfg, kv_format="bfloat16").model.kv_bytes_per_token_per_layer == 1152
    # A dense model has no routed experts to spread; FP8 defaults to the DeepSeek family.
    qwen = config_cost_model(paper_config("qwen32b_1p2d"))
    assert isinstance(qwen, RooflineCostModel) and qwen.expert_parallel == 1 and not qwen.fp8
    assert make_cost_model(HOPPER_NODE, get_preset("ds-27b")).fp8  # type: ignore[union-attr]


def test_calibration_names_match_validation():
    assert tuple(CALIBRATIONS) == validation._CHOICES["hardware.calibration"]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("hardware.calibration", "fast", "hardware.calibration: must be one of ['hopper', 'none'], got 'fast'"),
        ("hardware.kv_format", "fp9", "hardware.kv_format: must be one of ['', 'fp8_flashmla', "),
        ("hardware.fp8", "yes", "hardware.fp8: must be true, false or null"),
        ("hardware.ep_decode_nodes", -1, "hardware.ep_decode_nodes: must be >= 0, got -1"),
        ("hardware.ep_decode_nodes", 5, "hardware.ep_decode_nodes: must be <= cluster.decode_nodes (4)"),
    ],
)  # fmt: skip
def test_bad_cost_model_fields_are_rejected(key, value, message):
    cfg = paper_config("ds660b_2p4d")
    bad = dataclasses.replace(
        cfg, hardware=dataclasses.replace(cfg.hardware, **{key.split(".")[1]: value})
    )
    with pytest.raises(config.ConfigError) as e:
        config.validate(bad)
    assert str(e.value).startswith(message), str(e.value)


def test_fp8_flashmla_needs_an_mla_model():
    cfg = config.ExperimentConfig(
        hardware=dataclasses.replace(HOPPER_NODE, kv_format="fp8_flashmla")
    )
    with pytest.raises(config.ConfigError, match="hardware.kv_format: fp8_flashmla applies to MLA"):
        config.validate(cfg)
    config.validate(dataclasses.replace(cfg, model=TINY_DEEPSEEK))
    with pytest.raises(config.ConfigError, match="hardware.fp8: expected a bool, got 'maybe'"):
        config.apply_overrides(cfg, ["hardware.fp8=maybe"])


def test_model_and_node_presets_load_no_compiled_core_module():
    """A program takes them (and the CPU configs) before it opts in to the compiled core."""
    code = (
        "import sys\n"
        "from dualpath_jax.presets import TINY_QWEN2, HOPPER_NODE, emulated_cpu_experiment\n"
        "import dualpath_jax.model as dm; dm.get_preset('ds-27b')\n"
        "from dualpath_jax.configs_loader import load_config\n"
        "load_config('configs/cpu_1p2d.py'); load_config('configs/tiny.py')\n"
        "from dualpath_jax._compiled import MODULES\n"
        "print([m for m in MODULES if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
