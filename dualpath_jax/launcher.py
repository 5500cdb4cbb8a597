"""What the run launchers (`launch/rollout.py`, `serve.py`, `simulate.py`) share, as plain
functions: the run's config from an experiment config plus the launchers' options, its work
directory, the summary they print. No flags here: `launch/_flags.py` defines them and calls these."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import platform
from collections.abc import Iterable, Sequence

from dualpath_jax.config import (
    SOURCE_KNOBS,
    ExperimentConfig,
    Policy,
    WorkloadConfig,
    apply_overrides,
    to_json,
    validate,
)


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
    named. `workload`: more `WorkloadConfig` fields (None values are skipped).

    A run that switches the workload to a trace (`trace`, or an override of `workload.trace`,
    naming another source than the config file's) replays it as recorded: the config file's
    `SOURCE_KNOBS` (agents, length_scale, max_len, max_turns: its synthetic workload's) are reset
    to their as-recorded values unless this run sets them too (`recorded_workload`)."""
    base = cfg.workload
    cfg = apply_overrides(cfg, overrides)
    w = dict(mode=mode, **{k: v for k, v in workload.items() if v is not None})
    if agents is not None:
        w["agents"] = agents
    if max_turns is not None:
        w["max_turns"] = max_turns
    if trace:
        w["trace"] = trace
    run_keys = set(w) | {
        key.split("=", 1)[0].strip().removeprefix("workload.")
        for key in overrides
        if key.split("=", 1)[0].strip().startswith("workload.")
    }
    new = dataclasses.replace(cfg.workload, **w)
    if new.trace and new.trace != base.trace:
        new = recorded_workload(new, keep=run_keys)
    cfg = dataclasses.replace(cfg, workload=new)
    if policy:
        cfg = dataclasses.replace(
            cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
        )
    return validate(cfg)


def recorded_workload(w: WorkloadConfig, keep: Iterable[str] = ()) -> WorkloadConfig:
    """`w` with every `SOURCE_KNOBS` field not named in `keep` at its as-recorded value: no
    agent expansion (one agent per trajectory), no length scale, no `max_len` cut, every round."""
    keep = set(keep)
    return dataclasses.replace(w, **{k: v for k, v in SOURCE_KNOBS.items() if k not in keep})


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
