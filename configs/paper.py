"""The paper's testbeds on H800 nodes (section 7.2), for the cluster simulator.

Run: python launch/simulate.py --config=configs/paper.py:ds660b_2p4d --policy=dualpath --agents=2048 --workdir=/tmp/dp_paper

ARG: `NAME[,key=value...]`. NAME is one of the paper's testbeds, `ds660b_2p4d` (default:
DeepSeek-V3.2 660B, 2P4D), `ds27b_1p1d` (DS 27B, 1P1D) or `qwen32b_1p2d` (Qwen2.5-32B, 1P2D on
H200s), or any other split `MODEL_<P>p<D>d` of these models (`ds660b_48p96d`). Options:
`preset` (the Table 2 trace: `32k`, `48k`, `64k`, default 64k), `agents` (default 1,024),
`max_turns`, `snic_gbps` (storage NIC per node, default 400), `ep_decode_nodes` (decode nodes one
expert-parallel group spans, default all), `policy`, `mode`, `aps`, `duration_s`,
`append_scale`, `gen_scale`, `seed`; e.g. `configs/paper.py:ds660b_48p96d,ep_decode_nodes=4`.
The launchers' `--policy`, `--agents`, `--max_turns`, `--aps` and `--set key=value` apply on top.

`config_for_split(arg, P, D)` is the same ARG on another split: `launch/simulate.py --advise`
simulates each candidate split with it, so each has its own HBM for KV.

The config names its cost model (`hardware.calibration="hopper"`, `hardware.fp8`,
`hardware.kv_format="fp8_flashmla"` for the DeepSeek models, `hardware.ep_decode_nodes`), so
the simulator rebuilds the calibrated roofline of `presets.paper_experiment` from it alone.
"""

from __future__ import annotations

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.presets import paper_config, paper_split_arg


def get_config(arg: str = "ds660b_2p4d") -> ExperimentConfig:
    return paper_config(arg)


def config_for_split(arg: str, prefill_nodes: int, decode_nodes: int) -> ExperimentConfig:
    """The same testbed and options on another P/D split (`launch/simulate.py --advise`)."""
    return paper_config(paper_split_arg(arg or "ds660b_2p4d", prefill_nodes, decode_nodes))
