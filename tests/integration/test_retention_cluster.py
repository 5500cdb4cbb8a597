"""Session retention end to end: a 1P1D tiny-Qwen2 cluster whose store holds four blocks. Agent
a persists its blocks and goes into a tool call, agent b runs one round and ends, then agent c's
round needs room. With `store.eviction="retention"` the DE evicts ended b's blocks and a's next
round hits in full; with "lru" it evicts a's (the least recently used) and a recomputes them."""

from __future__ import annotations

import time

import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.kv_events import BlockRemoved, BlockStored, KVEventSubscriber
from dualpath_jax.kvstore.codec import BlockFormat
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import Session

# The engines' prefill cost model is pinned: PEs start without calibrating.
PINNED_COST = TINY_CPU_PREFILL_COST.to_json()

BT = 16
WAIT_MS = 30_000  # only bounds a broken test


def _block_bytes(params_version: str) -> int:
    fp = model_fingerprint(TINY_QWEN2, params_version)
    return BlockFormat(BlockLayout.for_model(TINY_QWEN2, BT), TINY_QWEN2.kv_dtype, fp).encoded_bytes


def _evicted(sub: KVEventSubscriber, until_s: float = 5.0) -> set[str]:
    """Keys the stream reports evicted, read until it has been quiet for a moment."""
    keys: set[str] = set()
    deadline = time.monotonic() + until_s
    while time.monotonic() < deadline:
        batch = sub.recv(200)
        if batch is None:
            if keys:
                break
            continue
        for e in batch.events:
            if isinstance(e, BlockRemoved) and e.reason == "evicted":
                keys.update(e.keys)
            assert isinstance(e, (BlockStored, BlockRemoved))
    return keys


@pytest.mark.parametrize("eviction", ["retention", "lru"])
def test_retention_keeps_an_agent_in_its_tool_call(tmp_path, start_cluster, eviction):
    # Each first round: 40 tokens + 1 generated -> 2 Full Blocks persisted (of 40 computed).
    prompts = {name: list(range(1 + 100 * i, 41 + 100 * i)) for i, name in enumerate("abc")}
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST, decode_max_len=256, kv_events_address="tcp://127.0.0.1:0"
        ),
        store=StoreConfig(
            block_tokens=BT,
            capacity_bytes=4 * _block_bytes(""),  # a block's size does not depend on the version
            eviction=eviction,
            retention_ttl_s=3600.0,  # a's tool call never outlasts it here
        ),
    )
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        stats = client.stats()
        assert _block_bytes(stats["params_version"]) * 4 == cfg.store.capacity_bytes
        fp = model_fingerprint(TINY_QWEN2, stats["params_version"])
        with KVEventSubscriber(stats["kv_events"]["address"]) as sub:
            assert sub.wait_connected(WAIT_MS)
            a = Session(client, "a")
            a_out = a.step(prompts["a"], 1)
            b = Session(client, "b")
            b_out = b.step(prompts["b"], 1)
            b.close()  # ended: its blocks stay stored, and are the first to go
            Session(client, "c").step(prompts["c"], 1)  # needs room for 2 blocks
            evicted = _evicted(sub)
            a_keys = set(block_keys(prompts["a"] + a_out, BT, fp))
            b_keys = set(block_keys(prompts["b"] + b_out, BT, fp))
            assert len(a_keys) == len(b_keys) == 2
            a.step([7, 8, 9], 1)  # a's next round, after its tool call
            res = a.results[-1]
    if eviction == "retention":
        assert evicted == b_keys
        assert res.cached_tokens == 2 * BT
    else:
        assert evicted == a_keys
        assert res.cached_tokens == 0
