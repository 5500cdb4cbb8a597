"""Real coding-agent sessions on the paper's DS 660B 2P4D testbed (simulated): Basic, Basic +
tool-gap prefetch (PE side), DualPath, DualPath + prefetch and Oracle, with the store unlimited
and limited.

Run (about a minute on 2 cores):
  python bench/agentic_traces.py --trace=SESSIONS      # e.g. the 28 Weka sessions, recorded arrivals
  python bench/agentic_traces.py --trace=SESSIONS --aps=0.5 --json=/tmp/agentic.json

`--cluster`: the same sessions scaled down and replayed on the local `cpu_1p2d` cluster (tiny
model, emulated storage links) under the same five runs, every trajectory at once: lengths x
`--length_scale`, the first `--max_turns` requests of each (0: all), think times x `--gap_scale`
(at most `--max_gap_s`), in-process (`--runtime=thread`) or as processes. Columns as above
(measured), the prefetch's blocks from memory, and whether every run gave the same tokens.
  python bench/agentic_traces.py --trace=SESSIONS --cluster --max_turns=6 --json=/tmp/c.json

The sessions (`--trace`, required: a file or directory of the public Weka JSON,
`workload.trace_format="weka"`; not part of the repository); every session and subagent is one
trajectory, replayed as recorded (its think times are the tool-call gaps).
Arrivals: the sessions' own timestamps, or that clock scaled to `--aps` sessions per second.
Every policy replays the same trajectories. The limited store holds `--capacity_fraction` of
the KV bytes of every trajectory's longest context (retention eviction). Each engine's DRAM
buffer is raised to hold the longest request (the preset's 10 GB per engine does not), and the
prefetch budget is `--prefetch_gb` per engine.

Columns: JCT (s, first arrival to last round done), TTFT p50/p99 over every round, TTFT p50 of
the rounds after a tool call (a gap before them), storage-NIC max/avg (`snic_max_over_avg`),
hit rate (cached / prompt tokens), and for prefetch the hit tokens it had in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import tempfile
import time

from absl import app, flags

from dualpath_jax.config import Policy
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.presets import paper_experiment
from dualpath_jax.sim import simulate
from dualpath_jax.workload.arrivals import plan_workload

RUNS = (
    ("basic", Policy.BASIC, False),
    ("basic+prefetch", Policy.BASIC, True),
    ("dualpath", Policy.DUALPATH, False),
    ("dualpath+prefetch", Policy.DUALPATH, True),
    ("oracle", Policy.ORACLE, False),
)


def run_all(
    trace: str,
    *,
    aps: float = 0.0,
    capacity_fraction: float = 0.25,
    prefetch_gb: float = 10.0,
    snic_gbps: float = 400.0,
    runs=RUNS,
    stores=("unlimited", "limited"),
) -> list[dict]:
    """One row per (store, run)."""
    base, _ = paper_experiment("ds660b", 2, 4, snic_bytes_per_s=snic_gbps / 8 * 1e9)
    w = dataclasses.replace(
        base.workload, trace=trace, trace_format="weka", agents=None, mode="online",
        aps=aps, max_turns=0, max_len=0, length_scale=1.0,
    )  # fmt: skip
    base = dataclasses.replace(base, workload=w)
    plan = plan_workload(base)
    kvb = kv_bytes_per_token(base.model, base.hardware.kv_format or None)
    longest = max(t.total_len for t in plan.trajectories)
    hw = dataclasses.replace(
        base.hardware,
        dram_buffer_bytes=max(base.hardware.dram_buffer_bytes, math.ceil(1.05 * longest * kvb)),
    )
    working_set = sum(t.total_len for t in plan.trajectories) * kvb
    gap_after = {
        (t.id, i): r.gap_s > 0 for t in plan.trajectories for i, r in enumerate(t.rounds) if i
    }
    rows = []
    for store in stores:
        cap = int(capacity_fraction * working_set) if store == "limited" else -1
        for name, policy, prefetch in runs:
            cfg = dataclasses.replace(
                base,
                hardware=hw,
                scheduler=dataclasses.replace(
                    base.scheduler,
                    policy=policy,
                    prefetch=prefetch,
                    prefetch_bytes_per_engine=prefetch_gb * 1e9,
                ),
                store=dataclasses.replace(base.store, capacity_bytes=max(cap, 0)),
            )
            run = simulate(
                cfg, trajectories=plan.trajectories, arrivals=plan.arrivals, pause_gc=True
            )
            s = run.summary
            after = [r.ttft_s for r in run.cluster.results if gap_after.get(_round_key(r.request))]
            rows.append(
                {
                    "store": store,
                    "capacity_gb": cap / 1e9 if cap > 0 else None,
                    "run": name,
                    "rounds": s["requests"],
                    "jct_s": run.jct_s,
                    "ttft_p50_s": s["ttft_s"]["p50"],
                    "ttft_p99_s": s["ttft_s"]["p99"],
                    "ttft_after_tool_p50_s": statistics.median(after) if after else math.nan,
                    "snic_max_over_avg": s["snic_max_over_avg"],
                    "hit_rate": s["cached_tokens"] / max(1, s["prompt_tokens"]),
                    "prefetch_hit_tokens": run.cluster.counters.get("prefetch_hit_tokens", 0),
                    "sessions": len(plan.trajectories),
                    "arrivals": plan.record["arrivals"],
                }
            )
    return rows


def run_cluster(
    trace: str,
    workdir: str,
    *,
    length_scale: float = 1 / 512,
    max_turns: int = 6,
    gap_scale: float = 0.05,
    max_gap_s: float = 3.0,
    runtime: str = "thread",
    runs=RUNS,
) -> tuple[list[dict], bool]:
    """The sessions on the local `cpu_1p2d` cluster under each run: one row per run, and
    whether every run generated the same tokens."""
    from dualpath_jax import load_config
    from dualpath_jax.rollout import run_trajectories
    from dualpath_jax.runtimes.inprocess import InProcessCluster
    from dualpath_jax.runtimes.local import LocalCluster
    from dualpath_jax.workload.arrivals import build_workload, check_context

    base = load_config(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "cpu_1p2d.py"))
    w = dataclasses.replace(
        base.workload, trace=trace, trace_format="weka", agents=None, mode="offline",
        length_scale=length_scale, max_turns=max_turns, max_len=0,
    )  # fmt: skip
    base = dataclasses.replace(
        base, workload=w, cluster=dataclasses.replace(base.cluster, decode_max_len=8192)
    )
    plan = build_workload(base)  # materialized: token ids
    trajs = [
        dataclasses.replace(
            t,
            rounds=tuple(
                dataclasses.replace(r, gap_s=min(max_gap_s, r.gap_s * gap_scale)) for r in t.rounds
            ),
        )
        for t in plan.trajectories
    ]
    check_context(base, trajs)
    cls = InProcessCluster if runtime == "thread" else LocalCluster
    rows, tokens = [], []
    for name, policy, prefetch in runs:
        cfg = dataclasses.replace(
            base,
            scheduler=dataclasses.replace(base.scheduler, policy=policy, prefetch=prefetch),
        )
        with cls(cfg, pathlib.Path(workdir) / name) as cluster:
            client = cluster.client()
            t0 = time.monotonic()
            outs = run_trajectories(client, trajs, progress=False, tool_calls=prefetch)
            jct = time.monotonic() - t0
            counters = client.stats()["counters"]
        tokens.append([o.rounds for o in outs])
        results = [r for o in outs for r in o.results]
        ttft = sorted(r.ttft_s for r in results)
        after = [  # the rounds after a tool call (outputs come in the input's order)
            r.ttft_s
            for t, o in zip(trajs, outs, strict=True)
            for i, r in enumerate(o.results)
            if i and t.rounds[i].gap_s > 0
        ]
        rows.append(
            {
                "store": "unlimited",
                "run": name,
                "rounds": len(results),
                "errors": sum(1 for o in outs if o.error),
                "jct_s": jct,
                "ttft_p50_s": statistics.median(ttft),
                "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                "ttft_after_tool_p50_s": statistics.median(after) if after else math.nan,
                "snic_max_over_avg": math.nan,
                "hit_rate": sum(r.cached_tokens for r in results)
                / max(1, sum(r.prompt_tokens for r in results)),
                "prefetch_blocks_used": counters.get("prefetch_used_blocks", 0),
                "sessions": len(trajs),
                "arrivals": "all at once",
            }
        )
    return rows, all(t == tokens[0] for t in tokens)


def _round_key(request: str) -> tuple[str, int]:
    """`(trajectory id, round)` of a simulated request id `"<id>/a<agent>/r<round>"`."""
    head, _, r = request.rpartition("/r")
    return head.rpartition("/a")[0], int(r)


def format_table(rows: list[dict]) -> str:
    head = (
        "| store | run | JCT (s) | TTFT p50 (s) | TTFT p99 (s) | TTFT p50 after a tool call (s) "
        "| storage NIC max/avg | hit rate |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['store']} | {r['run']} | {r['jct_s']:.1f} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p99_s']:.2f} | {r['ttft_after_tool_p50_s']:.3f} | "
            f"{r['snic_max_over_avg']:.2f} | {r['hit_rate']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    if not pathlib.Path(f.trace).exists():
        raise SystemExit(f"no sessions at {f.trace} (--trace)")
    if f.cluster:
        with tempfile.TemporaryDirectory() as workdir:
            rows, same = run_cluster(
                f.trace,
                workdir,
                length_scale=f.length_scale,
                max_turns=f.max_turns,
                gap_scale=f.gap_scale,
                max_gap_s=f.max_gap_s,
                runtime=f.runtime,
            )
        print(f"{rows[0]['sessions']} trajectories on cpu_1p2d ({f.runtime}), {rows[0]['rounds']}"
              f" rounds each; tokens identical across runs: {same}")  # fmt: skip
        print(format_table(rows))
        print("prefetched blocks used:", {r["run"]: r["prefetch_blocks_used"] for r in rows})
        if f.json:
            pathlib.Path(f.json).write_text(json.dumps({"rows": rows, "same_tokens": same}))
        return
    rows = run_all(
        f.trace,
        aps=f.aps,
        capacity_fraction=f.capacity_fraction,
        prefetch_gb=f.prefetch_gb,
        snic_gbps=f.snic_gbps,
    )
    print(f"{rows[0]['sessions']} trajectories, arrivals: {rows[0]['arrivals']}")
    print(format_table(rows))
    if f.json:
        pathlib.Path(f.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    flags.DEFINE_string("trace", None, "A Weka session file or directory.", required=True)
    flags.DEFINE_float("aps", 0.0, "Sessions per second (0: the recorded timestamps).")
    flags.DEFINE_float(
        "capacity_fraction", 0.25, "Limited store: this fraction of every longest context's KV."
    )
    flags.DEFINE_float("prefetch_gb", 10.0, "Prefetch DRAM per engine (GB).")
    flags.DEFINE_float("snic_gbps", 400.0, "Storage NIC per node (Gbps).")
    flags.DEFINE_string("json", "", "Also write the rows here.")
    flags.DEFINE_bool("cluster", False, "Replay on the local cpu_1p2d cluster instead.")
    flags.DEFINE_float("length_scale", 1 / 512, "--cluster: lengths x this.")
    flags.DEFINE_integer("max_turns", 6, "--cluster: each trajectory's first requests (0: all).")
    flags.DEFINE_float("gap_scale", 0.05, "--cluster: think times x this.")
    flags.DEFINE_float("max_gap_s", 3.0, "--cluster: longest gap (s).")
    flags.DEFINE_enum("runtime", "thread", ["thread", "process"], "--cluster: how it runs.")
    app.run(main)
