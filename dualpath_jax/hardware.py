"""Moved to `dualpath_jax.presets` (`presets.hardware`, `presets.paper`); these names stay here only
for what still imports them from here (docs/api.md's examples), and go once those name the new
home."""

from __future__ import annotations

from typing import Any

from dualpath_jax.presets.hardware import (  # noqa: F401
    HOPPER_NODE,
    cpu_emulated,
    emulated_cpu_experiment,
)

_PAPER = ("PAPER_MODELS", "paper_cost_model", "paper_experiment")


def __getattr__(name: str) -> Any:  # the paper's testbeds load the cost models: only when asked
    if name in _PAPER:
        from dualpath_jax.presets import paper

        return getattr(paper, name)
    raise AttributeError(f"module 'dualpath_jax.hardware' has no attribute {name!r}")
