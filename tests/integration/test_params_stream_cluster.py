"""Params updates streamed over the transfer layer on a 1P1D cluster (transfer/params_sync.py):
a client without a `params_dir` pushes new params from its own process, no checkpoint is
written anywhere, and the engines serve exactly the reference model's tokens with them. Fail-stop:
a bucket corrupted on its way to one engine, or an engine killed while it pulls, leaves every
engine on the old params with a clear error, and the cluster keeps serving (and takes the next
update)."""

from __future__ import annotations

import pathlib
import time
from concurrent import futures

import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.model.generation import reference_generate
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import RolloutError, Session
from dualpath_jax.testing.fault_plan import write_plan

BT = 16
TIMEOUT_S = 180.0
BUCKET = 60_000  # bytes: the tiny model in about ten buckets


def _cfg(tmp_path: pathlib.Path, **cluster) -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=TINY_CPU_PREFILL_COST.to_json(),
            decode_max_len=512,
            fault_file=str(tmp_path / "faults.json"),
            **cluster,
        ),
        store=StoreConfig(block_tokens=BT),
    )


def _plan(path: str, rules: list[dict]) -> None:
    """Installs the engines' fault plan (atomically; they re-read it on change)."""
    write_plan(path, rules)
    time.sleep(0.2)  # past the plan's re-read interval


def _no_params_written(workdir: pathlib.Path) -> None:
    assert not (workdir / "params").exists()
    assert not [p for p in workdir.rglob("*") if p.name in ("params", "_CHECKPOINT_METADATA")]


@pytest.mark.parametrize(
    "runtime", ["thread", pytest.param("process", marks=pytest.mark.multiprocess)]
)
def test_streamed_updates_serve_the_new_params_or_none(start_cluster, tmp_path, runtime):
    cfg = _cfg(tmp_path)
    a = init_model(TINY_QWEN2, seed=cfg.seed)  # what the engines start with
    b, c = init_model(TINY_QWEN2, seed=41), init_model(TINY_QWEN2, seed=42)
    ref = {"a": ModelRunner(a), "b": ModelRunner(b), "c": ModelRunner(c)}
    rs = np.random.RandomState(7)

    def fresh_round(name: str, want: str, gen: int = 4) -> None:
        prompt = rs.randint(0, TINY_QWEN2.vocab_size, 37).tolist()
        toks = Session(client, name).step(prompt, gen, TIMEOUT_S)
        assert toks == reference_generate(ref[want], prompt, gen)

    with start_cluster(cfg, tmp_path / "run", runtime) as cluster:
        client = cluster.client(params_dir=None)  # nothing shared on disk: streamed
        fresh_round("s0", "a")
        assert client.update_params(b, version="step-1", bucket_bytes=BUCKET) == "step-1"
        info = client.last_params_update
        assert info["via"] == "transfer" and info["buckets"] > 5
        assert client.stats()["params_version"] == "step-1"
        fresh_round("s1", "b")
        _no_params_written(cluster.workdir)

        # One bucket arrives corrupted at the decode engine: refused everywhere, B serves on.
        _plan(
            cfg.cluster.fault_file, [{"op": "params.bucket", "corrupt": True, "engines": ["de1"]}]
        )
        with pytest.raises(
            RolloutError, match="refused, still serving 'step-1'.*arrived corrupted"
        ):
            client.update_params(c, version="step-bad", bucket_bytes=BUCKET)
        stats = client.stats()
        assert stats["params_version"] == "step-1"
        assert {e["params_version"] for e in stats["engines"].values()} == {"step-1"}
        fresh_round("s2", "b")

        # The fault cleared, the next update goes through.
        _plan(cfg.cluster.fault_file, [])
        assert client.update_params(c, version="step-2", bucket_bytes=BUCKET) == "step-2"
        fresh_round("s3", "c")
        _no_params_written(cluster.workdir)


@pytest.mark.multiprocess
def test_an_engine_killed_mid_transfer_leaves_every_engine_on_the_old_params(
    start_cluster, tmp_path
):
    cfg = _cfg(tmp_path, heartbeat_s=0.2, heartbeat_timeout_s=2.0)
    a = init_model(TINY_QWEN2, seed=cfg.seed)
    b = init_model(TINY_QWEN2, seed=41)
    ref_a, ref_b = ModelRunner(a), ModelRunner(b)
    prompt = list(range(3, 40))
    # The decode engine stalls after its first bucket: the test kills it there.
    _plan(
        cfg.cluster.fault_file,
        [{"op": "params.bucket", "delay_s": 3600.0, "count": 1, "engines": ["de1"]}],
    )
    with start_cluster(cfg, tmp_path / "run", "process") as cluster:
        client = cluster.client(params_dir=None)
        log = cluster.workdir / "logs" / "de1.log"
        with futures.ThreadPoolExecutor(1) as pool:
            update = pool.submit(client.update_params, b, "step-1", bucket_bytes=BUCKET)
            deadline = time.monotonic() + TIMEOUT_S
            while "into params.bucket" not in log.read_text(errors="replace"):
                assert time.monotonic() < deadline, "de1 never pulled a bucket"
                assert not update.done(), update.exception()
                time.sleep(0.05)
            cluster.kill("de1")
            with pytest.raises(RolloutError, match="engine 1: died while pulling the params"):
                update.result(TIMEOUT_S)
        stats = client.stats()
        assert stats["params_version"] == "" and stats["engines"]["0"]["params_version"] == ""
        _plan(cfg.cluster.fault_file, [])
        cluster.restart("de1")  # with the cluster's first params: in rotation again
        assert Session(client, "s").step(prompt, 4, TIMEOUT_S) == reference_generate(
            ref_a, prompt, 4
        )
        assert client.update_params(b, version="step-2", bucket_bytes=BUCKET) == "step-2"
        assert Session(client, "t").step(prompt, 4, TIMEOUT_S) == reference_generate(
            ref_b, prompt, 4
        )
