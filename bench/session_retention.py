"""Session retention against plain LRU in a capacity-limited KV store (`store.eviction`).

Run:
  python bench/session_retention.py                 # the simulator, the paper's DS 660B 2P4D
  python bench/session_retention.py --capacities=10e9,20e9 --set workload.tool_gap_s=120

Agents arrive online, and between rounds each spends a tool call (`workload.tool_gap_s` on
average, log-normal). The store holds `--capacities` bytes (each a row pair). With "lru" a block
goes when it is the least recently used; with "retention" the blocks of a session whose round
runs, or whose last round ended less than `store.retention_ttl_s` ago, go only once nothing
else is left, so the blocks of ended trajectories and of tool calls outlasting the TTL go first.
For each capacity it prints the hit rate (hit tokens over the hits an unlimited store would
have had), the hit tokens lost to eviction, the blocks evicted, and the round latency (submit to
last token) and TTFT. Both policies replay the same agents, arrivals and gaps. The simulator runs
the store's own block index (`kvstore.index.BlockIndex`) on its clock (`sim.kvcache`).
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags

from dualpath_jax.config import apply_overrides
from dualpath_jax.configs_loader import load_config

_CONFIG = flags.DEFINE_string("config", "configs/paper.py:ds660b_2p4d", "Experiment file.")
_SET = flags.DEFINE_multi_string("set", [], "Override `section.key=value` (repeatable).")
_CAPACITIES = flags.DEFINE_list(
    "capacities", ["8e9", "16e9", "32e9"], "Store capacities in bytes, one row pair each."
)
_WORKDIR = flags.DEFINE_string("workdir", "bench_out/session_retention", "Output directory.")

# Short agentic sessions with minute-long tool calls, arriving at about what the cluster serves.
SCENARIO = (
    "workload.preset=32k",
    "workload.mode=online",
    "workload.aps=0.08",
    "workload.duration_s=3000",
    "workload.agents=240",
    "workload.trajectories=240",
    "workload.max_turns=8",
    "workload.tool_gap_s=60",
    "store.retention_ttl_s=300",
)
POLICIES = ("lru", "retention")


def _row(summary: dict) -> dict:
    r = summary.get("router", {})
    hit, lost = r.get("store_hit_tokens", 0), r.get("store_lost_tokens", 0)
    return {
        "hit_rate": hit / (hit + lost) if hit + lost else float("nan"),
        "hit_tokens": hit,
        "lost_tokens": lost,
        "evicted_blocks": r.get("store_evictions", 0),
        "round_jct_mean_s": summary["round_jct_s"]["mean"],
        "round_jct_p99_s": summary["round_jct_s"]["p99"],
        "ttft_mean_s": summary["ttft_s"]["mean"],
        "jct_s": summary["jct_s"],
        "errors": summary.get("errors", 0),
    }


def main(argv):
    del argv
    from dualpath_jax import sim

    base = apply_overrides(load_config(_CONFIG.value), [*SCENARIO, *_SET.value])
    wd = pathlib.Path(_WORKDIR.value)
    wd.mkdir(parents=True, exist_ok=True)
    rows = []
    for cap in _CAPACITIES.value:
        for policy in POLICIES:
            cfg = apply_overrides(
                base, [f"store.capacity_bytes={int(float(cap))}", f"store.eviction={policy}"]
            )
            row = {"capacity_bytes": cfg.store.capacity_bytes, "policy": policy}
            row.update(_row(sim.simulate(cfg).summary))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"config": _CONFIG.value, "scenario": [*SCENARIO, *_SET.value], "rows": rows}
    (wd / "session_retention.json").write_text(json.dumps(out, indent=1))
    w = base.workload
    print(
        f"\n{_CONFIG.value}: {w.agents} agents online at {w.aps}/s, <= {w.max_turns} rounds,"
        f" tool calls {w.tool_gap_s:g} s mean, TTL {base.store.retention_ttl_s:g} s"
    )
    head = (
        f"{'capacity':>9} {'policy':>9} {'hit rate':>8} {'lost tok':>11} {'evicted':>8}"
        f" {'round s':>8} {'p99 s':>7} {'TTFT s':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['capacity_bytes'] / 1e9:>7.0f}GB {r['policy']:>9} {r['hit_rate']:>8.3f}"
            f" {r['lost_tokens']:>11} {r['evicted_blocks']:>8} {r['round_jct_mean_s']:>8.2f}"
            f" {r['round_jct_p99_s']:>7.2f} {r['ttft_mean_s']:>7.3f}"
        )
    for cap in sorted({r["capacity_bytes"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["capacity_bytes"] == cap}
        lru, ret = by["lru"], by["retention"]
        print(
            f"{cap / 1e9:.0f} GB: hit rate {ret['hit_rate']:.3f} vs {lru['hit_rate']:.3f};"
            f" round latency {ret['round_jct_mean_s']:.2f} s vs {lru['round_jct_mean_s']:.2f} s"
            f" ({lru['round_jct_mean_s'] / ret['round_jct_mean_s']:.2f}x)"
        )


if __name__ == "__main__":
    app.run(main)
