"""The router's KV event stream: one ZeroMQ PUB socket (`cluster.kv_events_address`).

Every store of the cluster reports what it did (dualpath_jax/kv_events.py): the router's own store
calls `post` from its I/O threads, engines' reports arrive as `KVEvents` messages. The router's
loop, which owns the socket, publishes them with `flush`, each posted list as one `EventBatch`
numbered from 0 in the order posted, so a subscriber sees one totally ordered stream and can
detect the batches it lost (docs/kv_events.md).

`KVEventRelay` is the router's KV events part: it handles the engines' `KVEvents` (published at
once, named after the engine) and publishes whatever else was posted when the router's loop asks
(`publish`: after every message, and wherever an answer must follow its events, e.g. a release's
`BlockRemoved` before its `Ack`). Without a publisher it drops them.

Subscriptions are the publisher's to accept (an XPUB socket in manual mode): only prefixes of
`TOPIC` (`kv`, and the empty prefix) are applied, so a subscriber cannot grow the publisher's
subscription table, or the cost of matching each batch, by sending other topics; those are
counted and dropped. Subscription messages wait in the socket (at most its receive high-water
mark) until the router's loop next publishes.

Binding: loopback unless the cluster has its secrets (`cluster.secrets_file`), as the control
plane. The stream itself is neither authenticated nor encrypted (a subscriber reads block keys,
never tokens or KV, and cannot send anything but subscriptions): off loopback, keep it on the
cluster's own network.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence

import zmq

from dualpath_jax.config import ConfigError, parse_endpoint
from dualpath_jax.kv_events import EVENTS_VERSION, TOPIC, EventBatch, KVEvent, encode_batch
from dualpath_jax.router.liveness import EngineRegistry
from dualpath_jax.wire import messages
from dualpath_jax.wire.rpc import bracketed, host_port, is_loopback

log = logging.getLogger(__name__)

SEND_HWM = 100_000  # batches queued per subscriber before ZeroMQ drops that subscriber's next ones
SUBSCRIPTION_HWM = 1_000  # subscription messages waiting for the router's loop
LINGER_MS = 1_000  # at close, how long batches still queued may take to leave


def check_events_bind(host: str, tokens: Mapping[str, str] | None) -> None:
    """A KV event stream off loopback needs the cluster's secrets, as the control plane does."""
    if is_loopback(host):
        return
    if not tokens:
        raise ConfigError(
            f"publishing KV events on {host!r} (not loopback) needs cluster.secrets_file"
        )
    log.warning(
        "KV events are published on %s: the stream is unauthenticated and unencrypted (block "
        "keys only); keep that network closed to anything but this cluster",
        host,
    )


class KVEventPublisher:
    """The PUB socket. `post` may be called from any thread; `flush` and `close` only from the
    thread that owns the socket (the router's loop). `address` is where it listens (a port 0
    resolved); `seq` is the number of the next batch."""

    def __init__(
        self,
        address: str,
        tokens: Mapping[str, str] | None = None,
        wall_clock: Callable[[], float] = time.time,
        context: zmq.Context | None = None,
    ):
        try:
            host, port = parse_endpoint(address)
        except ValueError as e:
            raise ConfigError(f"cluster.kv_events_address: {e}") from None
        check_events_bind(host, tokens)
        self.wall_clock = wall_clock
        self.sock = (context or zmq.Context.instance()).socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_MANUAL, 1)  # subscriptions applied by `_subscriptions`
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_HWM)
        self.sock.setsockopt(zmq.IPV6, 1)
        if port:
            self.sock.bind(f"tcp://{host_port(host, port)}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{bracketed(host)}")
        self.address = f"tcp://{host_port(host, port)}"
        self.seq = 0
        self.refused = 0  # subscriptions to other topics, dropped
        self._posted: queue.SimpleQueue[tuple[str, tuple[KVEvent, ...]]] = queue.SimpleQueue()

    def post(self, source: str, events: Sequence[KVEvent]) -> None:
        """Queues what `source` (`router`, `pe0`, `de1`, ...) reported, for the next `flush`."""
        if events:
            self._posted.put((source, tuple(events)))

    def _subscriptions(self) -> None:
        """Applies the waiting (un)subscriptions to prefixes of `TOPIC`, each to the subscriber
        that sent it; drops the rest."""
        while True:
            try:
                msg = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not msg or msg[0] not in (0, 1):
                self.refused += 1
                continue
            topic = msg[1:]
            if not TOPIC.startswith(topic):
                self.refused += 1
                continue
            self.sock.setsockopt(zmq.SUBSCRIBE if msg[0] == 1 else zmq.UNSUBSCRIBE, topic)

    def flush(self) -> int:
        """Publishes everything posted so far, in order; returns the number of batches."""
        self._subscriptions()
        n = 0
        while True:
            try:
                source, events = self._posted.get_nowait()
            except queue.Empty:
                return n
            batch = EventBatch(
                v=EVENTS_VERSION, seq=self.seq, ts=self.wall_clock(), source=source, events=events
            )
            # A PUB socket never blocks: a subscriber `SEND_HWM` batches behind loses the next.
            self.sock.send_multipart([TOPIC, encode_batch(batch)])
            self.seq += 1
            n += 1

    def close(self) -> None:
        self.flush()
        self.sock.close()


class KVEventRelay:
    """Publishes on `publisher` (None: KV events are not published); `registry` names the
    engines whose events arrive."""

    def __init__(self, publisher: KVEventPublisher | None, registry: EngineRegistry):
        self.publisher = publisher
        self.registry = registry

    def on_kv_events(self, ident: bytes, msg: messages.KVEvents) -> None:
        """An engine's store events: published at once, named after the engine."""
        e = self.registry.get(msg.engine)
        if self.publisher is None or e is None:
            return
        self.publisher.post(f"{'pe' if e.role == 'prefill' else 'de'}{e.engine}", msg.events)
        self.publish()

    def publish(self) -> None:
        if self.publisher is not None:
            self.publisher.flush()

    def stats(self) -> dict:
        if self.publisher is None:
            return {}
        return {
            "address": self.publisher.address,
            "batches": self.publisher.seq,
            "refused_subscriptions": self.publisher.refused,
        }
