"""Trace formats on a 1P1D tiny-Qwen2 cluster: a Mooncake trace (grouped into sessions, and one
request per trajectory) and a conversation file replay one trajectory after another, and every
round's `cached_tokens` is what the shared prefixes imply (`workload.sharing.replay_hits`), the
same as the simulator reports for the same trajectories."""

from __future__ import annotations

import dataclasses
import pathlib

from trace_helpers import CPU_COST

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig, WorkloadConfig
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import run_trajectories
from dualpath_jax.sim import simulate
from dualpath_jax.workload.arrivals import build_trajectories
from dualpath_jax.workload.sharing import replay_hits

# The engines' prefill cost model is pinned: PEs start without calibrating.
PINNED_COST = TINY_CPU_PREFILL_COST.to_json()

DATA = pathlib.Path(__file__).resolve().parents[1] / "workload" / "data"
BLOCK_TOKENS = 16
MOONCAKE = dict(
    trace=str(DATA / "mooncake_sample.jsonl"),
    trace_format="mooncake",
    trace_block_tokens=96,  # x 1/4: 24-token trace blocks over 16-token store blocks
    length_scale=0.25,
)
# Each workload its own seed: its tokens share nothing with the others' in the one store.
WORKLOADS = {
    "mooncake_sessions": WorkloadConfig(**MOONCAKE, agents=3, seed=1),
    "mooncake_requests": WorkloadConfig(**MOONCAKE, trace_sessions=False, agents=5, seed=2),
    "conversation": WorkloadConfig(
        trace=str(DATA / "conversations_sample.json"), trace_format="conversation", agents=3, seed=3
    ),
}


def test_trace_formats_hit_what_their_shared_prefixes_imply(tmp_path, start_cluster):
    base = ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST, prefill_nodes=1, decode_nodes=1, decode_max_len=1024
        ),
        store=StoreConfig(block_tokens=BLOCK_TOKENS),
    )
    cluster_hits, expected, sim_hits = {}, {}, {}
    with start_cluster(base, tmp_path, "thread") as cluster:
        client = cluster.client()
        for name, workload in WORKLOADS.items():
            cfg = dataclasses.replace(base, workload=workload)
            trajs, _ = build_trajectories(cfg)
            # One at a time; the sessions close at the end (the next workload reuses the ids).
            outs = run_trajectories(
                client,
                trajs,
                max_concurrent=1,
                progress=False,
                timeout_s=600,
                release=True,
            )
            assert not [o.error for o in outs if o.error]
            cluster_hits[name] = [[r.cached_tokens for r in o.results] for o in outs]
            expected[name] = replay_hits(trajs, BLOCK_TOKENS)
            # The simulator, one trajectory after another (each ends long before the next).
            run = simulate(
                cfg,
                cost=CPU_COST,
                trajectories=trajs,
                arrivals=[1e4 * k for k in range(len(trajs))],
            )
            by_request = {r.request: r.cached_tokens for r in run.cluster.results}
            sim_hits[name] = [
                [by_request[f"{t.id}/a{k}/r{i}"] for i in range(len(t.rounds))]
                for k, t in enumerate(trajs)
            ]
    assert expected == {
        "mooncake_sessions": [[0, 112, 128], [64], [32]],
        "mooncake_requests": [[0], [64], [96], [32], [112]],
        "conversation": [[0, 112], [96], [0]],
    }
    assert cluster_hits == expected
    assert sim_hits == expected
