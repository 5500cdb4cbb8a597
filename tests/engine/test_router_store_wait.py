"""The router's loop never waits long on the store, and keeps no state for sessions that are
gone: a slow lookup or release leaves pings, other sessions and engines served, and fails only its
own round (kind `store`) at `store.timeout_s`; a round cancelled while it is looked up ends
cancelled; sessions idle for `cluster.session_idle_timeout_s` are closed, and a closed session's
claims leave the block index while its blocks stay."""

from __future__ import annotations

from concurrent import futures

import pytest
from router_rig import PE_ID, RouterRig

from dualpath_jax.wire import frames, messages


@pytest.fixture()
def slow(router_rig):
    """A rig whose store lookups and releases answer only when the test says
    (`rig.answers` holds their futures, oldest first); the loop waits for none of them."""
    rig = router_rig(store_wait_s=0.0, session_idle_timeout_s=10.0)
    answers: list[futures.Future] = []

    def later(*_):
        f: futures.Future = futures.Future()
        answers.append(f)
        return f

    rig.router.store.lookup = later  # type: ignore[method-assign]
    rig.router.store.release = later  # type: ignore[method-assign]
    rig.answers = answers  # type: ignore[attr-defined]
    return rig


def client(rig: RouterRig, msg: messages.Msg) -> list[messages.Msg]:
    return rig.handle(msg, role=frames.CLIENT)


def open_and_submit(rig: RouterRig, session: str, request: str) -> list[messages.Msg]:
    assert client(rig, messages.OpenSession(session=session)) == [messages.Ack(ref=session)]
    return client(rig, messages.Submit(request=request, session=session, append=[1, 2, 3], gen=2))


def poll(rig: RouterRig) -> list[messages.Msg]:
    rig.sent.clear()
    rig.router.rounds.poll_store()
    return [m for _, m in rig.sent if not isinstance(m, messages.Retain)]


def test_a_slow_lookup_leaves_the_loop_serving_everything_else(slow):
    table = slow.router.rounds.table
    assert open_and_submit(slow, "a", "ra") == []  # waits for its lookup
    assert "ra" in table.admitting and "ra" not in table.requests and table["a"].busy
    assert client(slow, messages.Ping()) == [messages.Ack(ref="ping", epoch=slow.router.epoch)]
    assert open_and_submit(slow, "b", "rb") == []
    slow.answers[1].set_result(0)  # b's lookup answers first: b runs, a still waits
    assert poll(slow) == []
    assert "rb" in table.requests and "ra" in table.admitting
    # a second round of a busy session is refused while its first is looked up
    (err,) = client(slow, messages.Submit(request="ra2", session="a", append=[4], gen=1))
    assert isinstance(err, messages.Error) and "already has a round running" in err.message
    slow.answers[0].set_result(0)
    assert poll(slow) == []
    assert "ra" in table.requests and not table.admitting
    assert slow.router.stats()["in_flight"] == 2


def test_a_lookup_past_the_store_timeout_fails_only_its_round(slow):
    assert open_and_submit(slow, "a", "ra") == []
    slow.clock.t += 30.0
    assert poll(slow) == []  # store.timeout_s is 60 s
    slow.clock.t += 31.0
    (err,) = poll(slow)
    assert isinstance(err, messages.Error) and err.ref == "ra" and err.kind == "store"
    assert "no answer in 60 s" in err.message
    assert slow.answers[0].cancelled()
    table = slow.router.rounds.table
    assert not table["a"].busy and not table.admitting and not table.requests


def test_a_failed_lookup_is_its_rounds_store_error(slow):
    assert open_and_submit(slow, "a", "ra") == []
    slow.answers[0].set_exception(OSError("disk gone"))
    (err,) = poll(slow)
    assert err.kind == "store" and "disk gone" in err.message


def test_a_round_cancelled_while_looked_up_ends_cancelled_at_once(slow):
    assert open_and_submit(slow, "a", "ra") == []
    # another client cannot cancel it
    assert slow.handle(messages.CancelRound(request="ra"), b"other", frames.CLIENT) == []
    (err,) = client(slow, messages.CancelRound(request="ra"))  # at once, not at the answer
    assert err.ref == "ra" and err.kind == "cancelled"
    table = slow.router.rounds.table
    assert not table.admitting and not table["a"].busy
    # the session takes a round again (even under the same request id) before the answer
    assert client(slow, messages.Submit(request="ra", session="a", append=[1], gen=1)) == []
    slow.answers[0].set_result(0)  # the cancelled lookup's answer is ignored
    assert poll(slow) == [] and "ra" in table.admitting
    slow.answers[1].set_result(0)
    assert poll(slow) == [] and "ra" in table.requests


def test_a_round_whose_session_closed_while_looked_up_fails(slow):
    assert open_and_submit(slow, "a", "ra") == []
    assert client(slow, messages.CloseSession(session="a")) == [messages.Ack(ref="a")]
    slow.answers[0].set_result(0)
    (err,) = poll(slow)
    assert err.ref == "ra" and "was closed" in err.message and not slow.router.rounds.table.requests


def test_a_slow_release_acks_when_the_store_answers(slow):
    assert client(slow, messages.OpenSession(session="a")) == [messages.Ack(ref="a")]
    assert client(slow, messages.CloseSession(session="a", release=True)) == []
    assert client(slow, messages.Ping()) == [messages.Ack(ref="ping", epoch=slow.router.epoch)]
    slow.answers[0].set_result(3)
    assert poll(slow) == [messages.Ack(ref="a")]


def test_idle_sessions_expire_and_their_next_round_is_told_why(slow):
    router, table = slow.router, slow.router.rounds.table
    for s in ("idle", "busy", "late"):
        assert client(slow, messages.OpenSession(session=s)) == [messages.Ack(ref=s)]
    router.store.claim("idle", ["1" * 32, "2" * 32])
    assert client(slow, messages.Submit(request="r", session="busy", append=[1], gen=1)) == []
    slow.clock.t += 6.0
    # a round of "late" starts and ends: its idle time starts again
    assert client(slow, messages.Submit(request="r2", session="late", append=[1], gen=1)) == []
    slow.answers[1].set_result(0)
    poll(slow)
    client(slow, messages.CancelRound(request="r2"))
    slow.clock.t += 5.0
    router.tick(slow.clock())
    assert set(table.sessions) == {"busy", "late"}  # busy: its round is being admitted
    assert router.out.counters["sessions_expired"] == 1
    assert router.store.index.claims() == 0  # the expired session's claims are gone
    (err,) = client(slow, messages.Submit(request="r3", session="idle", append=[1], gen=1))
    assert err.kind == "bad_request" and "expired after 10 s" in err.message
    # opening it again starts a fresh session
    assert client(slow, messages.OpenSession(session="idle")) == [messages.Ack(ref="idle")]
    slow.clock.t += 5.0
    router.tick(slow.clock())
    assert "late" not in table.sessions and "idle" in table.sessions


def test_no_expiry_when_the_timeout_is_zero(router_rig):
    rig = router_rig(session_idle_timeout_s=0.0)
    assert client(rig, messages.OpenSession(session="s")) == [messages.Ack(ref="s")]
    rig.clock.t += 1e9
    rig.router.tick(rig.clock())
    assert "s" in rig.router.rounds.table.sessions


def test_closing_without_release_forgets_the_claims_and_keeps_the_blocks(router_rig):
    rig = router_rig()
    store = rig.router.store
    assert client(rig, messages.OpenSession(session="s")) == [messages.Ack(ref="s")]
    store.claim("s", ["1" * 32])
    assert store.index.claims() == 1
    assert client(rig, messages.CloseSession(session="s")) == [messages.Ack(ref="s")]
    assert store.index.claims() == 0


# ----------------------------------------------------------------------------- group followers


def group(rig: RouterRig, n: int, follows: bool = True) -> None:
    """Sessions g0..g{n-1} of one prompt; round r0 leads, the others follow it."""
    for k in range(n):
        assert client(rig, messages.OpenSession(session=f"g{k}")) == [messages.Ack(ref=f"g{k}")]
    for k in range(n):
        named = "r0" if follows and k else ""
        msg = messages.Submit(
            request=f"r{k}", session=f"g{k}", append=[1] * 40, gen=2, follows=named
        )
        assert client(rig, msg) == []


def prefilled(request: str, job: messages.LoadJobMsg) -> messages.PrefillDone:
    return messages.PrefillDone(request, 0, 5, 0, 0, 0.0, 0.0, attempt=job.attempt)  # PE 0


def queued(rig: RouterRig) -> list[str]:
    return sorted(r.id for r in rig.router.rounds.scheduler.queued_requests())


def test_followers_wait_on_a_leader_still_being_looked_up(slow):
    """However the lookups are answered, the followers of a leader being admitted follow it:
    they are parked until it is admitted, then wait on it outside the queue."""
    rounds = slow.router.rounds
    group(slow, 3)
    assert len(slow.answers) == 1  # the followers look nothing up while their leader is
    assert set(rounds.table.admitting) == {"r0", "r1", "r2"}
    slow.answers[0].set_result(2)
    poll(slow)
    assert queued(slow) == ["r0"] and rounds.group.following == {"r1", "r2"}
    assert [f.id for f in rounds.waiting_followers("r0")] == ["r1", "r2"]
    # their own lookups (what they read were they to run on their own) come after
    assert len(slow.answers) == 3
    slow.answers[1].set_result(2)
    slow.answers[2].set_exception(OSError("disk gone"))  # (it reads nothing then)
    poll(slow)
    r1, r2 = rounds.table.requests["r1"], rounds.table.requests["r2"]
    assert (r1.request.cached_tokens, len(r1.keys)) == (2 * 16, 2)  # 16 tokens a block
    assert (r2.request.cached_tokens, r2.keys) == (0, [])
    # the leader's first token takes them to its DE as forks of its prompt
    (job,) = slow.assign()
    slow.handle(prefilled("r0", job), PE_ID)
    (ft,) = [m for _, m in slow.sent if isinstance(m, messages.FirstToken)]
    assert [j.request for j in ft.forks] == ["r1", "r2"] and not rounds.group.following


def test_followers_of_a_leader_that_failed_its_lookup_run_on_their_own(slow):
    rounds = slow.router.rounds
    group(slow, 3)
    slow.answers[0].set_exception(OSError("disk gone"))
    (err,) = poll(slow)
    assert err.ref == "r0" and err.kind == "store"
    assert len(slow.answers) == 3  # each follower looks its prefix up now
    slow.answers[1].set_result(0)
    slow.answers[2].set_result(1)
    poll(slow)
    assert queued(slow) == ["r1", "r2"] and not rounds.group.following
    assert rounds.table.requests["r2"].request.cached_tokens == 16


def test_a_follower_of_a_leader_past_its_prefill_runs_on_its_own(slow):
    rounds = slow.router.rounds
    group(slow, 1)
    slow.answers[0].set_result(0)
    poll(slow)
    (job,) = slow.assign()
    slow.handle(prefilled("r0", job), PE_ID)
    assert client(slow, messages.OpenSession(session="late")) == [messages.Ack(ref="late")]
    late = messages.Submit(request="r9", session="late", append=[1] * 40, gen=2, follows="r0")
    assert client(slow, late) == []
    slow.answers[1].set_result(0)
    poll(slow)
    assert "r9" in queued(slow) and not rounds.group.following


def test_fork_identical_rounds_follow_the_first_of_their_prompt_while_it_is_looked_up(slow):
    rounds = slow.router.rounds
    rounds.group.fork_identical = True
    group(slow, 3, follows=False)
    assert len(slow.answers) == 1
    slow.answers[0].set_result(0)
    poll(slow)
    assert queued(slow) == ["r0"] and rounds.group.following == {"r1", "r2"}
    # a different prompt leads its own
    assert client(slow, messages.OpenSession(session="x")) == [messages.Ack(ref="x")]
    assert client(slow, messages.Submit(request="rx", session="x", append=[2], gen=1)) == []
    slow.answers[-1].set_result(0)
    poll(slow)
    assert queued(slow) == ["r0", "rx"]
