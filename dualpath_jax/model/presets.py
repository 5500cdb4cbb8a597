"""Moved to `dualpath_jax.presets.models`; these names stay here only for the pages of docs/ that
still import them from here (docs/api.md), and go once those name the new home."""

from dualpath_jax.presets.models import (  # noqa: F401
    DEEPSEEK_V3_660B,
    DEEPSEEK_V32_660B,
    DS_27B,
    PRESETS,
    QWEN25_32B,
    TINY_DEEPSEEK,
    TINY_QWEN2,
    get_preset,
)
