"""Tiny CPU experiment: one prefill and one decode engine with a tiny model, no emulated links.

Run: python launch/rollout.py --config=configs/tiny.py:qwen2 --workdir=/tmp/dp_tiny
ARG: the model family: `qwen2` (default), `qwen3`, `qwen3_moe`, `deepseek` (DeepSeek-V3) or
`deepseek_v2`.
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.config import ExperimentConfig, WorkloadConfig
from dualpath_jax.presets import (
    TINY_DEEPSEEK,
    TINY_DEEPSEEK_V2,
    TINY_QWEN2,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
)


def get_config(arg: str = "qwen2") -> ExperimentConfig:
    models = {
        "qwen2": TINY_QWEN2,
        "qwen3": TINY_QWEN3,
        "qwen3_moe": TINY_QWEN3_MOE,
        "deepseek": TINY_DEEPSEEK,
        "deepseek_v2": TINY_DEEPSEEK_V2,
    }
    if arg not in models:
        raise ValueError(f"configs/tiny.py: ARG must be one of {sorted(models)}, got {arg!r}")
    return dataclasses.replace(
        ExperimentConfig(),
        name=f"tiny-{arg}",
        model=models[arg],
        workload=WorkloadConfig(preset="64k", trajectories=4, agents=4, length_scale=1 / 64),
    )
