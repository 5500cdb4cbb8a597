"""Tiny CPU experiment: one prefill and one decode engine with a tiny model, no emulated links.

Run: python launch/rollout.py --config=configs/tiny.py:qwen2 --workdir=/tmp/dp_tiny
ARG: `qwen2` (default) or `deepseek` selects the model family.
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.config import ExperimentConfig, WorkloadConfig
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2


def get_config(arg: str = "qwen2") -> ExperimentConfig:
    models = {"qwen2": TINY_QWEN2, "deepseek": TINY_DEEPSEEK}
    if arg not in models:
        raise ValueError(f"configs/tiny.py: ARG must be one of {sorted(models)}, got {arg!r}")
    return dataclasses.replace(
        ExperimentConfig(),
        name=f"tiny-{arg}",
        model=models[arg],
        workload=WorkloadConfig(preset="64k", trajectories=4, agents=4, length_scale=1 / 64),
    )
