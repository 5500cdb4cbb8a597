"""Storage-bound 1P2D on one CPU host with emulated links (DualPath's bound: (P+D)/P over Basic).

Run: python launch/rollout.py --config=configs/cpu_1p2d.py --policy=dualpath --workdir=/tmp/dp_1p2d
ARG: comma list of `qwen2` (default) or `deepseek`, and `tiny` (8 agents, the demo).

An experiment: its links are emulated at the demo's ratio (0.5 MB/s storage NICs,
docs/emulation.md), so a later turn waits seconds for its cached KV. To serve, use
configs/serve.py (every link at the host's speed).
"""

from __future__ import annotations

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.presets import emulated_cpu_experiment


def get_config(arg: str = "") -> ExperimentConfig:
    return emulated_cpu_experiment(1, 2, arg)
