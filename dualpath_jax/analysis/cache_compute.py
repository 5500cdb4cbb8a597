"""The cache-compute ratio of Table 1: GB of KV to load per PFLOP of prefill compute.

`ratio = kv_bytes(context) / (append * flops_per_new_token(context, append))`, FLOPs counted as
2 x active parameters plus attention (see `sched.cost.ModelCost`). Expressed in GB/PFLOP.
"""

from __future__ import annotations

import dataclasses

from dualpath_jax.presets.calibration import sizing_cost
from dualpath_jax.sched.cost import ModelCost

TABLE1_APPEND = 429


def cache_compute_ratio(cost: ModelCost, context: int, append: int = TABLE1_APPEND) -> float:
    """GB of cached KV per PFLOP when `append` tokens are prefilled after `context` cached ones."""
    if context < 0 or append < 1:
        raise ValueError(f"need context >= 0 and append >= 1, got {context}, {append}")
    flops = append * cost.flops_per_new_token(context, append)
    return cost.kv_bytes(context) / flops * 1e6  # (B / FLOP) * 1e15 / 1e9


@dataclasses.dataclass(frozen=True)
class Table1Row:
    label: str
    model: str
    kv_format: str | None
    paper: tuple[float, float]  # the paper's values at 16K and 64K (GB/PFLOP)


TABLE1: tuple[Table1Row, ...] = (
    Table1Row("Qwen2.5-32B (FP16 KV)", "qwen2.5-32b", "float16", (117, 267)),
    Table1Row("GPT-OSS-120B", "gpt-oss-120b", "float8_e4m3fn", (47, 95)),
    Table1Row("Qwen3-235B-A22B", "qwen3-235b-a22b", "float8_e4m3fn", (39, 60)),
    Table1Row("DeepSeek-V3.2 660B", "deepseek-v3.2-660b", "fp8_flashmla", (13, 36)),
    Table1Row("DeepSeek-V3 660B", "deepseek-v3-660b", "fp8_flashmla", (4.8, 5.8)),
)


def table1(
    contexts: tuple[int, ...] = (16 * 1024, 64 * 1024), append: int = TABLE1_APPEND
) -> list[tuple[Table1Row, tuple[float, ...]]]:
    """Each Table 1 row with our ratio at every context."""
    out = []
    for row in TABLE1:
        cost = sizing_cost(row.model, row.kv_format)
        out.append((row, tuple(cache_compute_ratio(cost, c, append) for c in contexts)))
    return out


def _ctx_label(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else f"{c / 1000:.1f}k"


def format_table1(
    contexts: tuple[int, ...] = (16 * 1024, 64 * 1024), append: int = TABLE1_APPEND
) -> str:
    head = f"{'model':<24}" + "".join(f"{_ctx_label(c):>9}" for c in contexts)
    head += "   paper 16K-64K"
    lines = [f"cache-compute ratio (GB/PFLOP), append {append}", head]
    for row, vals in table1(contexts, append):
        cells = "".join(f"{v:>9.1f}" for v in vals)
        lines.append(f"{row.label:<24}{cells}   {row.paper[0]:g} - {row.paper[1]:g}")
    return "\n".join(lines)
