"""Which parametrized cases the fast tier runs: one rule for the tests written per model family.

The fast tier (`make test`) runs the GQA family (Qwen2) and the MLA/MoE one (DeepSeek-V3); the
other cases of a family-parametrized test carry the `slow` marker and run in the full tier.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

FAST_FAMILIES = ("qwen2", "deepseek")


def family_params(names: Iterable[str], fast: Iterable[str] = FAST_FAMILIES) -> list:
    """`names` as pytest params, those outside `fast` marked slow."""
    fast = tuple(fast)
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]
