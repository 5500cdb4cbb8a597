"""`cluster.warmup`: engines compile every shape bucket before they register, so the serving
path compiles nothing.

A cluster warmed up at start runs a mixed trace (batches of one to four requests, prompts cut
into chunks, hits read on the PE side, the DE side and split between them, greedy and sampled
rounds, the layerwise and the Basic prefill) with `jax.monitoring` counting every backend
compile and persistent-cache load in the process (the in-process runtime: the engines are
threads of the test): none happen, and the greedy tokens are the reference model's.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest
from test_cluster import RESULT_TIMEOUT_S, cluster_config, make_trajectories, tokens_of

from dualpath_jax.engines.warmup import CompileCounter, prefill_shapes
from dualpath_jax.model.batch import bucket_len, packed_length
from dualpath_jax.model.runner import batch_bucket
from dualpath_jax.rollout import Session, round_sampling

# Small buckets keep the warm-up short: contexts of up to 256 tokens, forwards of up to 64 new
# tokens (longer prompts are cut into chunks) and 4 requests.
WARM = {
    "warmup": True,
    "decode_max_len": 256,
    "prefill_max_tokens": 64,
    "prefill_max_batch": 4,
    "decode_slots": 4,
}


def warm_config(policy: str):
    cfg = cluster_config(policy)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, **WARM))


MIXED = make_trajectories("warm", n=4, rounds=3, seed=5, gen=(2, 9), first=(40, 100))


def _run_mixed(client, trajs, keys):
    """Round i of every trajectory at once, then round i + 1; the last trajectory samples with
    `keys[i]` (made beforehand: making a key compiles in the client's process)."""
    sessions = [Session(client, tid) for tid, _ in trajs]
    results: list[list] = [[] for _ in trajs]
    for i in range(max(len(r) for _, r in trajs)):
        futs = []
        for k, s in enumerate(sessions):
            append, gen = trajs[k][1][i]
            if k == len(trajs) - 1:
                fut = s.step_async(append, gen, temperature=0.8, key=keys[i])
            else:
                fut = s.step_async(append, gen)
            futs.append((k, fut))
        for k, f in futs:
            results[k].append(f.result(RESULT_TIMEOUT_S))
    for s in sessions:
        s.close()
    return results


def test_prefill_shapes_reach_every_bucket():
    cfg = warm_config("dualpath")
    shapes = prefill_shapes(cfg)
    assert {b for b, *_ in shapes} == {1, 2, 4}
    assert all(cached + n <= 256 for _, n, cached, _ in shapes)
    # every new-token bucket up to the forward's bound, cached tables of 0 to 16 pages
    assert {n for _, n, _, _ in shapes} == {1, 17, 33}
    assert {cached for _, _, cached, _ in shapes} == {0, 1, 17, 33, 65, 129}
    assert [batch_bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    # every packed length a batch of up to 64 + 3 new tokens can have, and the padded layout
    layouts = {
        (b, bucket_len(n), packed_length(n + (b - 1) * fill, b, bucket_len(n)))
        for b, n, _, fill in shapes
    }
    assert layouts == {
        (1, 16, 0), (1, 32, 0), (1, 64, 0),
        (2, 16, 16), (2, 16, 0), (2, 32, 32), (2, 32, 0), (2, 64, 64), (2, 64, 0),
        (4, 16, 16), (4, 16, 32), (4, 16, 0), (4, 32, 32), (4, 32, 64), (4, 32, 0),
        (4, 64, 64), (4, 64, 128),  # (never padded: 67 tokens at most)
    }  # fmt: skip
    # a runner that does not pack (a `data` mesh) warms the padded layout alone
    assert {fill for *_, fill in prefill_shapes(cfg, pack=False)} == {1}


@pytest.mark.parametrize("policy", ["split", "basic"])
def test_the_serving_path_compiles_nothing_after_warmup(
    policy, tmp_path, start_cluster, reference_tokens
):
    trajs = MIXED if policy == "split" else MIXED[:3]
    expected = [reference_tokens(t) for t in trajs[:-1]]  # before counting: it compiles too
    with start_cluster(warm_config(policy), tmp_path, "thread") as cluster:
        keys = [jax.random.key(i) for i in range(3)]
        round_sampling(0.8, 1.0, keys[0])  # the client's own key conversion, compiled here
        counter = CompileCounter()
        results = _run_mixed(cluster.client(), trajs, keys)
        programs = counter.programs  # compiled or loaded from the persistent cache
    assert programs == 0
    assert tokens_of(results[:-1]) == expected
    assert all(len(r.tokens) == g for r, (_, g) in zip(results[-1], trajs[-1][1]))
