"""Coding-agent sessions (Weka JSON) replayed on a 1P2D tiny-Qwen2 cluster under Basic, DualPath
and Oracle: the tokens are the same under every policy, and every round's `cached_tokens` is the
hit its hash ids imply (`workload.sharing.replay_hits`: a first round, a subagent's included,
hits the prefix it shares with the sessions replayed before it; a later round hits its own
context's full blocks), the trajectories running one after another. A small session built here
(fast tier) and, when they are beside the repository, the 28 public Claude Code sessions scaled
down with `length_scale` (full tier). Think times are left out: the gaps are not what is
checked here."""

from __future__ import annotations

import json
import pathlib

import pytest

from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    StoreConfig,
    WorkloadConfig,
)
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import run_trajectories
from dualpath_jax.workload.arrivals import build_trajectories, check_context
from dualpath_jax.workload.sharing import replay_hits

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL = ROOT.parent / "shared" / "real_traces" / "weka_claude_code_sessions"
BLOCK_TOKENS = 16
POLICIES = ("basic", "dualpath", "oracle")


def req(t, n_in, n_out, ids, think=0.0, stop="tool_use"):
    return {"t": t, "type": "n", "in": n_in, "out": n_out, "hash_ids": ids,
            "think_time": think, "stop": stop}  # fmt: skip


# 16-token blocks: a parent of four requests, a subagent that starts from the parent's first
# two blocks, and a second session that shares the first block (a common system prompt) in
# the same global hash-id scope.
SESSIONS = [
    {
        "id": "s1",
        "block_size": 16,
        "hash_id_scope": "global",
        "requests": [
            req(0.0, 70, 5, [1, 2, 3, 4]),
            req(8.0, 96, 6, [1, 2, 3, 4, 5], think=3.0),
            {
                "t": 9.0,
                "type": "subagent",
                "agent_id": "agent_001",
                "requests": [req(0.0, 50, 4, [1, 2, 20]), req(3.0, 75, 3, [1, 2, 20, 21], 1.0)],
            },
            req(20.0, 130, 4, [1, 2, 3, 4, 5, 6, 7], think=10.0),
            req(30.0, 150, 3, [1, 2, 3, 4, 5, 6, 7, 8], think=5.0, stop="end_turn"),
        ],
    },
    {
        "id": "s2",
        "block_size": 16,
        "hash_id_scope": "global",
        "requests": [req(0.0, 40, 4, [1, 30]), req(4.0, 60, 5, [1, 30, 31], think=2.0)],
    },
]


def config(trace: pathlib.Path, policy: str, **workload) -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=TINY_CPU_PREFILL_COST.to_json(),
            prefill_nodes=1,
            decode_nodes=2,
            decode_max_len=8192,
        ),
        store=StoreConfig(block_tokens=BLOCK_TOKENS),
        scheduler=SchedulerConfig(policy=Policy(policy)),
        workload=WorkloadConfig(trace=str(trace), trace_format="weka", agents=None, **workload),
    )


def replay(tmp_path, start_cluster, trace: pathlib.Path, **workload):
    """Each policy's tokens and cached tokens, the trajectories one after another on a fresh
    cluster, and the hits the hash ids imply."""
    tokens, cached = {}, {}
    for policy in POLICIES:
        cfg = config(trace, policy, **workload)
        trajs, _ = build_trajectories(cfg)
        check_context(cfg, trajs)
        rounds = [(t.id, [(list(r.append), r.gen) for r in t.rounds]) for t in trajs]
        with start_cluster(cfg, tmp_path / policy, "thread") as cluster:
            outs = run_trajectories(
                cluster.client(), rounds, max_concurrent=1, progress=False, timeout_s=900
            )
        assert [o.error for o in outs if o.error] == []
        tokens[policy] = [o.rounds for o in outs]
        cached[policy] = [[r.cached_tokens for r in o.results] for o in outs]
    return trajs, tokens, cached, replay_hits(trajs, BLOCK_TOKENS)


def test_weka_sessions_replay_with_the_same_tokens_and_the_hits_their_hash_ids_imply(
    tmp_path, start_cluster
):
    d = tmp_path / "sessions"
    d.mkdir()
    for s in SESSIONS:
        (d / f"{s['id']}.json").write_text(json.dumps(s))
    trajs, tokens, cached, expected = replay(tmp_path, start_cluster, d)
    assert [t.id for t in trajs] == ["s1", "s2", "s1:agent_001"]  # by start time
    assert tokens["dualpath"] == tokens["basic"] == tokens["oracle"]
    # the subagent's first round hits the parent's two blocks it names, s2's the shared one;
    # later rounds hit their own context's full blocks
    assert expected[2][0] == 2 * BLOCK_TOKENS and expected[1][0] == BLOCK_TOKENS
    assert all(h > 0 for rounds in expected for h in rounds[1:])
    for policy in POLICIES:
        assert cached[policy] == expected, policy


@pytest.mark.slow
@pytest.mark.skipif(not REAL.is_dir(), reason="the public Weka sessions are not beside the repo")
def test_the_public_claude_code_sessions_replay_with_the_same_tokens_and_hits(
    tmp_path, start_cluster
):
    """All 28 sessions with their subagents and rebuilt contexts (54 trajectories), the first
    two requests of each (`max_turns`: the full tier's time; `bench/agentic_traces.py
    --cluster` replays every request), lengths x 1/512 (a 64-token trace block: 1 token)."""
    trajs, tokens, cached, expected = replay(
        tmp_path, start_cluster, REAL, length_scale=1 / 512, max_turns=2
    )
    assert len({t.id.split(":")[0] for t in trajs}) == 28
    assert any(":agent_" in t.id for t in trajs)
    assert tokens["dualpath"] == tokens["basic"] == tokens["oracle"]
    for policy in POLICIES:
        assert cached[policy] == expected, policy
    subagent_hits = [h[0] for t, h in zip(trajs, expected, strict=True) if ":agent_" in t.id]
    assert sum(subagent_hits) > 0  # subagents start from their parents' prefixes


def test_a_turn_that_waits_for_its_subagent_is_submitted_after_it_ends(tmp_path, start_cluster):
    """`Round.after` on the cluster: the parent's second round starts once its subagent's last
    round is done (plus its gap), though the parent was ready long before; the tokens are
    those of the same trajectories run without waiting."""
    from dualpath_jax.workload.arrivals import as_rounds
    from dualpath_jax.workload.trace import Round, Trajectory, materialize

    parent = Trajectory("p", (Round(40, 3), Round(20, 3, gap_s=0.2, after=("p:sub",))))
    child = Trajectory(
        "p:sub", tuple(Round(30 if i == 0 else 16, 6, gap_s=0.3 * bool(i)) for i in range(3))
    )
    trajs = [materialize(t, TINY_QWEN2.vocab_size, seed=5) for t in (parent, child)]
    cfg = config(tmp_path / "unused", "dualpath")
    with start_cluster(cfg, tmp_path / "run", "thread") as cluster:
        client = cluster.client()
        outs = run_trajectories(client, as_rounds(trajs), progress=False, timeout_s=300)
        free = [(t.id + "-free", [(list(r.append), r.gen) for r in t.rounds]) for t in trajs]
        alone = run_trajectories(client, free, progress=False, timeout_s=300)
    assert [o.error for o in outs] == ["", ""]
    child_done = max(r.submit_s + r.jct_s for r in outs[1].results)
    assert outs[0].results[1].submit_s >= child_done + 0.2
    assert [o.rounds for o in outs] == [o.rounds for o in alone]
