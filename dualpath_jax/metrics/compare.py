"""Side-by-side policy comparison on one config: runs, the token check, the table, the figures.

Used by `bench/compare_policies.py` and `make demo`. Every policy replays the same trajectories
on a fresh local cluster; greedy decoding makes their tokens comparable one for one.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence

from dualpath_jax.config import ExperimentConfig, Policy

# The paper's ablation order (Fig. 12 right) and its JCT reductions vs Basic (DS 660B, 64K).
ABLATION = ("basic", "layerwise", "dualpath_rr", "dualpath")
PAPER_ABLATION_PCT = {"layerwise": 17.21, "dualpath_rr": 38.19, "dualpath": 45.62}


def with_policy(cfg: ExperimentConfig, policy: str) -> ExperimentConfig:
    return dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
    )


def read_outputs(path: pathlib.Path) -> dict[str, list[list[int]]]:
    with open(path) as f:
        return {d["id"]: d["rounds"] for d in map(json.loads, f)}


def compare(
    cfg: ExperimentConfig,
    policies: Sequence[str],
    workdir: str | pathlib.Path,
    *,
    run: Callable[[ExperimentConfig, pathlib.Path], dict] | None = None,
    warmup: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Runs every policy into `workdir/<policy>`; returns `{"summaries", "tokens_identical",
    "mismatches"}` and writes it to `workdir/comparison.json`.

    `warmup` first replays the workload once (oracle, unmeasured) so every policy finds the
    compiled shapes in the persistent compilation cache instead of the first one paying for them.
    """
    from dualpath_jax.experiment import run_local

    run = run or (lambda c, wd: run_local(c, wd, progress=progress))
    workdir = pathlib.Path(workdir)
    if warmup:
        log("warm-up run (oracle, not measured): compiling the shapes this workload needs ...")
        run(with_policy(cfg, "oracle"), workdir / "_warmup")
    summaries = {}
    for p in policies:
        log(f"running policy {p} ...")
        summaries[p] = run(with_policy(cfg, p), workdir / p)
        log(f"  {p}: JCT {summaries[p]['jct_s']:.1f} s")
    outputs = {p: read_outputs(workdir / p / "outputs.jsonl") for p in policies}
    ref = outputs[policies[0]]
    mismatches = [
        f"{p}:{tid}" for p in policies[1:] for tid in ref if outputs[p].get(tid) != ref[tid]
    ]
    result = {
        "config": cfg.name,
        "emulated": cfg.hardware.emulated,
        "summaries": summaries,
        "tokens_identical": not mismatches,
        "mismatches": mismatches,
    }
    (workdir / "comparison.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict) -> str:
    """The comparison table: JCT and ratios, bytes per read path, storage-NIC Max/Avg, TTFT
    breakdown (mean seconds)."""
    s = result["summaries"]
    base = s.get("basic", {}).get("jct_s")
    oracle = s.get("oracle", {}).get("jct_s")
    head = (
        f"{'policy':<12}{'JCT s':>8}{'Basic/x':>9}{'x/Oracle':>9}{'PE-path MB':>12}{'DE-path MB':>12}"
        f"{'SNIC max/avg':>13}{'TTFT p50':>9}{'queue':>7}{'read':>7}{'prefill':>8}{'recomp':>7}"
    )
    lines = [head, "-" * len(head)]
    for p, x in s.items():
        b = x["ttft_breakdown_s"]
        lines.append(
            f"{p:<12}{x['jct_s']:8.1f}"
            f"{(base / x['jct_s'] if base else float('nan')):9.2f}"
            f"{(x['jct_s'] / oracle if oracle else float('nan')):9.2f}"
            f"{x['bytes_read_pe_path'] / 1e6:12.1f}{x['bytes_read_de_path'] / 1e6:12.1f}"
            f"{x['snic_max_over_avg']:13.2f}{x['ttft_s']['p50']:9.3f}"
            f"{b['queueing']['mean']:7.3f}{b['kv_read']['mean']:7.3f}{b['prefill']['mean']:8.3f}"
            f"{x['recomputed_blocks']:7d}"
        )
    if base and all(p in s for p in ABLATION):
        steps = ", ".join(
            f"+{p}: {100 * (1 - s[p]['jct_s'] / base):.1f}% (paper {PAPER_ABLATION_PCT[p]}%)"
            for p in ABLATION[1:]
        )
        lines.append(f"ablation, JCT reduction vs basic: {steps}")
    lines.append(
        "tokens identical across policies: "
        + ("yes" if result["tokens_identical"] else f"NO ({len(result['mismatches'])} mismatches)")
    )
    if result.get("emulated"):
        lines.append("links are emulated (token buckets on one CPU host), see configs/")
    return "\n".join(lines)
