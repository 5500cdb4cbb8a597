"""Faults of engine processes themselves (router + 1 PE + 1 DE processes, tiny Qwen2): a client
whose frames exceed the limit (patched in this process only), garbage on a DE's transfer port
ends only that process, and a dead router ends its engines while its clients fail fast. Every
other fault path is in test_faults_cluster.py, on the in-process runtime. The tests share one
cluster and run in file order: the last one kills the router.
"""

from __future__ import annotations

import socket

import pytest
from test_faults_cluster import (
    HEARTBEAT_TIMEOUT_S,
    WAIT_S,
    answered,
    fault_rig,
    send_raw,
    trajectory,
)

from dualpath_jax.rollout import RolloutError, Session
from dualpath_jax.wire import frames

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def rig(tmp_path_factory, start_cluster):
    yield from fault_rig(tmp_path_factory, start_cluster, "process")


def test_oversized_frames_are_refused(rig, reference_tokens, monkeypatch):
    cluster, _ = rig
    client = cluster.client()
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 256)
    s = Session(client, "oversized")
    with pytest.raises(RolloutError, match="exceeds the 256-byte limit") as err:
        s.step_async(list(range(200)), 2).result(WAIT_S)
    assert err.value.kind == "bad_request"
    monkeypatch.undo()
    # a raw frame over the router's limit: ZeroMQ drops that peer; the router serves on
    send_raw(cluster.address, [bytes(frames.MAX_FRAME_BYTES + 1024)])
    s.close()
    answered(client, reference_tokens, "after-oversized")


def _send_garbage(address: str) -> None:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
        sock.sendall(bytes(16))


def test_garbage_to_a_transfer_port_kills_only_that_engine_and_rounds_go_on(rig, reference_tokens):
    cluster, _ = rig
    client = cluster.client()
    de = next(v for v in client.stats()["engines"].values() if v["role"] == "decode")
    assert de["address"].startswith("127.0.0.1:")  # the transfer server binds to loopback
    traj = trajectory("through-a-restart", seed=6)
    s = Session(client, traj[0])
    first = s.step_async(*traj[1][0]).result(WAIT_S)
    _send_garbage(de["address"])
    p = cluster.procs["de1"]
    try:
        p.wait(30)  # the upstream transfer server aborts on malformed input
        cluster.killed.add("de1")
    except Exception:  # noqa: BLE001 - refusing the garbage is fine too
        pass
    second = s.step_async(*traj[1][1])  # queued until a DE is back
    if p.poll() is not None:
        cluster.restart("de1")
    assert [list(first.tokens), list(second.result(WAIT_S).tokens)] == reference_tokens(traj)
    s.close()
    assert client.stats()["engines"]["0"]["alive"]  # the PE never went down


def test_when_the_router_dies_clients_fail_fast_and_engines_exit(rig):
    cluster, _ = rig
    client = cluster.client()
    s = Session(client, "orphaned")
    cluster.kill("router")
    with pytest.raises(RolloutError, match="no answer from the router") as err:
        s.step_async([1, 2, 3], 50).result(WAIT_S)
    assert err.value.kind == "connection"  # the client noticed, not the caller's own wait
    for name in ("pe0", "de1"):
        assert cluster.procs[name].wait(HEARTBEAT_TIMEOUT_S + 20) == 0
