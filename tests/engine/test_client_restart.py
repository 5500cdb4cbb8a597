"""A router restarted at the same address: the client hears another epoch in a ping's answer,
fails the calls the old router took with kind `connection`, and goes on with the new one; a
stats query in flight is asked of the new router instead."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures

import pytest

from dualpath_jax.wire import messages
from dualpath_jax.wire.client import Client, RolloutError
from dualpath_jax.wire.rpc import RpcServer


class FakeRouter(threading.Thread):
    """Answers pings with `epoch`, and `OpenSession` with an `Ack`; takes `Submit`s silently
    (a round in flight). `epoch` may change while it runs (a restart)."""

    def __init__(self, server: RpcServer, epoch: str):
        super().__init__(daemon=True)
        self.server, self.epoch = server, epoch
        self.submits: list[str] = []
        self.stats_asked = 0
        self.answer_stats = True  # False: stats queries are lost (a router about to die)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            got = self.server.recv(20)
            if got is None:
                continue
            if isinstance(got.msg, messages.Ping):
                self.server.send(got.ident, messages.Ack(ref="ping", epoch=self.epoch))
            elif isinstance(got.msg, messages.OpenSession):
                self.server.send(got.ident, messages.Ack(ref=got.msg.session))
            elif isinstance(got.msg, messages.Submit):
                self.submits.append(got.msg.request)
            elif isinstance(got.msg, messages.GetStats):
                self.stats_asked += 1
                if self.answer_stats:
                    body = json.dumps({"epoch": self.epoch})
                    self.server.send(got.ident, messages.Stats(json=body))


@pytest.fixture()
def router():
    server = RpcServer("127.0.0.1", 0)
    r = FakeRouter(server, "a" * 16)
    r.start()
    yield r
    r.halt.set()
    r.join(5)
    server.close()


def wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_new_epoch_fails_the_calls_in_flight_and_the_client_goes_on(router):
    client = Client(router.server.address, ping_s=0.05, dead_after_s=60.0)
    try:
        wait_for(lambda: client.router_epoch == "a" * 16)  # a ping at once: the epoch is known
        client.open_session("s")
        fut = client.submit("s", [1, 2, 3], 4)
        wait_for(lambda: router.submits)
        assert not fut.done()  # pings are answered: no silence, the round waits
        router.epoch = "b" * 16  # the router restarted
        with pytest.raises(RolloutError, match="restarted") as err:
            fut.result(30)
        assert err.value.kind == "connection"
        assert client.router_epoch == "b" * 16 and client.router_restarts == 1
        client.open_session("s")  # the client serves on: the new router answers
    finally:
        client.close()


def test_the_same_epoch_fails_nothing(router):
    client = Client(router.server.address, ping_s=0.02, dead_after_s=60.0)
    try:
        client.open_session("s")
        fut = client.submit("s", [1], 2)
        time.sleep(0.3)  # many pings answered by the same router
        assert not fut.done() and client.router_restarts == 0
    finally:
        client.close()


def test_a_stats_query_in_flight_is_asked_of_the_restarted_router(router):
    """The old router took the query and died: the new one is asked, and answers it."""
    client = Client(router.server.address, ping_s=0.05, dead_after_s=60.0)
    try:
        wait_for(lambda: client.router_epoch == "a" * 16)
        router.answer_stats = False
        with futures.ThreadPoolExecutor(1) as pool:
            got = pool.submit(client.stats, 30)
            wait_for(lambda: router.stats_asked == 1)
            router.answer_stats, router.epoch = True, "b" * 16  # the router restarted
            assert got.result(30) == {"epoch": "b" * 16}
        assert router.stats_asked == 2 and client.router_restarts == 1
    finally:
        client.close()
