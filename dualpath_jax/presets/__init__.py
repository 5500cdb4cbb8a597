"""Presets: models, GPUs and nodes, the roofline's calibration, and the paper's testbeds.

- `presets.models`: model presets (a tiny model per family: `TINY_QWEN2`, `TINY_QWEN3`,
  `TINY_QWEN3_MOE`, `TINY_DEEPSEEK`, `TINY_DEEPSEEK_V2`; the full-size specs;
  `get_preset(name)`) and sizing-only ones (`SIZING_MODELS`).
- `presets.hardware`: the paper's node (`HOPPER_NODE`) and the emulated CPU nodes and
  experiments (`cpu_emulated`, `emulated_cpu_experiment`).
- `presets.gpus`: the GPUs `HardwareConfig.gpu` names (`GPU_PRESETS`, `get_gpu`).
- `presets.calibration`: the calibration to published serving throughput (`hopper_calibration`),
  the cost model a config names (`make_cost_model`, `config_cost_model`) and a preset's
  sizing (`sizing_cost(name)`).
- `presets.paper`: the paper's three testbeds (`PAPER_MODELS`, `paper_experiment`,
  `paper_config`, what `configs/paper.py` loads).

The cost-model maths these feed is `dualpath_jax.sched.cost`. Names resolve lazily: the model
and node presets import no module of the compiled core (`dualpath_jax.native`), so a program can
take them before it opts in to it; the GPUs, the calibration and the paper's testbeds (cost
models) do.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    **dict.fromkeys(
        (
            "DEEPSEEK_V3_660B",
            "DEEPSEEK_V32_660B",
            "DS_27B",
            "GPT_OSS_120B",
            "PRESETS",
            "QWEN25_7B",
            "QWEN25_32B",
            "QWEN3_235B_A22B",
            "SIZING_MODELS",
            "TINY_DEEPSEEK",
            "TINY_DEEPSEEK_V2",
            "TINY_QWEN2",
            "TINY_QWEN3",
            "TINY_QWEN3_MOE",
            "get_preset",
        ),
        "models",
    ),
    **dict.fromkeys(
        ("CPU_TPOT_SLO_S", "HOPPER_NODE", "cpu_emulated", "emulated_cpu_experiment"), "hardware"
    ),
    **dict.fromkeys(("GPU_PRESETS", "get_gpu"), "gpus"),
    **dict.fromkeys(
        (
            "CALIBRATIONS",
            "DEEPSEEK_V3_SERVING",
            "Calibration",
            "PublishedServing",
            "TINY_CPU_PREFILL_COST",
            "calibrate",
            "config_cost_model",
            "expert_parallel_gpus",
            "hopper_calibration",
            "make_cost_model",
            "sizing_cost",
        ),
        "calibration",
    ),
    **dict.fromkeys(
        (
            "PAPER_CONFIGS",
            "PAPER_MODELS",
            "PaperModel",
            "paper_config",
            "paper_split_arg",
            "paper_cost_model",
            "paper_experiment",
            "paper_hardware",
        ),
        "paper",
    ),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dualpath_jax.presets' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dualpath_jax.presets.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
