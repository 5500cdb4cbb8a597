"""Session hints (`wire.hints`): their forms, validation (unknown ones are bad_request), what
each maps onto (retention, release, fork) for `Session.hint`, `Client.hint` and HTTP."""

from __future__ import annotations

import pytest

from dualpath_jax.rollout import Backend, RolloutError, Session
from dualpath_jax.serving import request_checks
from dualpath_jax.serving.protocol import ApiError
from dualpath_jax.wire.hints import (
    PIN_PRIORITY,
    SessionHint,
    apply_hint,
    parse_hint,
    retention_of,
)


@pytest.mark.parametrize(
    "raw, want",
    [
        ("tool_call:12.5", SessionHint("tool_call", expected_s=12.5)),
        ('{"kind": "tool_call", "expected_s": 3}', SessionHint("tool_call", expected_s=3.0)),
        ({"kind": "ttl", "ttl_s": 600}, SessionHint("ttl", ttl_s=600.0)),
        (" pin ", SessionHint("pin")),
        ("release", SessionHint("release")),
        ("fork", SessionHint("fork")),
        ({"kind": "fork", "session": "child"}, SessionHint("fork", session="child")),
        (SessionHint("ttl", ttl_s=5.0), SessionHint("ttl", ttl_s=5.0)),
    ],
)
def test_hint_forms(raw, want):
    assert parse_hint(raw) == want


@pytest.mark.parametrize(
    "raw",
    ["prefetch", "", "tool_call", "tool_call:soon", "tool_call:-1", "tool_call:nan", "pin:3",
     {"kind": "ttl"}, {"kind": "ttl", "ttl_s": True}, {"kind": "pin", "ttl_s": 3}, "{not json",
     ["pin"], "x" * 600, {"kind": "fork", "session": 7}],
)  # fmt: skip
def test_unknown_or_malformed_hints_are_bad_requests(raw):
    with pytest.raises(RolloutError) as e:
        parse_hint(raw)
    assert e.value.kind == "bad_request"


def test_retention_of_each_hint():
    assert retention_of(parse_hint("pin")) == {"priority": PIN_PRIORITY, "ttl_s": 1e9}
    assert retention_of(parse_hint("ttl:60")) == {"ttl_s": 60.0}
    assert retention_of(parse_hint("tool_call:10")) == {"ttl_s": 30.0}
    assert retention_of(parse_hint("release")) == {}


class FakeBackend(Backend):
    def __init__(self):
        self.calls = []

    def open_session(self, session, resume=False, **kw):
        self.calls.append(("open", session, resume, kw))

    def close_session(self, session, release=False):
        self.calls.append(("close", session, release))

    def submit(self, session, append, gen, **kw):
        raise AssertionError("hints submit nothing")

    def tool_call(self, session, expected_s):
        self.calls.append(("tool_call", session, expected_s))


def test_session_hint_maps_onto_retention_release_and_fork():
    b = FakeBackend()
    s = Session(b, "s")
    assert s.hint("tool_call", expected_s=4) is None
    assert s.hint("pin") is None
    child = s.hint("fork", session="s/sub")
    assert child is not None and child.id == "s/sub"
    assert s.hint("release") is None
    assert b.calls == [
        ("open", "s", False, {}),
        ("open", "s", True, {"ttl_s": 12.0}),
        ("tool_call", "s", 4.0),
        ("open", "s", True, {"priority": PIN_PRIORITY, "ttl_s": 1e9}),
        ("open", "s/sub", False, {"fork_of": "s"}),
        ("close", "s", True),
    ]
    with pytest.raises(RolloutError):
        s.hint("prefetch_now")
    with pytest.raises(RolloutError):
        apply_hint(b, "s", parse_hint("fork"))


class FakeHttp:
    def __init__(self, headers):
        self.headers = headers


class Body:
    session_hint = None


def test_http_hints_set_retention_capped_by_the_server_and_reject_the_rest():
    def hint(*args):
        return request_checks.session_hint(*args)[1]

    assert hint(FakeHttp({}), Body(), "a") == {}
    assert request_checks.session_hint(FakeHttp({}), Body(), "a")[0] is None
    assert hint(FakeHttp({"X-Session-Hint": "tool_call:5"}), Body(), "a") == {"ttl_s": 15.0}
    body = Body()
    body.session_hint = {"kind": "pin"}
    assert hint(FakeHttp({}), body, "a", 100, 3600.0) == {"priority": 100, "ttl_s": 3600.0}
    for raw, kind in (("release", "release"), ("fork:a/sub", "fork")):  # act around the round
        h, retention = request_checks.session_hint(FakeHttp({"X-Session-Hint": raw}), Body(), "a")
        assert h.kind == kind and retention == {}
    for headers, sid in (
        ({"X-Session-Hint": "warp"}, "a"),
        ({"X-Session-Hint": "fork"}, None),
        ({"X-Session-Hint": "pin"}, None),
    ):
        with pytest.raises(ApiError) as e:
            hint(FakeHttp(headers), Body(), sid)
        assert e.value.status == 400
