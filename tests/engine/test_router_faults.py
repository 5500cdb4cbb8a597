"""The router's fault paths, driven in-process with a fake clock and fake engines: every failure
an engine reports ends in a bounded retry or an error of the right kind carrying the engine's
text; admission never gives a DE more than its slots plus its queue, and the PE starts only
once the DE is ready; rounds can be cancelled; roles and engine identities are enforced; with
no live engine of a role, rounds fail instead of waiting."""

from __future__ import annotations

import pytest
from router_rig import CLIENT, DE, DE_ID, PE, PE_ID, RouterRig

from dualpath_jax.wire import frames, messages


def errors_to_client(rig: RouterRig) -> list[messages.Error]:
    return [m for m in rig.to(CLIENT) if isinstance(m, messages.Error)]


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize("kind", ["store", "engine", "error"])
def test_a_reported_failure_ends_the_round_with_its_kind_and_text(rig, kind):
    rig.submit("s", "r1")
    (job,) = rig.assign()
    text = "OSError: [Errno 28] No space left on device"
    rig.handle(messages.Failed(request="r1", engine=DE, message=text, kind=kind, attempt=job.attempt),
               DE_ID)  # fmt: skip
    (err,) = errors_to_client(rig)
    assert err.ref == "r1" and err.kind == ("engine" if kind == "error" else kind)
    assert text in err.message and "decode engine 1" in err.message
    assert messages.Cancel(request="r1") in rig.to(PE_ID)  # the other side drops its half
    assert "r1" not in rig.router.rounds.table.requests and not rig.router.rounds.table["s"].busy
    # the session is usable again
    assert (
        rig.handle(
            messages.Submit(request="r2", session="s", append=[4], gen=2), role=frames.CLIENT
        )
        == []
    )


def test_transfer_failures_are_retried_then_end_with_the_last_cause(rig):
    rig.submit("s", "r1")
    for attempt in (1, 2):  # max_attempts=2
        (job,) = rig.assign()
        assert job.attempt == attempt
        rig.handle(messages.Failed(request="r1", engine=PE, message=f"TransferTimeout: try {attempt}",
                            kind="transfer", attempt=attempt), PE_ID)  # fmt: skip
    (err,) = errors_to_client(rig)
    assert err.kind == "transfer"
    assert "gave up after 2 attempts" in err.message and "TransferTimeout: try 2" in err.message
    assert rig.router.stats()["counters"]["requeued"] == 1 and len(rig.router.scheduler) == 0


def test_a_stale_attempts_failure_is_ignored(rig):
    rig.submit("s", "r1")
    rig.assign()
    rig.handle(
        messages.Failed(request="r1", engine=PE, message="x", kind="transfer", attempt=1), PE_ID
    )
    (job,) = rig.assign()
    assert job.attempt == 2
    rig.handle(
        messages.Failed(request="r1", engine=PE, message="late", kind="store", attempt=1), PE_ID
    )
    assert errors_to_client(rig) == [] and "r1" in rig.router.rounds.table.requests


def test_a_persist_error_still_returns_the_tokens(rig):
    rig.submit("s", "r1")
    (job,) = rig.assign()
    rig.handle(messages.DeReady(request="r1", engine=DE, attempt=job.attempt), DE_ID)
    rig.handle(messages.PrefillDone(request="r1", engine=PE, first_token=5, hit_blocks=0,
                             recomputed_blocks=0, read_s=0, prefill_s=0), PE_ID)  # fmt: skip
    rig.handle(messages.DecodeDone(request="r1", engine=DE, tokens=[5, 6, 7], persisted_blocks=0,
                            persist_error="StoreError: read-only"), DE_ID)  # fmt: skip
    (res,) = rig.to(CLIENT)
    assert isinstance(res, messages.RoundResult) and res.tokens == [5, 6, 7]
    assert res.persist_error == "StoreError: read-only"
    assert rig.router.stats()["counters"]["persist_errors"] == 1
    assert rig.router.rounds.table["s"].context == [1, 2, 3, 5, 6, 7]


# ----------------------------------------------------------------------------- admission


def test_the_pe_gets_a_job_only_once_its_de_is_ready(rig):
    rig.submit("s", "r1")
    rig.fetch(DE)
    sent = rig.fetch(PE)
    assert [i for i, m in sent if isinstance(m, messages.Work)] == [DE_ID]  # not the PE yet
    job = next(m for _, m in sent if isinstance(m, messages.Work)).jobs[0]
    rig.handle(messages.DeReady(request="r1", engine=DE, attempt=job.attempt + 1), DE_ID)
    assert rig.to(PE_ID) == []  # another attempt's readiness
    rig.handle(messages.DeReady(request="r1", engine=DE, attempt=job.attempt), DE_ID)
    assert rig.to(PE_ID) == [messages.Work(jobs=[job])]


def test_a_de_never_holds_more_than_its_slots_plus_queue(router_rig):
    rig = router_rig(decode_slots=2, decode_queue=1, max_attempts=2)
    for k in range(8):
        rig.submit(f"s{k}", f"r{k}")
    for _ in range(4):  # repeated fetches place no more
        rig.fetch(DE, slots=2)
        rig.fetch(PE)
    held = [r for r in rig.router.rounds.table.requests.values() if r.de == DE]
    assert len(held) == 3
    assert len(rig.router.scheduler) == 5


def test_beyond_max_queue_rounds_are_refused_as_overloaded(router_rig):
    rig = router_rig()
    rig.router.scheduler.max_queue = 2
    rig.submit("a", "r1")
    rig.submit("b", "r2")
    rig.handle(messages.OpenSession(session="c"), role=frames.CLIENT)
    (err,) = rig.handle(
        messages.Submit(request="r3", session="c", append=[1], gen=1), role=frames.CLIENT
    )
    assert err.kind == "overloaded" and "max_queue=2" in err.message
    assert not rig.router.rounds.table["c"].busy


# ----------------------------------------------------------------------------- cancel


@pytest.mark.parametrize("stage", ["queued", "assigned"])
def test_a_cancelled_round_frees_its_session(rig, stage):
    rig.submit("s", "r1")
    if stage == "assigned":
        rig.assign()
    rig.handle(messages.CancelRound(request="r1"), role=frames.CLIENT)
    (err,) = errors_to_client(rig)
    assert err.ref == "r1" and err.kind == "cancelled"
    if stage == "assigned":
        assert messages.Cancel(request="r1") in rig.to(DE_ID) + rig.to(PE_ID)
    assert len(rig.router.scheduler) == 0 and rig.router.rounds.table.requests == {}
    assert (
        rig.handle(
            messages.Submit(request="r2", session="s", append=[4], gen=2), role=frames.CLIENT
        )
        == []
    )
    # another client cannot cancel it
    rig.handle(messages.CancelRound(request="r2"), ident=b"stranger", role=frames.CLIENT)
    assert "r2" in rig.router.rounds.table.requests


# ----------------------------------------------------------------------------- roles, liveness


@pytest.mark.parametrize(
    "msg",
    [
        messages.Register(role="decode", engine=1, node=1, group=0, address="x", pid=1),
        messages.Shutdown(),
        messages.DecodeDone(request="r1", engine=1, tokens=[1], persisted_blocks=0),
        messages.Heartbeat(engine=1),
    ],
    ids=lambda m: type(m).__name__,
)
def test_a_client_cannot_send_engine_messages(rig, msg):
    (err,) = rig.handle(msg, ident=b"rogue", role=frames.CLIENT)
    assert err.kind == "auth" and "needs the engine secret" in err.message
    assert not rig.router.stopping and rig.router.liveness.registry[DE].ident == DE_ID


def test_a_second_engine_with_a_live_id_is_refused(rig):
    (err,) = rig.handle(
        messages.Register(role="decode", engine=DE, node=1, group=0, address="evil", pid=999),
        b"rogue",
    )
    assert err.kind == "stop" and "already registered by pid 101" in err.message
    assert rig.router.liveness.registry[DE].address == "inproc://1"
    rig.submit("s", "r1")
    rig.assign()
    # messages naming engine 1 from another connection are refused too
    (err,) = rig.handle(messages.DecodeDone(request="r1", engine=DE, tokens=[9], persisted_blocks=0),
                        b"rogue")  # fmt: skip
    assert err.kind == "auth" and "r1" in rig.router.rounds.table.requests


def test_heartbeats_and_pings_are_answered(rig):
    assert rig.handle(messages.Heartbeat(engine=PE), b"hb-socket") == [messages.Ack(ref="hb")]
    (ack,) = rig.handle(messages.Ping(), role=frames.CLIENT)
    assert ack == messages.Ack(ref="ping", epoch=rig.router.epoch) and len(ack.epoch) == 16
    assert rig.router.stats()["epoch"] == rig.router.epoch


def test_existing_session_needs_resume(rig):
    rig.submit("s", "r1")
    (err,) = rig.handle(messages.OpenSession(session="s"), role=frames.CLIENT)
    assert err.kind == "bad_request" and "resume=True" in err.message
    assert rig.handle(messages.OpenSession(session="s", resume=True), role=frames.CLIENT) == [
        messages.Ack(ref="s")
    ]


def test_with_no_live_prefill_engine_rounds_fail_with_kind_engine(rig):
    limit = rig.router.cfg.cluster.no_engine_timeout_s
    rig.submit("s", "r1")
    rig.clock.t = rig.router.cfg.cluster.heartbeat_timeout_s + 1
    rig.handle(messages.Heartbeat(engine=DE), DE_ID)  # the DE lives on, the PE went silent
    rig.sent.clear()
    rig.router.tick(rig.clock())
    assert not rig.router.liveness.registry[PE].alive and errors_to_client(rig) == []  # not yet
    rig.clock.t += limit + 1
    rig.handle(messages.Heartbeat(engine=DE), DE_ID)
    rig.sent.clear()
    rig.router.tick(rig.clock())
    (err,) = errors_to_client(rig)
    assert err.kind == "engine" and "no live prefill engine" in err.message
    (err,) = rig.handle(
        messages.Submit(request="r2", session="s", append=[1], gen=1), role=frames.CLIENT
    )
    assert err.kind == "engine" and "no live prefill engine" in err.message


def test_an_engine_that_registers_again_serves_at_once(rig):
    limit = rig.router.cfg.cluster.no_engine_timeout_s
    rig.clock.t = rig.router.cfg.cluster.heartbeat_timeout_s + limit + 2
    rig.handle(messages.Heartbeat(engine=DE), DE_ID)
    rig.router.tick(rig.clock())
    assert "no live prefill engine" in rig.router.liveness.registry.missing_role()
    rig.handle(messages.Register(role="prefill", engine=PE, node=0, group=0, address="inproc://0",
                          pid=200), PE_ID)  # fmt: skip
    # no liveness tick in between: the new engine counts at once
    rig.submit("s", "r1")
    assert "r1" in rig.router.rounds.table.requests


def test_a_paused_engine_declared_dead_is_told_to_rejoin_and_serves_again(rig):
    """An engine paused past the heartbeat timeout (SIGSTOP) is declared dead and its round
    requeued. When it resumes, its fetch is answered `rejoin`; it registers again (same process,
    same connection) and gets work; what it reports of the attempt it held is ignored."""
    rig.submit("s", "r1")
    (job,) = rig.assign()
    rig.clock.t = rig.router.cfg.cluster.heartbeat_timeout_s + 1
    rig.handle(messages.Heartbeat(engine=PE), PE_ID)  # the PE lives on, the DE is paused
    rig.router.tick(rig.clock())
    st = rig.router.rounds.table.requests["r1"]
    assert not rig.router.liveness.registry[DE].alive and st.de == -1  # requeued
    # it resumes: its heartbeats are answered as ever, its fetch tells it to rejoin
    assert rig.handle(messages.Heartbeat(engine=DE), DE_ID) == [messages.Ack(ref="hb")]
    (order,) = rig.fetch(DE)
    assert order[0] == DE_ID and order[1].kind == "rejoin" and "declared dead" in order[1].message
    assert rig.router.stats()["counters"]["rejoin_orders"] == 1
    assert rig.handle(messages.Register(role="decode", engine=DE, node=DE, group=0,
                                        address=f"inproc://{DE}", pid=100 + DE), DE_ID) == [
        messages.Ack(ref=str(DE))]  # fmt: skip
    (again,) = rig.assign()  # it serves again: the requeued round, a new attempt
    assert again.request == "r1" and again.attempt == job.attempt + 1 and st.de == DE
    rig.handle(messages.DeReady(request="r1", engine=DE, attempt=again.attempt), DE_ID)
    rig.handle(messages.PrefillDone(request="r1", engine=PE, first_token=5, hit_blocks=0,
                                    recomputed_blocks=0, read_s=0.0, prefill_s=0.0,
                                    attempt=again.attempt), PE_ID)  # fmt: skip
    # a persist of the attempt it held before the pause reports late: ignored
    stale = messages.DecodeDone(request="r1", engine=DE, tokens=[9, 9, 9], persisted_blocks=0,
                                attempt=job.attempt)  # fmt: skip
    assert rig.handle(stale, DE_ID) == [] and "r1" in rig.router.rounds.table.requests
    done = messages.DecodeDone(request="r1", engine=DE, tokens=[5, 6, 7], persisted_blocks=0,
                               attempt=again.attempt)  # fmt: skip
    (res,) = [m for m in rig.handle(done, DE_ID) if isinstance(m, messages.RoundResult)]
    assert list(res.tokens) == [5, 6, 7]


def test_an_engine_of_a_restarted_router_is_told_to_register_again(rig):
    """A router restarted over running engines never registered them: what they report of
    rounds it does not know is ignored, and their next fetch tells them to register again."""
    reports = [
        messages.DecodeDone(request="old", engine=9, tokens=[1], persisted_blocks=0),
        messages.Heartbeat(engine=9),
    ]
    assert [rig.handle(m, b"de9") for m in reports] == [[], [messages.Ack(ref="hb")]]
    (order,) = rig.handle(messages.Fetch(engine=9, load=messages.Load()), b"de9")
    assert order.kind == "rejoin" and "router restarted" in order.message
    assert rig.handle(messages.Register(role="decode", engine=9, node=9, group=0,
                                        address="inproc://9", pid=109), b"de9") == [
        messages.Ack(ref="9")]  # fmt: skip
    assert rig.router.liveness.registry[9].alive
