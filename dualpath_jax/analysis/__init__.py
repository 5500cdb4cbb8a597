"""Analysis tools: the bottleneck-free P/D range (section 4.2) and the cache-compute ratio
(Table 1)."""

from dualpath_jax.analysis.cache_compute import (
    TABLE1,
    cache_compute_ratio,
    format_table1,
    table1,
)
from dualpath_jax.analysis.pd_range import Bound, PDRange, as_fraction, format_pd_range, pd_range
from dualpath_jax.presets.calibration import sizing_cost

__all__ = [
    "TABLE1",
    "Bound",
    "PDRange",
    "as_fraction",
    "cache_compute_ratio",
    "format_pd_range",
    "format_table1",
    "pd_range",
    "sizing_cost",
    "table1",
]
