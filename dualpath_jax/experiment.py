"""One experiment on a local cluster: trajectories in, `outputs.jsonl` + `summary.json` out.

    summary = run_local(cfg, workdir)
    result = compare(cfg, [Policy.BASIC, Policy.DUALPATH], workdir)   # side by side

Offline mode starts `workload.agents` agents together (JCT = time until all finish); online mode
starts them at Poisson arrival times (`workload.aps`). Writes to `workdir`: `config.json`,
`events.jsonl` (router), `logs/`, `links/` (per-engine link reports), `outputs.jsonl` and
`summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Sequence

from dualpath_jax.config import ExperimentConfig, Policy
from dualpath_jax.metrics.events import read_events
from dualpath_jax.metrics.summary import read_link_reports, summarize
from dualpath_jax.workload.arrivals import (
    build_trajectories,  # noqa: F401 (re-exported: bench/overload.py)
    build_workload,
    check_context,
)
from dualpath_jax.workload.trace import Trajectory


def check_fits(cfg: ExperimentConfig, trajs: list[Trajectory]) -> None:
    """Raises `ConfigError` naming the longest request when it needs more context than the
    cluster holds (`workload.arrivals.check_context`)."""
    check_context(cfg, trajs)


def local_cluster(cfg: ExperimentConfig, workdir: str | pathlib.Path):
    """The cluster `run_local` runs on, as `cluster.runtime` says (not started): "process", a
    `LocalCluster`; "thread", an `InProcessCluster`; "ray", a `RayCluster` on the Ray this
    process is connected to, else on a local Ray it starts (and stops) for itself."""
    runtime = cfg.cluster.runtime
    if runtime == "thread":
        from dualpath_jax.runtimes.inprocess import InProcessCluster

        return InProcessCluster(cfg, workdir)
    if runtime == "ray":  # the only branch that may import Ray (when the cluster starts)
        from dualpath_jax.runtimes.ray_cluster import RayCluster

        return RayCluster(cfg, workdir, address="local")
    from dualpath_jax.runtimes.local import LocalCluster

    return LocalCluster(cfg, workdir)


def run_local(cfg: ExperimentConfig, workdir: str | pathlib.Path, *, progress: bool = True) -> dict:
    """Runs the configured workload on a cluster of this host and returns the summary (also
    written): the cluster is `local_cluster(cfg, workdir)`."""
    from dualpath_jax.rollout import run_trajectories

    workdir = pathlib.Path(workdir)
    plan = build_workload(cfg)
    trajs, arrivals = plan.trajectories, plan.arrivals
    check_context(cfg, trajs)
    with local_cluster(cfg, workdir) as cluster:
        client = cluster.client()
        t0 = time.monotonic()
        outs = run_trajectories(
            client,
            trajs,
            arrivals=arrivals if cfg.workload.mode == "online" else None,
            progress=progress,
            tool_calls=cfg.scheduler.prefetch,
        )
        jct = time.monotonic() - t0
        counters = client.stats().get("counters", {})
    with open(workdir / "outputs.jsonl", "w") as f:
        for o in outs:
            f.write(
                json.dumps(
                    {"id": o.id, "rounds": o.rounds, **({"error": o.error} if o.error else {})}
                )
                + "\n"
            )
    results = [r for o in outs for r in o.results]
    summary = summarize(
        policy=cfg.scheduler.policy.value,
        mode=cfg.workload.mode,
        emulated=_emulated(cfg),
        agents=len(trajs),
        results=results,
        errors=sum(1 for o in outs if o.error),
        jct_s=jct,
        reports=read_link_reports(workdir),
        events=read_events(workdir / "events.jsonl"),
        counters=counters,
        ttft_slo_s=cfg.workload.ttft_slo_s,
        tpot_slo_s=cfg.workload.tpot_slo_s,
    )
    summary["config"] = cfg.name
    summary["workload"] = plan.record
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def with_policy(cfg: ExperimentConfig, policy: Policy | str) -> ExperimentConfig:
    """`cfg` under another policy (a `Policy`, or its name as a flag gives it)."""
    return dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, policy=Policy(policy))
    )


def _emulated(cfg: ExperimentConfig) -> bool:
    """Whether `cfg`'s engines pace any link (`transfer.links.emulated_links`; imported here, not
    at the top: it is a module of the compiled core, which a program opts in to first)."""
    from dualpath_jax.transfer.links import emulated_links

    return bool(emulated_links(cfg.hardware))


def read_outputs(path: pathlib.Path) -> dict[str, list[list[int]]]:
    with open(path) as f:
        return {d["id"]: d["rounds"] for d in map(json.loads, f)}


def compare(
    cfg: ExperimentConfig,
    policies: Sequence[Policy | str],
    workdir: str | pathlib.Path,
    *,
    run: Callable[[ExperimentConfig, pathlib.Path], dict] | None = None,
    warmup: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Side-by-side policy comparison on one config: every policy replays the same trajectories
    on a fresh local cluster (greedy decoding makes their tokens comparable one for one), into
    `workdir/<policy>`; returns `{"summaries", "tokens_identical",
    "mismatches"}` and writes it to `workdir/comparison.json`.

    `warmup` first replays the workload once (oracle, unmeasured) so every policy finds the
    compiled shapes in the persistent compilation cache instead of the first one paying for them.
    """
    run = run or (lambda c, wd: run_local(c, wd, progress=progress))
    policies = [Policy(p) for p in policies]
    workdir = pathlib.Path(workdir)
    if warmup:
        log("warm-up run (oracle, not measured): compiling the shapes this workload needs ...")
        run(with_policy(cfg, Policy.ORACLE), workdir / "_warmup")
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
        "emulated": _emulated(cfg),
        "summaries": summaries,
        "tokens_identical": not mismatches,
        "mismatches": mismatches,
    }
    (workdir / "comparison.json").write_text(json.dumps(result, indent=1))
    return result
