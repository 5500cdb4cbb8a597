"""The flags the run launchers share (`rollout.py`, `serve.py`, `simulate.py` import this file
from their own directory) and the config they build with `dualpath_jax.launcher`."""

from __future__ import annotations

import pathlib

from absl import flags

from dualpath_jax import launcher
from dualpath_jax.config import ExperimentConfig, Policy
from dualpath_jax.configs_loader import load_config

CONFIG = flags.DEFINE_string(
    "config", "configs/cpu_1p2d.py", "Experiment file `configs/NAME.py[:ARG]`."
)
SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory (config.json, events, summary.json)."
)
POLICY = flags.DEFINE_enum(
    "policy", None, [p.value for p in Policy], "Loading policy (overrides the config)."
)
AGENTS = flags.DEFINE_integer(
    "agents", None, "Agents (trajectories replayed; overrides workload.agents)."
)
MAX_TURNS = flags.DEFINE_integer(
    "max_turns", None, "Rounds kept per trajectory (overrides workload.max_turns; 0: every round)."
)
TRACE = flags.DEFINE_string(
    "trace",
    None,
    "Trace file or directory (overrides the synthetic preset). It replays as recorded: the"
    " config file's agents, length_scale, max_len and max_turns apply only when set for this run"
    " (--agents, --max_turns, --set workload.KEY=...).",
)
TRACE_FORMAT = flags.DEFINE_enum(
    "trace_format",
    None,
    ["jsonl", "mooncake", "conversation", "weka", "tracelab"],
    "Format of --trace (overrides workload.trace_format): this project's JSONL, a Mooncake"
    " request trace, a ShareGPT/OpenAI conversation file, Weka coding-agent sessions (a file or a"
    " directory) or a TraceLab round trace (docs/traces.md).",
)


def apply_flags(cfg: ExperimentConfig, mode: str, **workload: object) -> ExperimentConfig:
    """`cfg` with --set and the convenience flags applied (`launcher.run_config`)."""
    return launcher.run_config(
        cfg,
        mode,
        overrides=SET.value,
        policy=POLICY.value,
        agents=AGENTS.value,
        max_turns=MAX_TURNS.value,
        trace=TRACE.value,
        trace_format=TRACE_FORMAT.value,
        **workload,
    )


def build_config(mode: str, **workload: object) -> ExperimentConfig:
    """The --config file with --set and the convenience flags applied."""
    return apply_flags(load_config(CONFIG.value), mode, **workload)


def prepare_workdir(cfg: ExperimentConfig) -> pathlib.Path:
    if not WORKDIR.value:
        raise flags.ValidationError("--workdir is required")
    return launcher.prepare_workdir(cfg, WORKDIR.value)
