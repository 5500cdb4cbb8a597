"""Engines that own their devices and run the model sharded over a mesh.

A LocalCluster with `cluster.platform="cpu"`: the prefill engine's process gets 4 CPU devices
(`cluster.prefill_mesh="data=1,tensor=4"`), the decode engine's 2 (`decode_mesh="tensor=2"`),
each its own JAX runtime. They exchange KV over the transfer channel and the store, and the
tokens equal the one-device reference model's under every loading policy. The commands of
docs/multihost.md ("One host, several engines on disjoint devices") run this cluster.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pytest

from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    StoreConfig,
)
from dualpath_jax.model.generation import reference_generate, reference_rounds
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_DEEPSEEK, TINY_QWEN2
from dualpath_jax.rollout import Session, step_group

# The engines' prefill cost model is pinned: PEs start without calibrating.
PINNED_COST = TINY_CPU_PREFILL_COST.to_json()

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# The tiny Qwen2 with 8 query and 4 KV heads, so both meshes split the heads (and the KV) evenly.
MODEL = dataclasses.replace(TINY_QWEN2, num_heads=8, num_kv_heads=4, head_dim=8)
PE_MESH, DE_MESH = "data=1,tensor=4", "tensor=2"
BLOCK_TOKENS = 16
RESULT_TIMEOUT_S = 300.0


def mesh_config(policy: str, model=MODEL, **cluster: object) -> ExperimentConfig:
    return ExperimentConfig(
        model=model,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST,
            **{
                "decode_max_len": 256,
                "platform": "cpu",
                "prefill_mesh": PE_MESH,
                "decode_mesh": DE_MESH,
                **cluster,
            },
        ),
        store=StoreConfig(block_tokens=BLOCK_TOKENS),
        scheduler=SchedulerConfig(policy=Policy(policy)),
    )


def _trajectories() -> list[tuple[str, list[tuple[list[int], int]]]]:
    """Two trajectories of two rounds; every append is at least a block, so round 1 hits."""
    rs = np.random.RandomState(7)
    out = []
    for k in range(2):
        rounds = [
            (rs.randint(0, MODEL.vocab_size, 40 + 3 * k).tolist(), 4),
            (rs.randint(0, MODEL.vocab_size, 20 + k).tolist(), 3),
        ]
        out.append((f"mesh{k}", rounds))
    return out


TRAJECTORIES = _trajectories()
GROUP_PROMPT = np.random.RandomState(11).randint(0, MODEL.vocab_size, 45).tolist()


def run_rounds(client) -> list[list]:
    """Round i of every trajectory at once, then round i + 1; each trajectory's results."""
    sessions = [Session(client, tid) for tid, _ in TRAJECTORIES]
    results: list[list] = [[] for _ in TRAJECTORIES]
    for i in range(2):
        futs = [s.step_async(*TRAJECTORIES[k][1][i]) for k, s in enumerate(sessions)]
        for k, f in enumerate(futs):
            results[k].append(f.result(RESULT_TIMEOUT_S))
    for s in sessions:
        s.close()
    return results


def update_and_step(client, seed: int = 5, via: str | None = None) -> tuple[list[int], list[int]]:
    """Updates the params to another model (`via`: as `Client.update_params`), then runs one
    round in a new session: (its tokens, the reference model's with the new params)."""
    new = init_model(MODEL, seed=seed)
    assert client.update_params(new, version=f"seed{seed}", via=via) == f"seed{seed}"
    prompt = np.random.RandomState(9).randint(0, MODEL.vocab_size, 37).tolist()
    s = Session(client, f"after-update-{seed}")
    got = s.step(prompt, 4, RESULT_TIMEOUT_S)
    s.close()
    return got, reference_generate(ModelRunner(new), prompt, 4)


@pytest.fixture(scope="module")
def expected() -> list[list[list[int]]]:
    """Each trajectory's reference tokens from the one-device model (the engines' seed 0)."""
    runner = ModelRunner(init_model(MODEL, seed=0))
    return [reference_rounds(runner, rounds) for _, rounds in TRAJECTORIES]


# The policies whose KV takes different roads on a mesh: the DE read path and the PE's (DualPath),
# the PE's alone (Basic), chunks whose KV stays on the PE's mesh (split). The others reuse these
# roads; on one device each runs in test_cluster.py.
@pytest.mark.parametrize("policy", ["dualpath", "basic", "split"])
def test_sharded_engines_generate_the_one_device_tokens(policy, tmp_path, start_cluster, expected):
    # Split and round-robin DualPath prefill in chunks of at most 16 new tokens: earlier chunks'
    # KV stays on the PE's mesh for the next chunk.
    extra = {"prefill_max_tokens": 16} if policy in ("split", "dualpath_rr") else {}
    with start_cluster(mesh_config(policy, **extra), tmp_path) as cluster:
        assert "--xla_force_host_platform_device_count=4" in cluster.engine_envs[0][0]["XLA_FLAGS"]
        assert "--xla_force_host_platform_device_count=2" in cluster.engine_envs[1][0]["XLA_FLAGS"]
        client = cluster.client()
        engines = client.stats()["engines"]
        results = run_rounds(client)
        counters = client.stats()["counters"]

    # each engine runs on its own devices, as many as its role's mesh spans
    pe, de = engines[str(cluster.engine_ids["pe0"])], engines[str(cluster.engine_ids["de1"])]
    assert (pe["role"], pe["mesh"], len(pe["devices"])) == ("prefill", PE_MESH, 4), pe
    # the PE splits its KV rows by head over its 4 devices: its DEs offer their hits in 4 pieces
    assert pe["kv_pieces"] == 4
    assert (de["role"], de["mesh"], len(de["devices"])) == ("decode", DE_MESH, 2), de
    assert pe["devices"] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], pe  # each process's own
    assert de["devices"] == ["cpu:0", "cpu:1"], de

    assert [[list(r.tokens) for r in rr] for rr in results] == expected
    later = [rr[1] for rr in results]
    assert all(r.cached_tokens >= BLOCK_TOKENS for r in later), [r.cached_tokens for r in later]
    assert all(r.recomputed_blocks == 0 for rr in results for r in rr)
    assert counters["errors"] == counters["engine_deaths"] == counters["requeued"] == 0, counters
    paths = collections.Counter(r.read_path for r in later)
    if policy == "basic":
        assert paths == {"pe": len(later)}, paths
    elif policy == "split":
        assert paths["split"] > 0, paths


def test_a_decode_engine_spanning_two_processes(tmp_path, start_cluster, expected):
    """The DE's mesh (`tensor=2`) spans two processes of one device each, joined by their own
    `jax.distributed` group: process 0 serves, process 1 replays its decoder's calls (a group's
    forks of one prompt's pages too). The tokens equal the one-device reference model's, and the
    whole cluster stops cleanly."""
    cfg = mesh_config("dualpath", prefill_mesh="", decode_processes=2)
    with start_cluster(cfg, tmp_path) as cluster:
        assert sorted(cluster.procs) == ["de1", "de1.1", "pe0", "router"]
        for rank in (0, 1):  # each process of the DE has one device of its own
            env = cluster.engine_envs[1][rank]
            assert "--xla_force_host_platform_device_count=1" in env["XLA_FLAGS"]
        client = cluster.client()
        engines = client.stats()["engines"]
        results = run_rounds(client)
        group = step_group(Session(client, "grp").fork(3), GROUP_PROMPT, 4)
        counters = client.stats()["counters"]
        updated = update_and_step(client)
        streamed = update_and_step(client, seed=6, via="transfer")  # each process its shards

    assert len(engines) == 2  # the follower is not an engine of its own
    want = reference_generate(ModelRunner(init_model(MODEL, seed=0)), GROUP_PROMPT, 4)
    assert group == [want] * 3 and counters["forks"] == 2  # greedy: the same tokens
    de = engines[str(cluster.engine_ids["de1"])]
    assert (de["role"], de["mesh"], len(de["devices"])) == ("decode", DE_MESH, 2), de
    assert [[list(r.tokens) for r in rr] for rr in results] == expected
    assert all(r.cached_tokens >= BLOCK_TOKENS for r in (rr[1] for rr in results))
    assert counters["errors"] == counters["engine_deaths"] == counters["requeued"] == 0, counters
    assert updated[0] == updated[1]  # new params, loaded and served by both processes
    assert streamed[0] == streamed[1]  # streamed over the transfer layer to both processes
    log = (tmp_path / "logs" / "de1.1.log").read_text()
    assert "stopped by the leader" in log, log[-2000:]


@pytest.mark.parametrize(
    ("policy", "extra"),
    [("dualpath", {}), ("basic", {}), ("split", {"prefill_max_tokens": 16})],
)
def test_a_prefill_engine_spanning_two_processes(policy, extra, tmp_path, start_cluster, expected):
    """The PE's mesh (`tensor=2`) spans two processes of one device each: process 0 serves and
    tells process 1 each layer's cached rows, and process 1 runs the same forward (layerwise, or
    chunked) with them and with the rows it kept itself. Each process pulls its half of each hit
    layer (its KV heads: from the DE, or from the leader's device for the PE-read blocks) and
    offers the DE the half of the new rows its device computed, from its own KV channel. Tokens
    equal the reference's."""
    cfg = mesh_config(policy, prefill_mesh=DE_MESH, decode_mesh="", prefill_processes=2, **extra)
    with start_cluster(cfg, tmp_path) as cluster:
        assert sorted(cluster.procs) == ["de1", "pe0", "pe0.1", "router"]
        client = cluster.client()
        engines = client.stats()["engines"]
        results = run_rounds(client)
        counters = client.stats()["counters"]
        updated = update_and_step(client) if policy == "dualpath" else None

    pe = engines[str(cluster.engine_ids["pe0"])]
    assert (pe["role"], pe["mesh"], len(pe["devices"])) == ("prefill", DE_MESH, 2), pe
    assert [[list(r.tokens) for r in rr] for rr in results] == expected
    assert all(r.cached_tokens >= BLOCK_TOKENS for r in (rr[1] for rr in results))
    assert counters["errors"] == counters["engine_deaths"] == counters["requeued"] == 0, counters
    if updated is not None:
        assert updated[0] == updated[1]  # new params, loaded and served by both processes
    log = (tmp_path / "logs" / "pe0.1.log").read_text()
    assert "stopped by the leader" in log, log[-2000:]
    # the pieces of the new rows left from both processes, each from its own channel
    where = pe["kv_piece_addresses"]
    assert len(where) == 2 and where[0] == pe["address"] and where[1] != where[0], pe
    moved = re.search(r"offered (\d+) KV row pieces .*, pulled the pieces of (\d+) hit", log)
    assert moved and int(moved.group(1)) > 0, log[-2000:]
    # ... and every hit layer reaches each process in its pieces (the DE's offered to each
    # process, the leader's PE-read blocks offered from its device): the follower pulled some
    assert pe["kv_pieces"] == 2 and pe["kv_piece_holders"] == [[0], [1]], pe
    assert int(moved.group(2)) > 0, log[-2000:]


def test_an_mla_prefill_engine_spanning_two_processes(tmp_path, start_cluster):
    """DeepSeek's MLA over a PE spanning two processes: its one latent head is replicated on
    both, so the new rows leave as one piece (the leader's) and the DE offers each DE-read hit
    layer to both processes, each pulling its own copy. Tokens equal the reference's."""
    cfg = mesh_config(
        "split", model=TINY_DEEPSEEK, prefill_mesh=DE_MESH, decode_mesh="", prefill_processes=2,
        prefill_max_tokens=16,
    )  # fmt: skip
    runner = ModelRunner(init_model(TINY_DEEPSEEK, seed=0))
    want = [reference_rounds(runner, rounds) for _, rounds in TRAJECTORIES]
    with start_cluster(cfg, tmp_path) as cluster:
        client = cluster.client()
        engines = client.stats()["engines"]
        results = run_rounds(client)
        counters = client.stats()["counters"]

    assert [[list(r.tokens) for r in rr] for rr in results] == want
    assert counters["errors"] == counters["engine_deaths"] == counters["requeued"] == 0, counters
    pe = engines[str(cluster.engine_ids["pe0"])]
    assert pe["kv_pieces"] == 1 and pe["kv_piece_holders"] == [[0, 1]], pe
    log = (tmp_path / "logs" / "pe0.1.log").read_text()
    moved = re.search(r"offered (\d+) KV row pieces .*, pulled the pieces of (\d+) hit", log)
    assert moved and int(moved.group(1)) == 0 and int(moved.group(2)) > 0, log[-2000:]
