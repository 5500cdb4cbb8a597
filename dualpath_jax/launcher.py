"""The run launchers' shared flags (`launch/rollout.py`, `serve.py`, `simulate.py`) and the
config they build. Importing this module defines the absl flags `--config`, `--set`,
`--workdir`, `--policy`, `--agents`, `--max_turns` and `--trace`: only launchers import it."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import platform

from absl import flags

from dualpath_jax.config import ExperimentConfig, Policy, apply_overrides, to_json, validate
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
TRACE = flags.DEFINE_string("trace", None, "Trace JSONL (overrides the synthetic preset).")


def build_config(mode: str, **workload: object) -> ExperimentConfig:
    """Config file + --set overrides + the convenience flags, with workload.mode = mode;
    validated, so a bad value fails here with its key named."""
    return apply_flags(load_config(CONFIG.value), mode, **workload)


def apply_flags(cfg: ExperimentConfig, mode: str, **workload: object) -> ExperimentConfig:
    """`cfg` with the --set overrides and the convenience flags applied (workload.mode = mode)."""
    cfg = apply_overrides(cfg, SET.value)
    w = dict(mode=mode, **{k: v for k, v in workload.items() if v is not None})
    if AGENTS.value is not None:
        w["agents"] = AGENTS.value
    if MAX_TURNS.value is not None:
        w["max_turns"] = MAX_TURNS.value
    if TRACE.value:
        w["trace"] = TRACE.value
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **w))
    if POLICY.value:
        cfg = dataclasses.replace(
            cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(POLICY.value))
        )
    return validate(cfg)


def prepare_workdir(cfg: ExperimentConfig) -> pathlib.Path:
    if not WORKDIR.value:
        raise flags.ValidationError("--workdir is required")
    wd = pathlib.Path(WORKDIR.value)
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "config.json").write_text(to_json(cfg, indent=1))
    logging.info(
        "python %s on %s; config %s -> %s", platform.python_version(), platform.node(), cfg.name, wd
    )
    return wd


def print_summary(summary: dict) -> None:
    keys = [
        "policy",
        "mode",
        "emulated",
        "agents",
        "requests",
        "jct_s",
        "tokens_generated",
        "bytes_read_pe_path",
        "bytes_read_de_path",
        "snic_max_over_avg",
        "recomputed_blocks",
        "slo_attainment",
        "errors",
    ]
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=1))
    t, p = summary["ttft_s"], summary["tpot_s"]
    print(f"TTFT p50/p90: {t['p50']:.3f}/{t['p90']:.3f} s  TPOT mean {p['mean']:.4f} s")
