"""The router client refuses bad arguments itself, at once and with kind `bad_request`: a call
the router could not decode would otherwise wait out its timeout (no router runs here)."""

from __future__ import annotations

import pytest

from dualpath_jax.wire.client import Client, RolloutError


@pytest.fixture()
def client():
    c = Client("tcp://127.0.0.1:9", "t" * 16)  # nothing listens: only local checks can answer
    yield c
    c.close()


@pytest.mark.parametrize("session", [5, None, "", b"s", "x" * 1025])
def test_a_bad_session_is_refused_before_sending(client, session):
    for call in (
        lambda: client.open_session(session, timeout_s=60),
        lambda: client.close_session(session, timeout_s=60),
        lambda: client.submit(session, [1, 2], 3).result(0),
    ):
        with pytest.raises(RolloutError) as e:
            call()
        assert e.value.kind == "bad_request" and "session" in str(e.value)


def test_bad_retention_is_refused_before_sending(client):
    for kw, says in (({"ttl_s": "long"}, "ttl_s"), ({"priority": 1.5}, "priority")):
        with pytest.raises(RolloutError, match=says) as e:
            client.open_session("s", timeout_s=60, **kw)
        assert e.value.kind == "bad_request"
