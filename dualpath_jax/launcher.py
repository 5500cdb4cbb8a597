"""What the run launchers (`launch/rollout.py`, `serve.py`, `simulate.py`) share, as plain
functions: the run's config from an experiment config plus the launchers' options, its work
directory, the summary they print. No flags here: `launch/_flags.py` defines them and calls these."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import platform
from collections.abc import Sequence

from dualpath_jax.config import ExperimentConfig, Policy, apply_overrides, to_json, validate


def run_config(
    cfg: ExperimentConfig,
    mode: str,
    *,
    overrides: Sequence[str] = (),
    policy: str | None = None,
    agents: int | None = None,
    max_turns: int | None = None,
    trace: str | None = None,
    **workload: object,
) -> ExperimentConfig:
    """`cfg` with the `section.key=value` overrides, then the convenience options (each None:
    unchanged) and `workload.mode = mode`; validated, so a bad value fails here with its key
    named. `workload`: more `WorkloadConfig` fields (None values are skipped)."""
    cfg = apply_overrides(cfg, overrides)
    w = dict(mode=mode, **{k: v for k, v in workload.items() if v is not None})
    if agents is not None:
        w["agents"] = agents
    if max_turns is not None:
        w["max_turns"] = max_turns
    if trace:
        w["trace"] = trace
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **w))
    if policy:
        cfg = dataclasses.replace(
            cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
        )
    return validate(cfg)


def prepare_workdir(cfg: ExperimentConfig, workdir: str | pathlib.Path) -> pathlib.Path:
    """Creates `workdir` and writes the run's whole config to `workdir/config.json`."""
    wd = pathlib.Path(workdir)
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
