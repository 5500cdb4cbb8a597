"""Fault paths through a real cluster (router, 1 PE and 1 DE, tiny Qwen2) on the in-process
runtime: the same engines, control plane and fault plan as engine processes (the faults that
need processes, a client's patched frame limit, garbage on the transfer port and a dead router,
are in test_faults_processes.py).

Every fault ends with the reference model's tokens or a `RolloutError` of the right kind within a
bounded time, and a new session on the same cluster is answered afterwards. Store and channel
faults are injected through the engines' fault plan (`cluster.fault_file`, dualpath_jax.testing),
rewritten while the cluster runs. The tests share one cluster (one pytest worker runs them all:
`xdist_group`) and run in file order: the last one kills the prefill engine and restarts it.
"""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np
import pytest
import zmq
from trace_helpers import records

from dualpath_jax.cluster import Client
from dualpath_jax.config import ClusterConfig, ExperimentConfig, SchedulerConfig, StoreConfig
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.metrics.events import read_events
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import RolloutError, Session, run_trajectories
from dualpath_jax.testing.fault_plan import write_plan
from dualpath_jax.wire import messages
from dualpath_jax.wire.params_protocol import initial_params_version
from dualpath_jax.wire.rpc import RpcClient

# The engines' prefill cost model is pinned: PEs start without calibrating.
PINNED_COST = TINY_CPU_PREFILL_COST.to_json()

pytestmark = pytest.mark.xdist_group("faults_rig")

BT = 16
VOCAB = TINY_QWEN2.vocab_size
WAIT_S = 120.0  # bounds a broken test; healthy rounds take well under a second
TRANSFER_TIMEOUT_S = 15.0  # compiles of new batch shapes under load take seconds here
START_TIMEOUT_S = 15.0  # a DE's wait for its PE to begin (the PE's queue under overload)
HEARTBEAT_TIMEOUT_S = 8.0
NO_ENGINE_TIMEOUT_S = 25.0


def config(fault_file: pathlib.Path, **cluster) -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST,
            decode_max_len=512,
            transfer_timeout_s=TRANSFER_TIMEOUT_S,
            prefill_start_timeout_s=START_TIMEOUT_S,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            no_engine_timeout_s=NO_ENGINE_TIMEOUT_S,
            max_attempts=2,
            fault_file=str(fault_file),
            **cluster,
        ),
        store=StoreConfig(block_tokens=BT, timeout_s=10.0),
        scheduler=SchedulerConfig(max_queue=16),
    )


def trajectory(name: str, seed: int, rounds: int = 2) -> tuple[str, list[tuple[list[int], int]]]:
    rs = np.random.RandomState(seed)
    return name, [(rs.randint(0, VOCAB, 40 if i == 0 else 20).tolist(), 4) for i in range(rounds)]


class Faults:
    """Writes the engines' fault plan (atomically; they re-read it on change)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.set()

    def set(self, *rules: dict) -> None:
        write_plan(self.path, rules)
        time.sleep(0.2)  # past the plan's re-read interval


def fault_rig(tmp_path_factory, start_cluster, runtime: str):
    """Yields (cluster, faults): the tests' cluster on `runtime`, its fault plan empty."""
    wd = tmp_path_factory.mktemp("faults")
    faults = Faults(wd / "faults.json")
    with start_cluster(config(faults.path), wd / "cluster", runtime) as cluster:
        yield cluster, faults


@pytest.fixture(scope="module")
def rig(tmp_path_factory, start_cluster):
    yield from fault_rig(tmp_path_factory, start_cluster, "thread")


def log_text(cluster) -> str:
    """The cluster's log (the in-process runtime writes one for all its threads)."""
    return (cluster.workdir / "logs" / "inprocess.log").read_text()


@pytest.fixture(autouse=True)
def no_faults_left(rig):
    """Whatever a test injected is cleared after it, passed or failed."""
    yield
    rig[1].set()


def send_raw(address: str, frames: list[bytes]) -> None:
    """Sends frames to the router as a stranger would: raw bytes on a DEALER socket."""
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 5000)  # close() delivers what was sent
    raw.connect(address)
    for f in frames:
        raw.send(f)
    raw.close()


def events(cluster) -> list[dict]:
    return read_events(cluster.workdir / "events.jsonl")


def run(client: Client, traj, reference_tokens) -> list[messages.RoundResult]:
    """Runs a trajectory round by round; asserts the reference tokens."""
    s = Session(client, traj[0])
    out = [s.step_async(a, g).result(WAIT_S) for a, g in traj[1]]
    s.close()
    assert [list(r.tokens) for r in out] == reference_tokens(traj)
    return out


def answered(client: Client, reference_tokens, name: str) -> None:
    """A new session on the cluster gets the reference tokens."""
    run(client, trajectory(name, seed=sum(map(ord, name)), rounds=1), reference_tokens)


# ----------------------------------------------------------------------------- store faults


@pytest.mark.parametrize(
    ("error", "text"), [("ENOSPC", "No space left on device"), ("EROFS", "Read-only file system")]
)
def test_a_store_that_cannot_persist_still_returns_the_tokens(rig, reference_tokens, error, text):
    cluster, faults = rig
    client = cluster.client()
    traj = trajectory(f"persist-{error}", seed=len(error), rounds=3)  # unlike the other's
    s = Session(client, traj[0])
    first = s.step_async(*traj[1][0]).result(WAIT_S)  # persisted normally
    faults.set({"op": "store.write", "error": error})  # the store turns full / read-only mid-run
    second = s.step_async(*traj[1][1]).result(WAIT_S)
    faults.set()
    third = s.step_async(*traj[1][2]).result(WAIT_S)
    s.close()
    assert [list(r.tokens) for r in (first, second, third)] == reference_tokens(traj)
    assert first.persist_error == "" and third.persist_error == ""
    assert text in second.persist_error
    # round 2 finds round 0's blocks only (round 1's were not stored) and recomputes the rest
    assert 0 < third.cached_tokens <= len(traj[1][0][0])
    fails = [e for e in events(cluster) if e["kind"] == "persist_failed"]
    assert any(text in e["message"] for e in fails)
    assert text in log_text(cluster)
    answered(client, reference_tokens, f"after-{error}")


def test_a_directory_at_a_block_path(rig, reference_tokens):
    cluster, _ = rig
    client = cluster.client()
    traj = trajectory("dir-at-block", seed=2)
    append = traj[1][0][0]
    fed = append + reference_tokens(traj)[0][:-1]
    fingerprint = model_fingerprint(TINY_QWEN2, initial_params_version(cluster.cfg.cluster))
    keys = block_keys(fed[: len(fed) // BT * BT], BT, fingerprint)
    store = cluster.workdir / "store"
    for key in keys:
        (store / key[:2] / key).mkdir(parents=True)
    out = run(client, traj, reference_tokens)
    assert "Directory" in out[0].persist_error or "directory" in out[0].persist_error
    answered(client, reference_tokens, "after-dir")


def test_a_failing_store_lookup_is_a_store_error(rig, reference_tokens):
    cluster, faults = rig
    client = cluster.client()
    faults.set({"op": "store.lookup", "error": "EIO", "engines": ["router"]})
    s = Session(client, "lookup-eio")
    with pytest.raises(RolloutError, match="Input/output error") as err:
        s.step_async(list(range(3 * BT)), 2).result(WAIT_S)  # whole blocks: a real lookup
    assert err.value.kind == "store"
    faults.set()
    s.close()
    answered(client, reference_tokens, "after-eio")


# ----------------------------------------------------------------------------- transfer faults


@pytest.mark.slow  # waits out its timeouts: half a minute
def test_transfer_timeouts_are_retried_then_fail_with_kind_transfer(rig, reference_tokens):
    cluster, faults = rig
    client = cluster.client()
    faults.set({"op": "channel.pull", "hang": True})
    s = Session(client, "hanging-pulls")
    try:
        with pytest.raises(RolloutError, match="gave up after 2 attempts") as err:
            s.step_async(*trajectory("x", seed=3)[1][0]).result(WAIT_S)
    finally:
        faults.set()
    assert err.value.kind == "transfer" and "TransferTimeout" in str(err.value)
    failures = [e for e in events(cluster) if e["kind"] == "failed"]
    assert any(e["failure"] == "transfer" for e in failures)
    # the session is usable again
    s.close()
    answered(client, reference_tokens, "after-transfer")


# ----------------------------------------------------------------------------- strict input


@pytest.mark.parametrize(
    ("append", "gen", "message"),
    [
        ([2**64], 2, r"token id 18446744073709551616 is out of range \[0, 2\*\*31\)"),
        ([1.7], 2, "token id 1.7 is not an int"),
        ("123", 2, "must be a sequence of ints"),
        ([True], 2, "token id True is not an int"),
        ([1], 2**64, "gen must be < 2147483648"),
        ([1], 2.0, "gen must be an int"),
    ],
    ids=["2**64", "float", "str", "bool", "gen-2**64", "gen-float"],
)
def test_bad_token_ids_are_refused_and_the_client_keeps_working(rig, append, gen, message):
    cluster, _ = rig
    client = cluster.client()
    s = Session(client, f"strict-{message[:10]}")
    with pytest.raises(RolloutError, match=message) as err:
        s.step_async(append, gen).result(WAIT_S)
    assert err.value.kind == "bad_request"
    assert list(s.step_async([np.int64(5), np.int32(6)], 2).result(WAIT_S).tokens)  # numpy ints ok
    s.close()


def test_an_existing_session_id_needs_resume(rig):
    cluster, _ = rig
    client = cluster.client()
    s = Session(client, "twice")
    s.step_async([1, 2, 3], 2).result(WAIT_S)
    with pytest.raises(RolloutError, match="resume=True") as err:
        Session(client, "twice")
    assert err.value.kind == "bad_request"
    again = Session(client, "twice", resume=True)
    assert len(again.step_async([4], 2).result(WAIT_S).tokens) == 2
    again.close()


def test_a_wrong_secret_is_an_auth_error_not_a_timeout(rig):
    cluster, _ = rig
    client = Client(cluster.address, "not-the-secret")
    try:
        with pytest.raises(RolloutError, match="the router refused this client") as err:
            client.open_session("intruder", timeout_s=WAIT_S)
        assert err.value.kind == "auth"  # a refusal, not the session timeout
    finally:
        client.close()


def test_garbage_frames_are_rejected_and_the_router_serves_on(rig, reference_tokens):
    cluster, _ = rig
    client = cluster.client()
    rs = np.random.RandomState(0)
    send_raw(cluster.address, [rs.bytes(int(rs.randint(1, 64))) for _ in range(500)])
    answered(client, reference_tokens, "after-garbage")
    assert client.stats()["engines"]["0"]["alive"]
    assert log_text(cluster).count("rejected a frame") < 100  # repeated warnings are rate-limited


def test_only_engines_may_register_and_ids_cannot_be_taken_over(rig, reference_tokens):
    cluster, _ = rig
    client = cluster.client()
    creds = cluster.credentials
    stats = client.stats()["engines"]
    de = next(k for k, v in stats.items() if v["role"] == "decode")
    register = messages.Register(
        role="decode", engine=int(de), node=9, group=0, address="127.0.0.1:1", pid=os.getpid()
    )
    for secret, kind, text in (
        (creds.client, "auth", "needs the engine secret"),  # a client
        ("", "auth", "authentication failed"),  # a stranger
        (creds.engine, "stop", "already registered"),  # an engine id in use
    ):
        rogue = RpcClient(cluster.address, secret)
        try:
            rogue.send(register)
            reply = rogue.recv(int(WAIT_S * 1000))
        finally:
            rogue.close()
        assert isinstance(reply, messages.Error) and reply.kind == kind and text in reply.message
    # a client cannot stop the router either
    with pytest.raises(RolloutError) as err:
        client.shutdown(timeout_s=WAIT_S)
    assert err.value.kind == "auth"
    after = client.stats()["engines"][de]
    assert after["address"] == stats[de]["address"] and after["alive"]
    answered(client, reference_tokens, "after-rogue")


def test_a_timed_out_round_is_cancelled_and_its_session_goes_on(rig, reference_tokens):
    cluster, faults = rig
    client = cluster.client()
    traj = trajectory("cancelled", seed=5)
    s = Session(client, traj[0])
    faults.set({"op": "store.lookup", "delay_s": 3.0, "engines": ["router"]})
    with pytest.raises(TimeoutError):
        s.step(*traj[1][0], timeout_s=0.5)
    faults.set()
    # the round was cancelled: the session takes its first round again
    assert s.step(*traj[1][0], timeout_s=WAIT_S) == reference_tokens(traj)[0]
    s.close()
    assert any(e["kind"] == "cancel" for e in events(cluster))


# ----------------------------------------------------------------------------- overload


def test_overload_ends_in_tokens_or_overloaded_errors(rig, reference_tokens):
    cluster, _ = rig
    client = cluster.client()
    trajs = [trajectory(f"load{k}", seed=100 + k) for k in range(40)]
    out = run_trajectories(client, records(trajs), progress=False, timeout_s=600)
    kinds = {o.error for o in out}
    done = [o for o in out if not o.error]
    assert done, kinds
    for o in out:
        assert not o.error or "overloaded" in o.error, o.error
    for o, t in zip(out, trajs):
        assert o.rounds == reference_tokens(t)[: len(o.rounds)]
    stats = client.stats()["counters"]
    failed = [e for e in events(cluster) if e["kind"] == "failed" and e["request"][:4] == "load"]
    assert failed == [] and stats["engine_deaths"] == 0  # no transfer timed out


# ----------------------------------------------------------------------------- engine deaths


@pytest.mark.slow  # waits out its timeouts: half a minute
def test_with_no_live_prefill_engine_rounds_fail_with_kind_engine(rig, reference_tokens):
    cluster, _ = rig
    client = cluster.client()
    cluster.kill("pe0")
    s = Session(client, "no-pe")
    with pytest.raises(RolloutError, match="no live prefill engine") as err:
        s.step_async([1, 2, 3], 2).result(WAIT_S)
    assert err.value.kind == "engine"
    s.close()
    cluster.restart("pe0")
    answered(client, reference_tokens, "after-restart")
