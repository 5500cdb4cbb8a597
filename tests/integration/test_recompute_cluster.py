"""Load or recompute end to end: a tiny-Qwen2 cluster whose PEs recompute the leading blocks of
every hit (`scheduler.recompute=always` capped by `recompute_max_blocks`) and read the rest. The
PE computes the lead as a forward of its own, then the new tokens after the whole hit with the
lead's rows and the loaded blocks joined; the tokens equal the reference model's on every read
path, chunked or not, layerwise or Basic."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    StoreConfig,
)
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import Session

pytestmark = pytest.mark.multiprocess

BLOCK_TOKENS = 16
VOCAB = TINY_QWEN2.vocab_size


def _trajectories(n: int, rounds: int, seed: int):
    """First rounds of 3-4 blocks, later appends of 1-2: every later round hits >= 3 blocks."""
    rs = np.random.RandomState(seed)
    out = []
    for k in range(n):
        rr = []
        for i in range(rounds):
            append = int(rs.randint(56, 70) if i == 0 else rs.randint(BLOCK_TOKENS, 32))
            rr.append((rs.randint(0, VOCAB, append).tolist(), int(rs.randint(3, 7))))
        out.append((f"lead{k}", rr))
    return out


TRAJS = _trajectories(n=4, rounds=3, seed=11)


@pytest.mark.parametrize(
    ("policy", "cap", "cluster"),
    [
        ("dualpath", 1, {}),  # both read sides
        ("split", 2, {"prefill_max_tokens": 16}),  # chunked lead and tail, split reads
        ("basic", 1, {}),  # one program over the joined KV
    ],
)
def test_a_recomputed_lead_gives_the_reference_tokens(
    policy, cap, cluster, tmp_path, start_cluster, reference_tokens
):
    expected = [reference_tokens(t) for t in TRAJS]
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(decode_max_len=1024, **cluster),
        store=StoreConfig(block_tokens=BLOCK_TOKENS),
        scheduler=SchedulerConfig(
            policy=Policy(policy), recompute="always", recompute_max_blocks=cap
        ),
    )
    with start_cluster(cfg, tmp_path) as c:
        client = c.client()
        sessions = [Session(client, tid) for tid, _ in TRAJS]
        results = [[] for _ in TRAJS]
        for i in range(len(TRAJS[0][1])):  # round i of every trajectory at once
            futs = [s.step_async(*TRAJS[k][1][i]) for k, s in enumerate(sessions)]
            for k, f in enumerate(futs):
                results[k].append(f.result(180.0))
        for s in sessions:
            s.close()
        stats = client.stats()["counters"]

    assert [[list(r.tokens) for r in rr] for rr in results] == expected
    later = [r for rr in results for r in rr[1:]]
    # every later round recomputed `cap` leading blocks and loaded the rest of its hit
    assert all(r.recomputed_blocks == cap for r in later), [r.recomputed_blocks for r in later]
    assert all(r.cached_tokens >= BLOCK_TOKENS for r in later), [r.cached_tokens for r in later]
    assert stats["recompute_lead_hits"] == len(later), stats
    assert stats["recompute_hit_blocks"] == cap * len(later)
    assert stats["recomputed_blocks"] == 0  # nothing unreadable
    assert stats["errors"] == stats["requeued"] == 0, stats
    paths = collections.Counter(r.read_path for r in later)
    assert "none" not in paths, paths
    if policy == "split":
        assert paths["split"] > 0, paths
