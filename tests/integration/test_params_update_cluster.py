"""RL parameter updates on a real 1P1D cluster (router + 2 engine processes).

One cluster, started from a checkpoint (`cluster.params_path`), walks through an RL loop's
life: rounds on params A; an update to B -- the continued session recomputes (no block of A is
read) and equals the reference model with B on the full context; B's own blocks are reused on
the next round; refused params (wrong shapes) leave B serving; a sampled round equals the
in-process backend with the same params and key; an update waits for a round in flight; closing
with release=True deletes the session's blocks.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.model.checkpoint import params_state, save_params_tree
from dualpath_jax.model.generation import reference_generate
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import InProcessBackend, RolloutError, Session
from dualpath_jax.runtimes.build import store_config

# The engines' prefill cost model is pinned: PEs start without calibrating.
PINNED_COST = TINY_CPU_PREFILL_COST.to_json()

BT = 16
TIMEOUT_S = 180.0


@pytest.mark.parametrize(
    "runtime", ["thread", pytest.param("process", marks=pytest.mark.multiprocess)]
)
def test_params_updates_on_a_cluster(start_cluster, tmp_path, runtime):
    a, b = init_model(TINY_QWEN2, seed=31), init_model(TINY_QWEN2, seed=32)
    ref_a, ref_b = ModelRunner(a), ModelRunner(b)
    save_params_tree(a, tmp_path / "params-a")
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST,
            decode_max_len=512,
            params_path=str(tmp_path / "params-a"),
        ),
        store=StoreConfig(block_tokens=BT),
    )
    rs = np.random.RandomState(3)

    def rand(n: int) -> list[int]:
        return rs.randint(0, TINY_QWEN2.vocab_size, n).tolist()

    with start_cluster(cfg, tmp_path / "run", runtime) as cluster:
        client = cluster.client()
        assert client.stats()["params_version"] == f"path:{tmp_path / 'params-a'}"
        s = Session(client, "s")
        ctx: list[int] = []

        def step(ref, append, gen, **kw):
            nonlocal ctx
            toks = s.step(append, gen, TIMEOUT_S, **kw)
            ctx += append
            if ref is not None:
                assert toks == reference_generate(ref, ctx, gen)
            ctx += toks
            return s.results[-1]

        # The engines serve the checkpoint, not init_model(seed).
        step(ref_a, rand(40), 5)
        assert step(ref_a, rand(20), 4).cached_tokens == 2 * BT  # A's blocks reused

        assert client.update_params(b, version="step-1") == "step-1"
        assert client.stats()["params_version"] == "step-1"
        res = step(ref_b, rand(20), 4)  # recomputed with B: none of A's blocks is read
        assert (res.cached_tokens, res.prompt_tokens) == (0, len(ctx) - 4)
        assert step(ref_b, rand(17), 3).cached_tokens == 5 * BT  # B's blocks reused

        bad = params_state(b)
        bad["layers"][1]["self_attn"]["q_proj"]["kernel"] = bad["layers"][1]["self_attn"]["q_proj"][
            "kernel"
        ][:, :8]
        with pytest.raises(
            RolloutError, match="refused, still serving 'step-1'.*layers/1/self_attn/q_proj/kernel"
        ):
            client.update_params(bad, version="step-bad")
        assert client.stats()["params_version"] == "step-1"
        assert step(ref_b, rand(5), 3).cached_tokens > 0

        # A sampled round: the same tokens as the in-process backend with B, this context and key.
        key = jax.random.key(7)
        append = rand(6)
        local = Session(InProcessBackend(b, max_len=512)).step(
            ctx + append, 6, temperature=1.0, key=key
        )
        step(None, append, 6, temperature=1.0, key=key)
        assert ctx[-6:] == local
        # and with top-p: the PE's first token and the DE's nucleus draw as in-process
        append = rand(5)
        local = Session(InProcessBackend(b, max_len=512)).step(
            ctx + append, 6, temperature=1.5, key=key, top_p=0.6
        )
        step(None, append, 6, temperature=1.5, key=key, top_p=0.6)
        assert ctx[-6:] == local

        # An update waits for the round in flight (it finishes on B), the next round runs on A.
        t = Session(client, "t")
        prompt = rand(30)
        fut = t.step_async(prompt, 6)
        assert client.update_params(a, version="step-2") == "step-2"
        assert fut.done() and list(fut.result().tokens) == reference_generate(ref_b, prompt, 6)
        follow = rand(4)
        assert t.step(follow, 3, TIMEOUT_S) == reference_generate(
            ref_a, prompt + list(fut.result().tokens) + follow, 3
        )

        # Closing with release=True deletes the blocks of the session's context.
        store = open_block_store(store_config(cfg, str(cluster.workdir)), cfg.model)
        try:
            keys = block_keys(ctx[:-1], BT, model_fingerprint(TINY_QWEN2, "step-1"))
            assert len(keys) >= 7 and store.lookup(keys).result(30) == len(keys)
            s.close(release=True)
            assert sum(store.lookup([k]).result(30) for k in keys) == 0
        finally:
            store.close()


def test_a_restarted_engine_that_cannot_load_the_served_params_gets_no_work(
    start_cluster, tmp_path
):
    """After an update, a decode engine restarts from the cluster's first params and cannot
    read the served checkpoint: it stays out of rotation while the other DE serves every round
    (none fails), and once the checkpoint is readable again it is caught up and serves."""
    import shutil
    import time

    from dualpath_jax.metrics.events import read_events

    b = init_model(TINY_QWEN2, seed=32)
    ref_b = ModelRunner(b)
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST,
            decode_max_len=512,
            decode_nodes=2,
            heartbeat_s=0.2,
            heartbeat_timeout_s=2.0,  # the killed DE is declared dead soon
            params_retry_s=0.5,
        ),
        store=StoreConfig(block_tokens=BT),
    )
    rs = np.random.RandomState(5)
    with start_cluster(cfg, tmp_path / "run", "thread") as cluster:
        client = cluster.client()
        assert client.update_params(b, version="step-1") == "step-1"
        ckpt = cluster.workdir / "params" / "step-1"
        shutil.move(ckpt, tmp_path / "moved")  # the served checkpoint is unreadable now
        cluster.kill("de2")
        cluster.restart("de2")  # it serves init_model's params again
        engines = client.stats()["engines"]["2"]
        assert engines["alive"] and not engines["serving"]
        t_back = time.monotonic()
        prompts = [rs.randint(0, TINY_QWEN2.vocab_size, 24).tolist() for _ in range(8)]
        for k, prompt in enumerate(prompts):  # every round on the DE in rotation, B's tokens
            assert Session(client, f"r{k}").step(prompt, 3, TIMEOUT_S) == reference_generate(
                ref_b, prompt, 3
            )
        events = read_events(cluster.workdir / "events.jsonl")
        assert {e["de"] for e in events if e["kind"] == "assign" and e["t"] > t_back} == {1}
        assert any(e["kind"] == "params_catch_up_failed" and e["engine"] == 2 for e in events)
        assert not client.stats()["engines"]["2"]["serving"]
        shutil.move(tmp_path / "moved", ckpt)  # readable again: the next retry loads it
        deadline = time.monotonic() + TIMEOUT_S
        while not client.stats()["engines"]["2"]["serving"]:
            assert time.monotonic() < deadline, "de2 was never caught up"
            time.sleep(0.1)
        assert client.stats()["engines"]["2"]["params_version"] == "step-1"
