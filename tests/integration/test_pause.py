"""An engine process stopped (SIGSTOP) beyond the heartbeat timeout survives: the router declares
it dead and requeues its rounds; resumed (SIGCONT), it does not take the router for dead (its
pause is not the router's silence), is told to rejoin, drops what it held, registers again and
serves the rounds; none is lost (router + 1 PE + 1 DE processes, tiny Qwen2, a small heartbeat
timeout). The same protocol, driven with fakes, is in tests/engine/test_rejoin.py and
tests/engine/test_router_faults.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_faults_cluster import PINNED_COST, WAIT_S, trajectory

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.metrics.events import read_events
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import Session

pytestmark = pytest.mark.multiprocess

HEARTBEAT_TIMEOUT_S = 2.0


def test_a_paused_engine_rejoins_and_no_round_is_lost(tmp_path, start_cluster, reference_tokens):
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST,
            decode_max_len=512,
            heartbeat_s=0.2,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            no_engine_timeout_s=120.0,  # the rounds wait for the DE meanwhile
            transfer_timeout_s=15.0,
        ),
        store=StoreConfig(block_tokens=16, timeout_s=10.0),
    )
    trajs = [trajectory(f"paused-{k}", seed=40 + k) for k in range(3)]
    with start_cluster(cfg, tmp_path / "cluster") as cluster:
        client = cluster.client()
        de = cluster.procs["de1"]
        sessions = [Session(client, name) for name, _ in trajs]
        first = [s.step_async(*rounds[0]) for s, (_, rounds) in zip(sessions, trajs)]
        os.kill(de.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + WAIT_S
            while client.stats()["engines"]["1"]["alive"]:  # until the router gives it up
                assert time.monotonic() < deadline, "the router never declared de1 dead"
                time.sleep(0.1)
            time.sleep(HEARTBEAT_TIMEOUT_S)  # stopped well beyond the timeout
        finally:
            os.kill(de.pid, signal.SIGCONT)
        got = [[list(f.result(WAIT_S).tokens)] for f in first]
        for tokens, s, (_, rounds) in zip(got, sessions, trajs):
            tokens.append(list(s.step_async(*rounds[1]).result(WAIT_S).tokens))
            s.close()
        assert got == [reference_tokens(t) for t in trajs]  # every round, the reference tokens
        assert de.poll() is None  # the paused engine never exited ...
        stats = client.stats()
        assert stats["engines"]["1"]["alive"] and stats["engines"]["1"]["pid"] == de.pid
        assert stats["counters"]["engine_deaths"] == 1 and stats["counters"]["rejoin_orders"] >= 1
        events = read_events(cluster.workdir / "events.jsonl")
        registered = [e for e in events if e["kind"] == "register" and e["engine"] == 1]
        assert len(registered) == 2  # ... it registered again, the same process
        t_back = registered[1]["t"]
        assigned = [e for e in events if e["kind"] == "assign" and e["t"] > t_back]
        assert assigned and all(e["de"] == 1 for e in assigned)  # and it serves
