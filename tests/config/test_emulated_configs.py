"""Emulated links only where a config asks for them: the serving config paces no link in any of
its variants, the experiment configs pace theirs and say so in their docstrings, and one notion
(`transfer.links.emulated_links`: every link with a rate > 0) is what the engines pace, the link
snapshot and the run summaries report, whatever the `hardware.emulated` label says."""

from __future__ import annotations

import pathlib

import pytest

from dualpath_jax import load_config
from dualpath_jax.config import HardwareConfig, apply_overrides, validate
from dualpath_jax.transfer.links import LinkKind, TrafficClass, emulated_links, link_rate
from dualpath_jax.transfer.paths import store_read_path
from dualpath_jax.transfer.traffic import TrafficManager

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
EXPERIMENTS = ("cpu_1p1d", "cpu_1p2d", "cpu_2p1d", "balanced")


@pytest.mark.parametrize(
    "arg,model,engines,slots",
    [
        ("", "tiny-qwen2", (1, 1), 8),
        ("tiny", "tiny-qwen2", (1, 1), 4),
        ("deepseek", "tiny-deepseek", (1, 1), 8),
        ("qwen3_moe,tiny", "tiny-qwen3-moe", (1, 1), 4),
        ("2p1d", "tiny-qwen2", (2, 1), 8),
        ("1p2d,tiny", "tiny-qwen2", (1, 2), 4),
    ],
)
def test_the_serving_config_builds_validates_and_emulates_no_link(arg, model, engines, slots):
    cfg = load_config(f"configs/serve.py:{arg}" if arg else "configs/serve.py")
    validate(cfg)
    assert emulated_links(cfg.hardware) == {}
    assert all(link_rate(cfg.hardware, k) == 0 for k in LinkKind)
    assert cfg.scheduler.recompute == "auto"
    assert cfg.model.name == model
    assert (cfg.cluster.prefill_nodes, cfg.cluster.decode_nodes) == engines
    assert cfg.cluster.decode_slots == slots


def test_the_serving_config_refuses_an_unknown_arg():
    with pytest.raises(ValueError, match="unknown ARG part 'fast'"):
        load_config("configs/serve.py:tiny,fast")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_experiment_configs_emulate_their_links_and_say_so(name):
    hw = load_config(f"configs/{name}.py").hardware
    links = emulated_links(hw)
    assert links["snic_rx"] == hw.snic_bytes_per_s > 0
    assert links["cnic_tx"] == 8 * hw.snic_bytes_per_s and "dram" not in links
    doc = (CONFIG_DIR / f"{name}.py").read_text().split('"""')[1]
    assert "emulated links" in doc and "configs/serve.py" in doc


def test_one_notion_of_emulated_what_is_paced_whatever_the_label():
    paced_unlabelled = HardwareConfig(snic_bytes_per_s=1e6, emulated=False)
    labelled_unpaced = HardwareConfig(emulated=True)
    assert emulated_links(paced_unlabelled) == {"snic_rx": 1e6, "snic_tx": 1e6}
    assert emulated_links(labelled_unpaced) == {}
    with TrafficManager(paced_unlabelled) as tm:
        tm.transfer(store_read_path("n0"), 1000, TrafficClass.LOW)
        assert tm.snapshot()["emulated"] is True
        assert tm.link(store_read_path("n0")[0]).rate == 1e6  # paced
    with TrafficManager(labelled_unpaced) as tm:
        assert tm.snapshot()["emulated"] is False
    # the label alone does not stop an experiment's pacing: rates of 0 do
    cpu = load_config("configs/cpu_1p1d.py")
    assert emulated_links(apply_overrides(cpu, ["hardware.emulated=false"]).hardware)
    zero = [f"hardware.{k}_bytes_per_s=0" for k in ("snic", "cnic", "h2d", "d2h")]
    assert emulated_links(apply_overrides(cpu, zero).hardware) == {}
