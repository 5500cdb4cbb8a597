"""A router restarted at the same address: the client hears another epoch in a ping's answer,
fails the calls the old router took with kind `connection`, and goes on with the new one."""

from __future__ import annotations

import threading
import time

import pytest

from dualpath_jax.engine import messages
from dualpath_jax.engine.client import Client, RolloutError
from dualpath_jax.engine.rpc import RpcServer


class FakeRouter(threading.Thread):
    """Answers pings with `epoch`, and `OpenSession` with an `Ack`; takes `Submit`s silently
    (a round in flight). `epoch` may change while it runs (a restart)."""

    def __init__(self, server: RpcServer, epoch: str):
        super().__init__(daemon=True)
        self.server, self.epoch = server, epoch
        self.submits: list[str] = []
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
