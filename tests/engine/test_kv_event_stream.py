"""The KV event stream: the router's PUB socket (`KVEventPublisher`), `KVEventSubscriber`, and
what the router publishes (engines' `KVEvents`, its own store's releases), driven in-process."""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import pytest
import zmq

from dualpath_jax.config import ClusterConfig, ConfigError, ExperimentConfig, Policy, StoreConfig
from dualpath_jax.kv_events import (
    EVENTS_VERSION,
    TOPIC,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFormatError,
    KVEventSubscriber,
    StoredBlocks,
    encode_batch,
)
from dualpath_jax.kvstore.identity import block_keys
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.model.layout import kv_to_full_blocks
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.router.kv_publisher import KVEventPublisher, check_events_bind
from dualpath_jax.router.router import Router
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.wire import frames, messages
from dualpath_jax.wire.rpc import RpcServer

WAIT_MS = 5_000  # loopback frames arrive in microseconds; this only bounds a broken test
BT = 16


def stored(*keys: str) -> BlockStored:
    return BlockStored(keys=keys, block_tokens=BT, block_bytes=4096)


def key(i: int) -> str:
    return f"{i:032x}"


def attach(pub: KVEventPublisher, sub: KVEventSubscriber) -> int:
    """Publishes probe batches until `sub` receives one (a subscription takes effect a moment
    after the connection is up), drains the rest, and returns the next batch's `seq`."""
    assert sub.wait_connected(WAIT_MS)
    for _ in range(200):
        pub.post("probe", [stored(key(0))])
        pub.flush()
        if sub.recv(20) is not None:
            break
    else:
        raise AssertionError("the subscriber never received a probe")
    while sub.recv(20) is not None:
        pass
    return pub.seq


@pytest.fixture
def stream():
    pub = KVEventPublisher("tcp://127.0.0.1:0", wall_clock=lambda: 1234.5)
    sub = KVEventSubscriber(pub.address)
    yield pub, sub
    sub.close()
    pub.close()


def test_every_posted_list_is_one_numbered_batch_in_post_order(stream):
    pub, sub = stream
    first = attach(pub, sub)
    # Posts from several threads (as the router's store I/O threads do), flushed by one.
    threads = [
        threading.Thread(target=pub.post, args=(f"t{i}", [stored(key(i))])) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pub.post("de1", [BlockRemoved(keys=(key(1),), reason="evicted"), stored(key(9))])
    pub.post("de1", [])  # nothing to say: no batch
    assert pub.flush() == 9
    got = [sub.recv(WAIT_MS) for _ in range(9)]
    assert [b.seq for b in got] == list(range(first, first + 9))
    assert all(b.v == EVENTS_VERSION and b.ts == 1234.5 for b in got)
    assert sorted(b.source for b in got[:8]) == [f"t{i}" for i in range(8)]
    assert got[8].source == "de1" and got[8].events == (
        BlockRemoved(keys=(key(1),), reason="evicted"),
        stored(key(9)),
    )
    assert sub.recv(0) is None and sub.missed == 0 and sub.restarts == 0


def test_only_the_event_topic_is_subscribable(stream):
    """Subscriptions to anything but a prefix of the topic are dropped by the publisher (its
    subscription table stays bounded); the real subscriber, and one to the empty prefix, still
    get every batch."""
    pub, sub = stream
    ctx = zmq.Context.instance()
    junk = ctx.socket(zmq.SUB)
    junk.setsockopt(zmq.LINGER, 0)
    for i in range(500):
        junk.setsockopt(zmq.SUBSCRIBE, f"junk-{i}-".encode() * 50)
    every = ctx.socket(zmq.SUB)
    every.setsockopt(zmq.LINGER, 0)
    every.setsockopt(zmq.SUBSCRIBE, b"")
    junk.connect(pub.address)
    every.connect(pub.address)
    try:
        first = attach(pub, sub)
        for _ in range(200):  # until the empty-prefix subscriber and the junk have arrived
            pub.post("probe", [stored(key(0))])
            pub.flush()
            if every.poll(20) and pub.refused == 500:
                break
        assert pub.refused == 500
        while every.poll(20):
            every.recv_multipart()
        while sub.recv(20) is not None:
            pass
        pub.post("de0", [stored(key(5))])
        pub.flush()
        assert sub.recv(WAIT_MS).source == "de0"
        assert every.poll(WAIT_MS) and every.recv_multipart()[0] == TOPIC
        assert junk.poll(100) == 0  # its topics match nothing, and none were applied
        assert pub.seq > first
    finally:
        junk.close()
        every.close()


def test_a_subscriber_counts_lost_batches_and_restarts():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")

    def send(seq: int) -> None:
        batch = EventBatch(v=EVENTS_VERSION, seq=seq, ts=0.0, source="router", events=())
        pub.send_multipart([TOPIC, encode_batch(batch)])

    try:
        assert sub.wait_connected(WAIT_MS)
        for _ in range(200):  # until the subscription has taken effect
            send(0)
            if sub.recv(20) is not None:
                break
        while sub.recv(20) is not None:
            pass
        for seq in (1, 2, 5, 6, 0, 1):  # 3 and 4 lost; then a new publisher
            send(seq)
        assert [sub.recv(WAIT_MS).seq for _ in range(6)] == [1, 2, 5, 6, 0, 1]
        assert (sub.missed, sub.restarts) == (2, 1)
        pub.send_multipart([TOPIC, b"\x01\x02"])
        with pytest.raises(EventFormatError):
            sub.recv(WAIT_MS)
    finally:
        sub.close()
        pub.close(0)


def test_the_stream_binds_to_loopback_unless_the_cluster_has_secrets():
    for host in ("127.0.0.1", "::1", "localhost"):
        check_events_bind(host, None)
    tokens = {"engine": "e" * 24, "client": "c" * 24}
    for host in ("0.0.0.0", "10.213.0.2", "fd00:213::2"):
        with pytest.raises(ConfigError, match=f"KV events on '{host}' .* needs cluster.secrets"):
            check_events_bind(host, None)
        check_events_bind(host, tokens)
    with pytest.raises(ConfigError, match="cluster.kv_events_address: .* is not a tcp://HOST:PORT"):
        KVEventPublisher("ipc:///tmp/kv")


@pytest.mark.parametrize(
    "address, ok",
    [
        ("", True),
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.0.0.1:0", True),
        ("tcp://[::1]:5557", True),
        ("tcp://localhost:5557", True),
        ("127.0.0.1:5557", False),
        ("tcp://::1:5557", False),
        ("tcp://127.0.0.1", False),
        ("tcp://127.0.0.1:70000", False),
        ("udp://127.0.0.1:5557", False),
    ],
)
def test_the_address_is_validated_with_the_config(address, ok):
    from dualpath_jax.config import validate

    cfg = ExperimentConfig(cluster=ClusterConfig(kv_events_address=address))
    if ok:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match="cluster.kv_events_address: "):
            validate(cfg)


# ----------------------------------------------------------------------------- the router


@dataclasses.dataclass
class Rig:
    router: Router
    sent: list[tuple[bytes, messages.Msg]]
    pub: KVEventPublisher
    sub: KVEventSubscriber
    first: int = 0  # the seq of the first batch after the probes

    def handle(
        self, msg: messages.Msg, ident: bytes = b"c1", role: str = frames.ENGINE
    ) -> list[messages.Msg]:
        """What the router sent, session retention (`Retain`) left out."""
        self.sent.clear()
        self.router.handle(ident, msg, role)
        return [m for _, m in self.sent if not isinstance(m, messages.Retain)]

    def batches(self) -> list[EventBatch]:
        out = []
        while (b := self.sub.recv(50)) is not None:
            out.append(b)
        return out


@pytest.fixture
def rig(monkeypatch):
    cfg = ExperimentConfig(
        model=TINY_QWEN2,
        store=StoreConfig(kind="memory", block_tokens=BT),
        cluster=ClusterConfig(decode_max_len=64, kv_events_address="tcp://127.0.0.1:0"),
    )
    server = RpcServer("127.0.0.1", 0)
    pub = KVEventPublisher(cfg.cluster.kv_events_address)
    store = open_block_store(cfg.store, cfg.model, on_events=functools.partial(pub.post, "router"))
    router = Router(
        cfg,
        server,
        store,
        GlobalScheduler(Policy.DUALPATH),
        clock=lambda: 0.0,
        kv_events=pub,
        store_wait_s=60.0,
    )
    sent: list[tuple[bytes, messages.Msg]] = []
    monkeypatch.setattr(server, "send", lambda ident, msg: sent.append((ident, msg)))
    sub = KVEventSubscriber(pub.address)
    r = Rig(router, sent, pub, sub)
    r.first = attach(pub, sub)
    for role, engine in (("prefill", 0), ("decode", 1)):
        reg = messages.Register(
            role=role, engine=engine, node=engine, group=0, address=f"inproc://{engine}", pid=9
        )
        r.handle(reg, ident=f"e{engine}".encode())
    yield r
    sub.close()
    server.close()
    store.close()
    pub.close()


def test_engine_events_are_published_in_arrival_order_named_after_the_engine(rig):
    de = [stored(key(1), key(2)), BlockRemoved(keys=(key(7),), reason="evicted")]
    assert rig.handle(messages.KVEvents(engine=1, events=de), ident=b"e1") == []
    pe = [BlockRemoved(keys=(key(3),), reason="corrupt")]
    rig.handle(messages.KVEvents(engine=0, events=pe), ident=b"e0")
    got = rig.batches()
    assert [(b.seq, b.source, list(b.events)) for b in got] == [
        (rig.first, "de1", de),
        (rig.first + 1, "pe0", pe),
    ]
    assert rig.router.stats()["kv_events"] == {
        "address": rig.pub.address,
        "batches": rig.first + 2,
        "refused_subscriptions": 0,
    }


def test_only_registered_engines_on_their_own_connection_publish(rig):
    msg = messages.KVEvents(engine=1, events=[stored(key(1))])
    (err,) = rig.handle(msg, ident=b"c9", role=frames.CLIENT)
    assert err.kind == "auth" and "needs the engine secret" in err.message
    (err,) = rig.handle(msg, ident=b"e0")  # engine 0's connection naming engine 1
    assert err.kind == "auth"
    rig.handle(
        messages.KVEvents(engine=5, events=[stored(key(1))]), ident=b"e5"
    )  # never registered
    assert rig.batches() == []


def test_a_release_publishes_its_removals_before_the_ack(rig, monkeypatch):
    """The session's blocks, written (by the router's store here) and claimed, are released:
    the stream says stored, then released, before the client has its Ack; the index built from
    it is empty again."""
    router = rig.router
    flush = rig.pub.flush

    def noted_flush() -> int:
        n = flush()
        if n:
            rig.sent.append((b"", f"published {n}"))
        return n

    monkeypatch.setattr(rig.pub, "flush", noted_flush)
    assert rig.handle(messages.OpenSession(session="a")) == [messages.Ack(ref="a")]
    prompt = list(range(3 * BT))
    keys = block_keys(prompt, BT, router.params.fingerprint)
    width = TINY_QWEN2.kv_width
    blocks = kv_to_full_blocks(np.zeros((TINY_QWEN2.num_layers, 3 * BT, width), np.float32), BT)
    router.store.write_full(keys, blocks).result(10)
    router.store.claim("a", keys)
    index = StoredBlocks()
    assert rig.handle(messages.CloseSession(session="a", release=True)) == [
        "published 2",
        messages.Ack(ref="a"),
    ]
    got = rig.batches()
    index.apply_all(got)
    assert [b.source for b in got] == ["router", "router"]
    (st,), (rm,) = got[0].events, got[1].events
    assert st == BlockStored(
        keys=tuple(keys), block_tokens=BT, block_bytes=router.store.fmt.encoded_bytes
    )
    assert rm.reason == "released" and sorted(rm.keys) == sorted(keys)
    assert len(index) == 0 and rig.sub.missed == 0
