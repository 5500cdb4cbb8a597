"""The control plane: msgspec messages in a versioned, token-carrying envelope; the ZeroMQ
ROUTER/DEALER transport; and the router's validation of client requests (driven in-process,
without engines)."""

from __future__ import annotations

import dataclasses
import pickle
import socket
import typing

import msgspec
import numpy as np
import pytest

from dualpath_jax.config import ClusterConfig, ConfigError, ExperimentConfig, Policy, StoreConfig
from dualpath_jax.kv_events import BlockRemoved, BlockStored
from dualpath_jax.kvstore.identity import block_keys
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.model.layout import kv_to_full_blocks
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.results import Logprobs
from dualpath_jax.router.router import Router
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.wire import frames, messages, rpc
from dualpath_jax.wire.rpc import RpcClient, RpcServer, check_bind

WAIT_MS = 5_000  # loopback frames arrive in microseconds; this only bounds a broken test

_JOB = messages.LoadJobMsg(
    request="r1", keys=["k0", "k1"], pe_blocks=1, de_blocks=1, prompt=[1, 2, 3], gen=4,
    pe_engine=0, pe_node=0, pe_address="inproc://pe0", de_engine=1, de_node=1,
    de_address="inproc://de1", oracle=False, layerwise=True, params_version="v1", attempt=2,
)  # fmt: skip

SAMPLES: list[messages.Msg] = [
    messages.OpenSession(session="s1"),
    messages.OpenSession(session="s1", resume=True),
    messages.OpenSession(session="s2", priority=-3, ttl_s=12.5),
    messages.CancelRound(request="r1"),
    messages.Ping(),
    messages.DeReady(request="r1", engine=1, attempt=2),
    messages.CloseSession(session="s1", release=True),
    messages.Submit(
        request="r1",
        session="s1",
        append=[1, 2, 3],
        gen=4,
        sampling=SamplingParams(temperature=0.7, top_p=0.5, seed=2**32 - 1),
    ),
    messages.Submit(
        request="r2", session="s1", append=[4], gen=8, keep=2, stop_tokens=[0, 7], stream=True
    ),
    messages.FinishRound(request="r1"),
    messages.Partial(rounds=[messages.RoundTokens(request="r1", start=1, tokens=[6, 7])]),
    messages.RoundResult(
        request="r1",
        tokens=[5, 6],
        ttft_s=0.5,
        ttst_s=0.25,
        tpot_s=0.125,
        jct_s=1.0,
        queue_s=0.0625,
        cached_tokens=16,
        prompt_tokens=20,
        read_path="split",
        recomputed_blocks=1,
        finish_reason="stop",
        persist_error="store full",
        submit_s=12.5,
    ),
    messages.Ack(ref="s1"),
    messages.AbortRounds(ref="abort:1", requests=["r1"], sessions=["s2"]),
    messages.AbortRounds(ref="abort:2", all=True),
    messages.Aborted(ref="abort:1", requests=["r1"]),
    messages.Pause(ref="pause:1", mode="abort"),
    messages.Resume(ref="resume:1"),
    messages.Partial(
        rounds=[
            messages.RoundTokens(
                request="r1",
                start=1,
                tokens=[4],
                logprobs=Logprobs(
                    sampled=[-0.5], model=[-0.75], top_ids=[[4, 2]], top=[[-0.75, -1.0]]
                ),
            ),
            messages.RoundTokens(request="r2", start=0, tokens=[8]),
        ]
    ),
    messages.Error(ref="r1", message="boom", kind="frame"),
    messages.GetStats(),
    messages.Stats(json='{"counters": {}}'),
    messages.UpdateParams(version="v2", path="/ckpt/v2"),
    messages.Shutdown(),
    messages.Load(seq_e=1, tok_e=2, read_q=3, hbm_capacity_tokens=4, slots=5),
    messages.Register(
        role="prefill",
        engine=0,
        node=1,
        group=2,
        address="inproc://pe0",
        pid=1234,
        params_version="v1",
    ),
    messages.PrefillCost(prefill=(0.02, 2e-5, 5e-9), calibrated=False),
    messages.Register(
        role="prefill",
        engine=0,
        node=1,
        group=2,
        address="inproc://pe0",
        pid=1234,
        prefill_cost=messages.PrefillCost(
            prefill=(0.005, 1e-5, 2e-7),
            calibrated=True,
            calibration_s=1.25,
            samples=[(0, 16, 0.004), (496, 256, 0.04)],
        ),
    ),
    messages.LoadParams(version="v2", path="/ckpt/v2"),
    messages.ParamsLoaded(engine=1, version="v2", ok=False, message="shape mismatch"),
    messages.CommitParams(version="v2", commit=True),
    messages.Heartbeat(engine=3),
    messages.Fetch(engine=0, load=messages.Load(read_q=7), links='{"h2d": 1}'),
    _JOB,
    messages.Work(jobs=[_JOB, msgspec.structs.replace(_JOB, request="r2", attempt=0)]),
    messages.PrefillDone(
        request="r1",
        engine=0,
        first_token=9,
        hit_blocks=2,
        recomputed_blocks=1,
        read_s=0.01,
        prefill_s=0.02,
    ),
    messages.ReadsDone(request="r1", engine=0, attempt=1),
    messages.FirstToken(request="r1", token=9, hit_blocks=2),
    messages.FirstToken(request="r1", token=9, hit_blocks=2, forks=[_JOB]),
    messages.FirstToken(
        request="r1", token=9, hit_blocks=2, logprobs=Logprobs(sampled=[-0.1], model=[-0.2])
    ),
    messages.TokensOut(rounds=[messages.RoundTokens(request="r1", start=0, tokens=[9, 10])]),
    messages.TokensOut(
        rounds=[
            messages.RoundTokens(request="r1", start=2, tokens=[11]),
            messages.RoundTokens(
                request="r2", start=1, tokens=[3], logprobs=Logprobs(sampled=[-0.1], model=[-0.2])
            ),
        ]
    ),
    messages.DecodeDone(request="r1", engine=1, tokens=[9, 10], persisted_blocks=3),
    messages.DecodeDone(
        request="r1", engine=1, tokens=[9], persisted_blocks=0, persist_error="OSError: ENOSPC"
    ),
    messages.KVEvents(
        engine=1,
        events=[
            BlockRemoved(keys=("a" * 32,), reason="evicted"),
            BlockStored(keys=("b" * 32, "c" * 32), block_tokens=16, block_bytes=4096),
        ],
    ),
    messages.Failed(request="r1", engine=1, message="peer vanished", kind="transfer", attempt=3),
    messages.Cancel(request="r1"),
    messages.Finish(request="r1"),
    messages.Finish(request="r1", reason="abort"),
    messages.PauseDecode(paused=True),
    messages.DecodeDone(
        request="r1",
        engine=1,
        tokens=[9, 10, 11],
        persisted_blocks=1,
        params_versions=[(0, "v1"), (2, "v2")],
    ),
    messages.Stop(),
    messages.Retain(session="s1", state="idle", priority=2, ttl_s=30.0),
    messages.ToolCall(session="s1", expected_s=12.5),
    messages.Prefetch(session="s1", keys=["ab" * 16], epoch=3),
    messages.DropPrefetch(session="s1", epoch=3),
    messages.Prefetched(engine=2, session="s1", epoch=3, blocks=1, read_s=0.01),
    messages.ReadsDone(request="r1", engine=2, attempt=1, read_s=0.2, held_blocks=4),
]


# ----------------------------------------------------------------------------- messages


def test_samples_cover_every_message_type():
    body_types = set(typing.get_args(messages.Body))
    assert {type(m) for m in SAMPLES} == body_types
    # No message type outside the union; the round record is one without the base (results.py).
    assert set(messages.Msg.__subclasses__()) | {messages.RoundResult} == body_types


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("token", ["", "sekrit"])
def test_every_message_round_trips(msg, token):
    got = frames.decode(frames.encode(msg, token), token)
    assert type(got) is type(msg)
    assert got == msg


def test_the_wire_format_is_plain_msgpack_data():
    frame = frames.encode(messages.Submit(request="r1", session="s1", append=[1, 2], gen=3), "t")
    assert msgspec.msgpack.decode(frame) == {
        "v": frames.SCHEMA_VERSION,
        "token": "t",
        "body": {
            "type": "Submit",
            "request": "r1",
            "session": "s1",
            "append": [1, 2],
            "gen": 3,
            "sampling": {},  # greedy: every field at its default
            "keep": -1,
            "stop_tokens": [],
            "stream": False,
            "priority": None,
            "ttl_s": None,
            "follows": "",
        },
    }


def test_wrong_or_missing_token_is_rejected():
    msg = messages.GetStats()
    with pytest.raises(frames.FrameError, match="authentication failed: wrong or missing token"):
        frames.decode(frames.encode(msg, "guess"), "sekrit")
    with pytest.raises(frames.FrameError, match="authentication failed"):
        frames.decode(frames.encode(msg, ""), "sekrit")
    with pytest.raises(frames.FrameError, match="authentication failed"):  # an unexpected token too
        frames.decode(frames.encode(msg, "sekrit"), "")


def test_the_token_is_checked_before_the_body_is_decoded():
    """A stranger's frame is refused on its token: its body (here one no schema accepts, and a
    large one) is never built."""
    frame = msgspec.msgpack.encode(
        {"v": frames.SCHEMA_VERSION, "token": "guess",
         "body": {"type": "RunShell", "junk": ["x" * 100] * 10_000}}
    )  # fmt: skip
    with pytest.raises(frames.AuthError):
        frames.decode(frame, "sekrit")
    with pytest.raises(frames.AuthError):
        frames.decode_role(frame, {"client": "sekrit", "engine": "other"})
    with pytest.raises(frames.FrameError, match="malformed message"):  # the right token
        frames.decode(frame.replace(b"guess", b"abcde"), "abcde")


def test_other_schema_version_is_rejected():
    frame = msgspec.msgpack.encode(frames.Envelope(frames.SCHEMA_VERSION + 1, "", messages.Ack()))
    want = f"schema version {frames.SCHEMA_VERSION + 1} is not supported \\(this side speaks {frames.SCHEMA_VERSION}\\)"
    with pytest.raises(frames.FrameError, match=want):
        frames.decode(frame)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"v": frames.SCHEMA_VERSION, "token": ""}),
    ],  # fmt: skip
    ids=["empty", "reserved-byte", "text", "array", "no-body"],
)
def test_garbage_is_rejected(frame):
    with pytest.raises(frames.FrameError, match="^malformed message: "):
        frames.decode(frame)


def test_unknown_tag_is_rejected():
    frame = msgspec.msgpack.encode(
        {"v": frames.SCHEMA_VERSION, "token": "", "body": {"type": "RunShell"}}
    )
    with pytest.raises(frames.FrameError, match="malformed message: .*'RunShell'.*body"):
        frames.decode(frame)


def test_wrong_field_type_is_rejected():
    frame = msgspec.msgpack.encode(
        {"v": frames.SCHEMA_VERSION, "token": "", "body": {"type": "Submit", "request": "r",
                                                      "session": "s", "append": "abc", "gen": 1}}
    )  # fmt: skip
    with pytest.raises(frames.FrameError, match="malformed message: .*append"):
        frames.decode(frame)


def test_oversized_frame_is_rejected_before_parsing():
    with pytest.raises(
        frames.FrameError,
        match=f"frame of {frames.MAX_FRAME_BYTES + 1} bytes exceeds the {frames.MAX_FRAME_BYTES}-byte limit",
    ):
        frames.decode(bytes(frames.MAX_FRAME_BYTES + 1))
    frames.decode(frames.encode(messages.Ack(ref="x" * 1000)))  # a normal frame is far below it


def test_a_valid_message_over_the_limit_is_rejected_too(monkeypatch):
    frame = frames.encode(messages.Submit(request="r", session="s", append=list(range(100)), gen=1))
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", len(frame) - 1)
    with pytest.raises(frames.FrameError, match="exceeds the"):
        frames.decode(frame)


_unpickled: list[str] = []


def _tripwire(what: str) -> None:
    _unpickled.append(what)


class _Payload:
    """Runs `_tripwire` if anything ever unpickles it."""

    def __reduce__(self):
        return (_tripwire, ("unpickled",))


def test_frames_are_never_unpickled():
    pickled = [
        pickle.dumps(_Payload()),
        pickle.dumps(frames.Envelope(frames.SCHEMA_VERSION, "", messages.Ack())),
    ]
    for frame in pickled:
        with pytest.raises(frames.FrameError, match="malformed message"):
            frames.decode(frame)
    assert _unpickled == []
    pickle.loads(pickled[0])  # the payload is live: unpickling it would have run the tripwire
    assert _unpickled == ["unpickled"]
    _unpickled.clear()
    assert not frames.encode(messages.Ack()).startswith(b"\x80")  # not a pickle protocol header


# ----------------------------------------------------------------------------- transport


def test_check_bind_requires_secrets_off_loopback():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        check_bind(host, {})
    for host in ("0.0.0.0", "10.1.2.3", "::", "node7.cluster"):
        with pytest.raises(
            ConfigError,
            match=f"binding the control plane to '{host}' .*needs cluster.secrets_file",
        ):
            check_bind(host, {})
        check_bind(host, {"engine": "sekrit"})


def test_server_refuses_a_non_loopback_host_without_secrets_before_binding(monkeypatch):
    monkeypatch.setattr(rpc, "zmq", None)  # any socket use would fail with AttributeError
    with pytest.raises(ConfigError, match="needs cluster.secrets_file"):
        RpcServer("0.0.0.0", 0, tokens={})


@pytest.fixture()
def server():
    srv = RpcServer("127.0.0.1", 0)
    yield srv
    srv.close()


def answered(server: RpcServer, client: RpcClient, role: str) -> None:
    """A `GetStats` from `client` reaches `server` as a `role` message (by the secret it
    carried), and the `Stats` answer reaches `client` alone."""
    client.send(messages.GetStats())
    ident, msg, got = server.recv(WAIT_MS)
    assert (msg, got) == (messages.GetStats(), role)
    server.send(ident, messages.Stats(json="{}"))
    assert client.recv(WAIT_MS) == messages.Stats(json="{}")


def test_client_server_call(server):
    client = RpcClient(server.address, identity=b"client-1")
    try:
        client.send(messages.OpenSession(session="s1"))
        got = server.recv(WAIT_MS)
        assert got == (b"client-1", messages.OpenSession(session="s1"), frames.ENGINE)
        server.send(got[0], messages.Ack(ref="s1"))
        assert client.recv(WAIT_MS) == messages.Ack(ref="s1")
    finally:
        client.close()


@pytest.mark.ipv6
@pytest.mark.parametrize("port", [0, "free"])
def test_an_ipv6_address_is_bracketed_in_urls_and_serves(port):
    """`cluster.host` may be an IPv6 literal (a ULA address on the cluster's network): the
    server binds `tcp://[v6]:port`, says so in its address, and clients connect to that."""
    if port == "free":
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    server = RpcServer("::1", port, tokens={"engine": "e" * 16, "client": "c" * 16})
    client = RpcClient(server.address, "c" * 16)
    try:
        assert server.address.startswith("tcp://[::1]:")
        assert port == 0 or server.address == f"tcp://[::1]:{port}"
        answered(server, client, frames.CLIENT)
    finally:
        client.close()
        server.close()


def test_server_answers_a_bad_frame_with_error_and_keeps_serving(server):
    bad, good = RpcClient(server.address), RpcClient(server.address)
    try:
        bad.sock.send(b"\xc1 garbage")
        assert server.recv(WAIT_MS) is None and server.rejected == 1
        reply = bad.recv(WAIT_MS)
        assert isinstance(reply, messages.Error) and reply.kind == "frame" and reply.ref == ""
        assert reply.message.startswith("malformed message")

        bad.sock.send(msgspec.msgpack.encode(frames.Envelope(99, "", messages.GetStats())))
        assert server.recv(WAIT_MS) is None and server.rejected == 2
        assert bad.recv(WAIT_MS).message.startswith("schema version 99 is not supported")

        answered(server, good, frames.ENGINE)
        assert bad.recv(50) is None  # the good client's answer went to it alone
    finally:
        bad.close()
        good.close()


def test_token_server_rejects_wrong_token_and_never_reveals_its_token():
    srv = RpcServer("127.0.0.1", 0, tokens={"engine": "sekrit", "client": "public"})
    intruder = RpcClient(srv.address, token="guess")
    member = RpcClient(srv.address, token="sekrit")
    user = RpcClient(srv.address, token="public")
    try:
        intruder.send(messages.GetStats())
        assert srv.recv(WAIT_MS) is None and srv.rejected == 1
        assert intruder.poller.poll(WAIT_MS)
        raw = intruder.sock.recv()
        assert b"sekrit" not in raw and b"public" not in raw  # no token goes to strangers
        err = frames.decode(raw, "")
        assert isinstance(err, messages.Error) and err.kind == "auth"
        assert "authentication failed" in err.message

        member.sock.send(b"\xc1 garbage")  # a member's bad frame: its answer is tokenless too
        assert srv.recv(WAIT_MS) is None and srv.rejected == 2
        err = member.recv(WAIT_MS)  # a tokenless Error is the one unsigned thing it accepts
        assert isinstance(err, messages.Error) and err.kind == "frame" and err.ref == ""
        forged = frames.encode(messages.Ack(ref="forged"), "")
        user.sock.send(frames.encode(messages.GetStats(), "public"))
        ident, msg, role = srv.recv(WAIT_MS)
        assert (msg, role) == (messages.GetStats(), frames.CLIENT)
        srv.send(
            ident, messages.Stats(json="{}")
        )  # a client's answers carry the client secret only
        assert user.poller.poll(WAIT_MS)
        raw = user.sock.recv()
        assert b"sekrit" not in raw and frames.decode(raw, "public") == messages.Stats(json="{}")
        srv.sock.send_multipart([ident, forged])
        with pytest.raises(frames.FrameError, match="authentication failed"):
            user.recv(WAIT_MS)

        answered(srv, member, frames.ENGINE)
    finally:
        intruder.close()
        member.close()
        user.close()
        srv.close()


def test_unencodable_and_oversized_messages_never_leave(monkeypatch):
    with pytest.raises(frames.FrameError, match="cannot encode Submit"):
        frames.encode(messages.Submit(request="r", session="s", append=[2**64], gen=1))
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 100)
    with pytest.raises(frames.FrameError, match="Submit of .* bytes exceeds the 100-byte limit"):
        frames.encode(messages.Submit(request="r", session="s", append=list(range(100)), gen=1))


# ----------------------------------------------------------------------------- router validation

BT = 16
LIMIT = 64  # cluster.decode_max_len, below the model's max_seq_len


@dataclasses.dataclass
class RouterRig:
    router: Router
    sent: list[tuple[bytes, messages.Msg]]

    def handle(self, msg: messages.Msg, ident: bytes = b"c1") -> list[messages.Msg]:
        """Handles one message; returns what the router sent back (to anyone)."""
        self.sent.clear()
        self.router.handle(ident, msg)
        return [m for _, m in self.sent]


@pytest.fixture()
def rig(monkeypatch):
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        store=StoreConfig(kind="memory", block_tokens=BT),
        cluster=ClusterConfig(decode_max_len=LIMIT),
    )
    server = RpcServer("127.0.0.1", 0)
    store = open_block_store(cfg.store, cfg.model)
    router = Router(
        cfg, server, store, GlobalScheduler(Policy.DUALPATH), clock=lambda: 0.0, store_wait_s=60.0
    )
    sent: list[tuple[bytes, messages.Msg]] = []
    monkeypatch.setattr(server, "send", lambda ident, msg: sent.append((ident, msg)))
    r = RouterRig(router, sent)
    for s in ("a", "b"):
        assert r.handle(messages.OpenSession(session=s)) == [messages.Ack(ref=s)]
    yield r
    server.close()
    store.close()


V = TINY_QWEN2.vocab_size


@pytest.mark.parametrize(
    "submit, problem",
    [
        (messages.Submit(request="r1", session="nope", append=[1], gen=1), "unknown session 'nope'"),
        (messages.Submit(request="r1", session="a", append=[1, V], gen=1), f"token id {V} is out of range \\[0, {V}\\)"),
        (messages.Submit(request="r1", session="a", append=[-1, 2], gen=1), f"token id -1 is out of range \\[0, {V}\\)"),
        (messages.Submit(request="r1", session="a", append=[1] * 60, gen=5), f"context of 60 \\+ 5 tokens exceeds the limit of {LIMIT}"),
        (messages.Submit(request="r1", session="a", append=[1], gen=0), "gen must be > 0, got 0"),
        (messages.Submit(request="r1", session="a", append=[1], gen=-3), "gen must be > 0, got -3"),
        (messages.Submit(request="r1", session="a", append=[], gen=1), "a round must append at least one token"),
    ],
    ids=["unknown-session", "token-too-big", "token-negative", "over-limit", "gen-0", "gen-negative", "empty-append"],
)  # fmt: skip
def test_bad_submit_is_refused_naming_the_problem(rig, submit, problem):
    (err,) = rig.handle(submit)
    assert isinstance(err, messages.Error) and err.ref == "r1" and err.kind == "bad_request"
    assert err.message == problem.replace("\\", "")
    assert len(rig.router.scheduler) == 0 and rig.router.rounds.table.requests == {}
    assert rig.router.stats()["counters"]["errors"] == 1
    # Nothing was left behind: the session takes a valid round afterwards.
    assert rig.handle(messages.Submit(request="r2", session="a", append=[1, 2], gen=1)) == []
    assert len(rig.router.scheduler) == 1


def test_valid_submit_is_queued_without_reply(rig):
    assert (
        rig.handle(messages.Submit(request="r1", session="a", append=[3] * 60, gen=4)) == []
    )  # == limit
    assert rig.router.scheduler.queued() == {
        "de_global": 1,
        "de_private": 0,
        "pe_waiting": 0,
        "pe_pinned": 0,
    }
    st = rig.router.rounds.table.requests["r1"]
    assert st.prompt == [3] * 60 and st.gen == 4 and st.client == b"c1"
    assert (
        st.request.id,
        st.request.prompt_tokens,
        st.request.cached_tokens,
        st.request.gen_tokens,
    ) == ("r1", 60, 0, 4)
    assert rig.router.rounds.table["a"].busy


def test_duplicate_request_id_and_busy_session_are_refused(rig):
    assert rig.handle(messages.Submit(request="r1", session="a", append=[1], gen=1)) == []
    (err,) = rig.handle(messages.Submit(request="r1", session="b", append=[1], gen=1))
    assert err.kind == "bad_request" and err.message == "duplicate request id 'r1'"
    (err,) = rig.handle(messages.Submit(request="r2", session="a", append=[1], gen=1))
    assert err.message == "session 'a' already has a round running"
    assert len(rig.router.scheduler) == 1 and list(rig.router.rounds.table.requests) == ["r1"]


def test_stored_prefix_becomes_the_cached_tokens(rig):
    """The hit is the stored prefix in whole blocks, keeping at least one new token."""
    router = rig.router
    prompt = list(range(2 * BT))  # exactly two blocks, both stored
    keys = block_keys(prompt, BT, router.params.fingerprint)
    width = TINY_QWEN2.kv_width
    blocks = kv_to_full_blocks(np.zeros((TINY_QWEN2.num_layers, 2 * BT, width), np.float32), BT)
    router.store.write_full(keys, blocks).result(10)
    assert rig.handle(messages.Submit(request="r1", session="a", append=prompt, gen=1)) == []
    rounds = router.rounds.table.requests
    assert rounds["r1"].request.cached_tokens == BT  # not 2 * BT: one block recomputed
    assert rig.handle(messages.Submit(request="r2", session="b", append=prompt + [7], gen=1)) == []
    assert rounds["r2"].request.cached_tokens == 2 * BT


def test_close_session(rig):
    assert rig.handle(messages.CloseSession(session="a")) == [messages.Ack(ref="a")]
    (err,) = rig.handle(messages.CloseSession(session="a"))
    assert err == messages.Error(ref="a", message="unknown session 'a'")


def test_router_over_the_wire(rig, monkeypatch):
    """A client's Submit reaches `Router.handle` through the real server; the Error comes back."""
    server = rig.router.server
    monkeypatch.undo()  # the real send again
    client = RpcClient(server.address)
    try:
        client.send(messages.Submit(request="r9", session="nope", append=[1], gen=1))
        ident, msg, role = server.recv(WAIT_MS)
        rig.router.handle(ident, msg, role)
        assert client.recv(WAIT_MS) == messages.Error(
            ref="r9", message="unknown session 'nope'", kind="bad_request"
        )
    finally:
        client.close()


def test_transfer_bind_is_loopback_or_private_unless_asked_for():
    from dualpath_jax.wire.rpc import check_transfer_bind

    for ok in ("127.0.0.1", "::1", "10.213.0.3", "fd00:213::3"):
        check_transfer_bind(ok, False)
    for bad, says in [
        ("0.0.0.0", "a wildcard address"),
        ("8.8.8.8", "a non-private address"),
        ("pe-0.cluster.example", "a host name, not an IP address"),
    ]:
        with pytest.raises(ConfigError, match=says):
            check_transfer_bind(bad, False)
        check_transfer_bind(bad, True)  # asked for: a warning, no error
