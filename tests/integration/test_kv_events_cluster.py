"""KV events end to end: a 1P1D tiny-Qwen2 cluster publishing on `cluster.kv_events_address`; a
subscriber receives every stored and removed block of a small run, in order."""

from __future__ import annotations

import time

import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
    StoredBlocks,
)
from dualpath_jax.kvstore.codec import BlockFormat
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import Session

# The engines' prefill cost model is pinned: PEs start without calibrating.
PINNED_COST = TINY_CPU_PREFILL_COST.to_json()

BT = 16
WAIT_MS = 30_000  # only bounds a broken test


def next_batch(sub: KVEventSubscriber, limit_s: float = 60.0) -> EventBatch | None:
    """The next batch, waiting up to `limit_s` (None: it never came; the asserts say so)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        b = sub.recv(100)
        if b is not None:
            return b
    return None


@pytest.mark.parametrize(
    "runtime", ["thread", pytest.param("process", marks=pytest.mark.multiprocess)]
)
def test_a_subscriber_receives_every_stored_and_removed_block_in_order(
    tmp_path, start_cluster, runtime
):
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST, decode_max_len=256, kv_events_address="tcp://127.0.0.1:0"
        ),
        store=StoreConfig(block_tokens=BT),
    )
    rounds = [(list(range(1, 41)), 5), (list(range(100, 120)), 4)]  # 40 + 5, then + 20 + 4
    with start_cluster(cfg, tmp_path, runtime) as cluster:
        client = cluster.client()
        stats = client.stats()
        fp = model_fingerprint(TINY_QWEN2, stats["params_version"])
        block_bytes = BlockFormat(
            BlockLayout.for_model(TINY_QWEN2, BT), TINY_QWEN2.kv_dtype, fp
        ).encoded_bytes
        (de,) = [f"de{e}" for e, info in stats["engines"].items() if info["role"] == "decode"]
        index = StoredBlocks()
        with KVEventSubscriber(stats["kv_events"]["address"]) as sub:
            assert sub.wait_connected(WAIT_MS)
            session = Session(client, "traj")
            context: list[int] = []
            got: list[EventBatch] = []
            persisted: list[str] = []
            for append, gen in rounds:
                tokens = session.step(append, gen)
                hit = len(block_keys(context, BT, fp))  # what earlier rounds persisted
                context += append + tokens
                # The DE persists the whole blocks of the context whose KV it computed (all
                # but the last token's) past the hit, and its events were published before
                # the round's RoundResult: they are here, or on their way.
                new = block_keys(context[:-1], BT, fp)[hit:]
                assert len(new) == 2
                got.append(next_batch(sub))
                assert (got[-1].source, got[-1].events) == (
                    de,
                    (BlockStored(keys=tuple(new), block_tokens=BT, block_bytes=block_bytes),),
                )
                index.apply(got[-1])
                persisted += new
            assert index.hit(block_keys(context, BT, fp)) == 4 == len(persisted)

            session.close(release=True)  # the Ack comes after the removals were published
            got.append(next_batch(sub))
            (removed,) = got[-1].events
            assert got[-1].source == "router"
            assert isinstance(removed, BlockRemoved) and removed.reason == "released"
            assert sorted(removed.keys) == sorted(persisted)
            index.apply(got[-1])
            assert len(index) == 0

            # The whole stream of the run: numbered from the router's start, nothing lost.
            assert [b.seq for b in got] == [0, 1, 2]
            assert (sub.missed, sub.restarts) == (0, 0)
            assert client.stats()["kv_events"]["batches"] == 3
