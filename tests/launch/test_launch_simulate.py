"""`launch/simulate.py` runs the paper's testbeds from `configs/paper.py` alone (the config names
its cost model), and its summary is the in-process `simulate(cfg)` of the same config."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from dualpath_jax.config import ExperimentConfig, from_json
from dualpath_jax.configs_loader import load_config
from dualpath_jax.presets import PAPER_MODELS, paper_experiment
from dualpath_jax.sim import SimOptions, simulate

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_launcher_runs_a_paper_testbed_from_its_config(tmp_path):
    args = ["--config=configs/paper.py:ds660b_2p4d,preset=32k", "--policy=basic", "--agents=8"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "simulate.py"), *args, "--max_turns=2",
         f"--workdir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["simulated"] and not summary["emulated"]
    assert (summary["policy"], summary["agents"], summary["errors"]) == ("basic", 8, 0)
    assert summary["requests"] == 8 * 2 and summary["jct_s"] > 0
    # config.json is the run's whole config: the flags applied, the cost model named.
    cfg = from_json(ExperimentConfig, (tmp_path / "config.json").read_text())
    want, cost = paper_experiment("ds660b", policy="basic", agents=8, preset="32k", max_turns=2)
    assert cfg == want
    assert cfg.hardware.kv_format == "fp8_flashmla" and cfg.hardware.calibration == "hopper"
    # The same simulation in process, with the cost model and KV format given explicitly.
    run = simulate(cfg, cost=cost, options=SimOptions(kv_format=PAPER_MODELS["ds660b"].kv_format))
    for key in ("jct_s", "requests", "tokens_generated", "bytes_read_pe_path", "bytes_read_de_path",
                "ttft_s", "tpot_s", "snic_max_over_avg"):  # fmt: skip
        assert summary[key] == run.summary[key], key
    assert load_config("configs/paper.py:ds660b_2p4d,preset=32k").workload.preset == "32k"


def test_native_on_without_a_build_is_a_clear_error(tmp_path):
    from dualpath_jax import native

    if not native.check():
        pytest.skip("a usable build sits in the source tree: nothing to refuse")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "simulate.py"), "--config=configs/cpu_1p1d.py:tiny",
         "--native=on", "--agents=1", "--max_turns=1", f"--workdir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "the compiled core cannot be used" in proc.stderr


def test_advise_simulates_each_split_from_the_config_files_split_hook(tmp_path):
    """configs/paper.py's `config_for_split`: every candidate split gets its own HBM for KV (the
    weights per GPU depend on the decode GPUs), not the base split's."""
    from dualpath_jax.configs_loader import split_configurer
    from dualpath_jax.sim.advisor import candidate_config

    arg = "ds660b_2p4d,preset=32k,agents=4,max_turns=2"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "simulate.py"), f"--config=configs/paper.py:{arg}",
         "--advise", "--advise_pd=2p4d,1p5d", "--advise_alpha_s=3", "--advise_beta_s=5",
         f"--workdir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        (c["prefill_nodes"], c["decode_nodes"]): c
        for c in json.loads((tmp_path / "advise.json").read_text())["candidates"]
    }
    split = split_configurer(f"configs/paper.py:{arg}")
    base = load_config(f"configs/paper.py:{arg}")
    one_five = split(1, 5)
    assert one_five == load_config("configs/paper.py:ds660b_1p5d,preset=32k,agents=4,max_turns=2")
    assert one_five.hardware.hbm_bytes != base.hardware.hbm_bytes  # the split's own KV room
    assert one_five.workload == base.workload
    want = simulate(candidate_config(one_five, 1, 5, 3.0, 5.0)).summary["jct_s"]
    assert rows[(1, 5)]["jct_s"] == want
    assert split_configurer("configs/cpu_1p1d.py:tiny") is None  # no hook: node counts only
