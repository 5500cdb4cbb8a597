"""1P2D on one CPU host with storage bandwidth above demand: loading is not the bottleneck, so
DualPath should come close to Oracle.

Run: python launch/rollout.py --config=configs/balanced.py --policy=dualpath --workdir=/tmp/dp_bal
ARG: as for configs/cpu_1p2d.py.

An experiment with emulated links (docs/emulation.md); to serve, use configs/serve.py.
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.presets import emulated_cpu_experiment


def get_config(arg: str = "") -> ExperimentConfig:
    return dataclasses.replace(
        emulated_cpu_experiment(1, 2, arg, snic_bytes_per_s=200e6), name="balanced"
    )
