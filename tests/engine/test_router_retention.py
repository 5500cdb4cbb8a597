"""Session retention as the router drives it, in-process with the fake clock and engines of
router_rig.py: every live decode engine (and the router's own store) learns that a session is
active when its round starts, idle for its TTL when the round ends (finished or failed) and
ended when it closes; a decode engine that registers learns every open session's state; the
retention of `OpenSession` and `Submit` is checked, and a bad one is refused without harm."""

from __future__ import annotations

import math

import pytest
from router_rig import CLIENT, DE, DE_ID, PE, PE_ID, RouterRig

from dualpath_jax.wire import frames, messages

DEFAULT_TTL = 60.0  # StoreConfig.retention_ttl_s
LONG = 1e6  # a TTL no test outlasts: "retained" below never depends on how fast it runs


def retains(rig: RouterRig, ident: bytes = DE_ID) -> list[messages.Retain]:
    """The Retain messages the last handled message made the router send to `ident`."""
    return [m for i, m in rig.sent if i == ident and isinstance(m, messages.Retain)]


def open_session(rig: RouterRig, session: str, **retention) -> None:
    assert rig.handle(messages.OpenSession(session=session, **retention), role=frames.CLIENT) == [
        messages.Ack(ref=session)
    ]


def submit(rig: RouterRig, session: str, request: str, **retention) -> None:
    msg = messages.Submit(request=request, session=session, append=[1, 2, 3], gen=3, **retention)
    assert rig.handle(msg, role=frames.CLIENT) == []


def complete(rig: RouterRig, request: str) -> messages.LoadJobMsg:
    """Runs the queued round `request` to its RoundResult, as its engines would; returns its job.
    `rig.sent` then holds what the DecodeDone made the router send."""
    (job,) = rig.assign()
    assert job.request == request
    rig.handle(messages.DeReady(request=request, engine=DE, attempt=job.attempt), DE_ID)
    rig.handle(messages.PrefillDone(request=request, engine=PE, first_token=5, hit_blocks=0,
                             recomputed_blocks=0, read_s=0, prefill_s=0), PE_ID)  # fmt: skip
    rig.handle(messages.DecodeDone(request=request, engine=DE, tokens=[5, 6, 7], persisted_blocks=0),
               DE_ID)  # fmt: skip
    (res,) = rig.to(CLIENT)
    assert isinstance(res, messages.RoundResult) and res.request == request
    return job


def test_opening_a_session_tells_no_engine(rig):
    open_session(rig, "s", priority=4, ttl_s=LONG)
    assert [m for _, m in rig.sent if isinstance(m, messages.Retain)] == []
    assert not rig.router.store.index.retained("s")


def test_a_submitted_round_makes_its_session_active_on_the_decode_engine(rig):
    open_session(rig, "s", priority=5, ttl_s=7.5)
    submit(rig, "s", "r1")
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=5, ttl_s=7.5)]
    assert retains(rig, PE_ID) == []  # prefill engines keep no session's KV
    assert rig.router.store.index.retained("s")


def test_a_session_without_a_ttl_gets_the_store_default(rig):
    assert rig.router.cfg.store.retention_ttl_s == DEFAULT_TTL
    open_session(rig, "s")
    submit(rig, "s", "r1")
    assert retains(rig) == [
        messages.Retain(session="s", state="active", priority=0, ttl_s=DEFAULT_TTL)
    ]


def test_a_finished_round_leaves_its_session_idle_for_its_ttl(rig):
    open_session(rig, "s", priority=2, ttl_s=LONG)
    submit(rig, "s", "r1")
    job = complete(rig, "r1")
    assert job.session == "s"  # the DE claims the round's chain for the session
    assert retains(rig) == [messages.Retain(session="s", state="idle", priority=2, ttl_s=LONG)]
    assert rig.router.store.index.retained("s")  # within its TTL


def test_a_zero_ttl_ends_the_retention_with_the_round(rig):
    open_session(rig, "s", ttl_s=0.0)
    submit(rig, "s", "r1")
    assert rig.router.store.index.retained("s")  # while the round runs
    complete(rig, "r1")
    assert retains(rig) == [messages.Retain(session="s", state="idle", priority=0, ttl_s=0.0)]
    assert not rig.router.store.index.retained("s")


@pytest.mark.parametrize("how", ["failed", "cancelled"])
def test_a_round_that_ends_unfinished_leaves_its_session_idle(rig, how):
    open_session(rig, "s", priority=-1, ttl_s=LONG)
    submit(rig, "s", "r1")
    (job,) = rig.assign()
    if how == "failed":
        rig.handle(messages.Failed(request="r1", engine=DE, message="OSError: disk", kind="store",
                            attempt=job.attempt), DE_ID)  # fmt: skip
    else:
        rig.handle(messages.CancelRound(request="r1"), role=frames.CLIENT)
    (err,) = [m for m in rig.to(CLIENT) if isinstance(m, messages.Error)]
    assert err.ref == "r1"
    assert retains(rig) == [messages.Retain(session="s", state="idle", priority=-1, ttl_s=LONG)]
    assert rig.router.store.index.retained("s")


def test_a_round_given_up_after_its_attempts_leaves_its_session_idle(rig):
    open_session(rig, "s", ttl_s=LONG)
    submit(rig, "s", "r1")
    for attempt in (1, 2):  # max_attempts=2
        rig.assign()
        rig.handle(messages.Failed(request="r1", engine=PE, message="TransferTimeout", kind="transfer",
                            attempt=attempt), PE_ID)  # fmt: skip
        if attempt == 1:
            assert retains(rig) == []  # a retry: the round still runs
    assert retains(rig) == [messages.Retain(session="s", state="idle", priority=0, ttl_s=LONG)]


def test_closing_a_session_ends_its_retention(rig):
    open_session(rig, "s", priority=9, ttl_s=LONG)
    submit(rig, "s", "r1")
    complete(rig, "r1")
    assert rig.handle(messages.CloseSession(session="s"), role=frames.CLIENT) == [
        messages.Ack(ref="s")
    ]
    assert retains(rig) == [messages.Retain(session="s", state="ended")]
    assert not rig.router.store.index.retained("s")
    # an unknown session: an error, and nothing sent to the engines
    (err,) = rig.handle(messages.CloseSession(session="s"), role=frames.CLIENT)
    assert err.ref == "s" and "unknown session" in err.message
    assert retains(rig) == []


def test_a_released_session_is_ended_before_its_blocks_go(rig):
    open_session(rig, "s", ttl_s=LONG)
    submit(rig, "s", "r1")
    complete(rig, "r1")
    assert rig.handle(messages.CloseSession(session="s", release=True), role=frames.CLIENT) == [
        messages.Ack(ref="s")
    ]
    assert retains(rig) == [messages.Retain(session="s", state="ended")]
    assert not rig.router.store.index.retained("s")


def test_every_live_decode_engine_hears_it(rig):
    de2 = b"de2"
    rig.handle(messages.Register(role="decode", engine=2, node=2, group=0, address="inproc://2",
                          pid=102), de2)  # fmt: skip
    open_session(rig, "s", priority=1, ttl_s=3.0)
    submit(rig, "s", "r1")
    want = messages.Retain(session="s", state="active", priority=1, ttl_s=3.0)
    assert retains(rig) == [want] and retains(rig, de2) == [want]


def test_a_decode_engine_that_registers_learns_every_retained_session(rig):
    open_session(rig, "idle", priority=3, ttl_s=100.0)
    submit(rig, "idle", "r0")
    complete(rig, "r0")
    open_session(rig, "expired", ttl_s=1.0)
    submit(rig, "expired", "r2")
    complete(rig, "r2")
    open_session(rig, "never")  # no round yet: nothing of it is retained
    open_session(rig, "busy", priority=-2)
    submit(rig, "busy", "r1")
    open_session(rig, "closed")
    rig.handle(messages.CloseSession(session="closed"), role=frames.CLIENT)
    rig.clock.t += 40.0
    de2 = b"de2"
    rig.handle(messages.Register(role="decode", engine=2, node=2, group=0, address="inproc://2",
                          pid=102), de2)  # fmt: skip
    # an idle session for what is left of its TTL, never a fresh one
    assert sorted(retains(rig, de2), key=lambda m: m.session) == [
        messages.Retain(session="busy", state="active", priority=-2, ttl_s=DEFAULT_TTL),
        messages.Retain(session="idle", state="idle", priority=3, ttl_s=pytest.approx(60.0)),
    ]
    assert retains(rig) == []  # the engines that knew already are not told again
    # a prefill engine that registers learns nothing
    rig.handle(messages.Register(role="prefill", engine=3, node=3, group=0, address="inproc://3",
                          pid=103), b"pe3")  # fmt: skip
    assert [m for _, m in rig.sent if isinstance(m, messages.Retain)] == []


def test_a_submit_with_retention_changes_the_sessions(rig):
    open_session(rig, "s", ttl_s=LONG)
    submit(rig, "s", "r1", priority=6, ttl_s=2.0)
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=6, ttl_s=2.0)]
    complete(rig, "r1")
    assert retains(rig) == [messages.Retain(session="s", state="idle", priority=6, ttl_s=2.0)]
    # later rounds without any keep it; one with only a priority keeps the TTL
    submit(rig, "s", "r2")
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=6, ttl_s=2.0)]
    complete(rig, "r2")
    submit(rig, "s", "r3", priority=0)
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=0, ttl_s=2.0)]
    # -1 goes back to the store's default TTL
    complete(rig, "r3")
    submit(rig, "s", "r4", ttl_s=-1.0)
    assert retains(rig) == [
        messages.Retain(session="s", state="active", priority=0, ttl_s=DEFAULT_TTL)
    ]


def test_a_resume_changes_the_sessions_retention_from_its_next_round(rig):
    open_session(rig, "s", priority=1, ttl_s=LONG)
    open_session(rig, "s", resume=True, priority=8, ttl_s=5.0)
    assert retains(rig) == []  # nothing stored of it is retained yet
    submit(rig, "s", "r1")
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=8, ttl_s=5.0)]


def test_a_resume_keeps_what_it_does_not_name(rig):
    """A `ttl` hint (a resume with a TTL only) keeps a pinned session's priority."""
    open_session(rig, "s", priority=9, ttl_s=LONG)
    open_session(rig, "s", resume=True, ttl_s=5.0)
    submit(rig, "s", "r1")
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=9, ttl_s=5.0)]
    complete(rig, "r1")
    open_session(rig, "s", resume=True, priority=3)
    submit(rig, "s", "r2")
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=3, ttl_s=5.0)]


def test_a_resume_restates_an_idle_sessions_retention_with_its_new_priority(rig):
    open_session(rig, "s", priority=1, ttl_s=50.0)
    submit(rig, "s", "r1")
    complete(rig, "r1")
    rig.clock.t += 10.0
    open_session(rig, "s", resume=True, priority=8, ttl_s=5.0)
    # the new TTL counts from the next round; the one running out keeps its end
    assert retains(rig) == [messages.Retain(session="s", state="idle", priority=8, ttl_s=40.0)]


@pytest.mark.parametrize(
    "retention, named",
    [
        ({"ttl_s": -5.0}, "ttl_s"),
        ({"ttl_s": 1e12}, "ttl_s"),
        ({"ttl_s": math.nan}, "ttl_s"),
        ({"ttl_s": math.inf}, "ttl_s"),
        ({"priority": 2**40}, "priority"),
        ({"priority": -(2**31) - 1}, "priority"),
    ],
    ids=repr,
)
def test_a_bad_retention_is_refused_and_the_router_serves_on(rig, retention, named):
    (err,) = rig.handle(messages.OpenSession(session="s", **retention), role=frames.CLIENT)
    assert err.kind == "bad_request" and err.ref == "s"
    assert f"retention {named}" in err.message and str(next(iter(retention.values()))) in (
        err.message
    )
    assert "s" not in rig.router.rounds.table.sessions and retains(rig) == []
    # the same in a Submit: refused, the session free and its retention unchanged
    open_session(rig, "s", priority=1, ttl_s=LONG)
    (err,) = rig.handle(
        messages.Submit(request="r1", session="s", append=[1], gen=1, **retention),
        role=frames.CLIENT,
    )
    assert err.kind == "bad_request" and err.ref == "r1" and f"retention {named}" in err.message
    s, kept = rig.router.rounds.table["s"], rig.router.retention["s"]
    assert not s.busy and (kept.priority, kept.ttl_s) == (1, LONG) and retains(rig) == []
    # a good round after it runs
    submit(rig, "s", "r2")
    assert retains(rig) == [messages.Retain(session="s", state="active", priority=1, ttl_s=LONG)]
    complete(rig, "r2")


def test_the_edges_of_the_ranges_are_accepted(rig):
    for k, (priority, ttl_s) in enumerate([(2**31 - 1, 0.0), (-(2**31), 1e9), (0, -1.0)]):
        open_session(rig, f"s{k}", priority=priority, ttl_s=ttl_s)
        assert (rig.router.retention[f"s{k}"].priority, rig.router.retention[f"s{k}"].ttl_s) == (
            priority,
            ttl_s,
        )
