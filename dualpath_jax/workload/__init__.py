"""Workloads: the trace JSONL format and replay rule, synthetic Table 2 traces, arrivals."""

from dualpath_jax.workload.arrivals import (
    Arrival,
    agent_trajectories,
    offline_arrivals,
    poisson_arrivals,
    schedule,
)
from dualpath_jax.workload.synthetic import PRESETS, SyntheticPreset, Table2Row, generate
from dualpath_jax.workload.trace import (
    Round,
    TraceError,
    TraceStats,
    Trajectory,
    TurnSpec,
    dump_trace,
    expand,
    load_trace,
    materialize,
    parse_trace,
    parse_trajectory,
    prompt_tokens,
    trace_stats,
    truncate,
    turn_specs,
)

__all__ = [
    "PRESETS",
    "Arrival",
    "Round",
    "SyntheticPreset",
    "Table2Row",
    "TraceError",
    "TraceStats",
    "Trajectory",
    "TurnSpec",
    "agent_trajectories",
    "dump_trace",
    "expand",
    "generate",
    "load_trace",
    "materialize",
    "offline_arrivals",
    "parse_trace",
    "parse_trajectory",
    "poisson_arrivals",
    "prompt_tokens",
    "schedule",
    "trace_stats",
    "truncate",
    "turn_specs",
]
