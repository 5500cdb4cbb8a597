"""`run_trajectories` with tool-call gaps between rounds, session retention and the closing of
each trajectory's session, against a fake backend that records what it is asked (no model, no
JAX): rounds keep their order, a gap delays only its own trajectory's round, the retention
reaches `open_session` (and nothing extra when none is set), and every session is closed once
its trajectory ends, failed or not."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest

from dualpath_jax.model.sampling_params import GREEDY
from dualpath_jax.rollout import (
    Backend,
    RolloutError,
    Round,
    RoundResult,
    Session,
    Trajectory,
    run_trajectories,
)

GAP = 0.05


def result(request: str, tokens: list[int]) -> RoundResult:
    return RoundResult(
        request=request,
        tokens=tokens,
        ttft_s=0.0,
        ttst_s=0.0,
        tpot_s=0.0,
        jct_s=0.0,
        queue_s=0.0,
        cached_tokens=0,
        prompt_tokens=1,
        read_path="none",
        recomputed_blocks=0,
    )


def traj(tid: str, *rounds: Round) -> Trajectory:
    return Trajectory(tid, rounds)


class Recorder(Backend):
    """A backend whose rounds are done at once (their tokens: the appended ones, then `gen`
    copies of the last); it logs every call in order as `(call, session, detail, thread)`.
    `fail` names sessions whose rounds fail."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.fail = fail
        self.log: list[tuple[str, str, object, threading.Thread]] = []
        self.opened: dict[str, dict] = {}
        self._lock = threading.Lock()

    def _note(self, call: str, session: str, detail: object) -> None:
        with self._lock:
            self.log.append((call, session, detail, threading.current_thread()))

    def open_session(self, session, resume=False, **retention):
        self.opened[session] = {"resume": resume, **retention}
        self._note("open", session, retention)

    def close_session(self, session, release=False):
        self._note("close", session, release)

    def submit(self, session, append, gen, *, sampling=GREEDY, stop_tokens=()):
        self._note("submit", session, list(append))
        fut: futures.Future[RoundResult] = futures.Future()
        if session in self.fail:
            fut.set_exception(RolloutError(f"round of {session} refused", "bad_request"))
        else:
            fut.set_result(result(session, [append[-1]] * gen))
        return fut

    def calls(self, session: str) -> list[tuple[str, object]]:
        """What `session` was asked, in order."""
        return [(c, d) for c, s, d, _ in self.log if s == session]


class LegacyBackend(Recorder):
    """A backend written before session retention: `open_session` takes no retention."""

    def open_session(self, session, resume=False):  # type: ignore[override]
        super().open_session(session, resume)


def test_a_gap_delays_its_round_on_a_timer_and_the_session_closes_after_the_last():
    backend = Recorder()
    trajs = [
        traj("t0", Round((1,), 1), Round((2,), 1, gap_s=GAP), Round((3,), 1, gap_s=0.0)),
        traj("t1", Round((4,), 1), Round((5,), 1)),
    ]
    outs = run_trajectories(backend, trajs, progress=False)
    assert [o.error for o in outs] == ["", ""]
    assert outs[0].rounds == [[1], [2], [3]] and outs[1].rounds == [[4], [5]]
    assert backend.calls("t0") == [
        ("open", {}),
        ("submit", [1]),
        ("submit", [2]),
        ("submit", [3]),
        ("close", False),
    ]
    assert backend.calls("t1") == [("open", {}), ("submit", [4]), ("submit", [5]), ("close", False)]
    # The first round goes at once; the gapped one waits on a timer (the tool call), and the
    # round after it, with no gap, follows it at once on that thread.
    threads = {d[0]: t for c, s, d, t in backend.log if c == "submit"}
    assert not isinstance(threads[1], threading.Timer)
    assert isinstance(threads[2], threading.Timer) and threads[3] is threads[2]
    assert not isinstance(threads[4], threading.Timer) and threads[5] is threads[4]


class ManualTimer:
    """Stands in for `threading.Timer`: records each gap and runs its round only when the test
    calls `fire`."""

    made: list[ManualTimer] = []

    def __init__(self, interval, function, args=()):
        self.interval, self.function, self.args = interval, function, args
        self.started = self.cancelled = False
        self.daemon = False
        ManualTimer.made.append(self)

    def start(self) -> None:
        self.started = True

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        self.function(*self.args)


def test_a_gap_holds_back_only_its_own_trajectory(monkeypatch):
    """While t0 is in its tool call, t1 runs to its end; t0's next round waits for the timer,
    which gets the round's gap (a first round's gap is ignored: nothing precedes it)."""
    monkeypatch.setattr(ManualTimer, "made", [])
    monkeypatch.setattr(threading, "Timer", ManualTimer)
    seen_at_fire: list[list] = []

    class FiresWhenT1Closes(Recorder):
        """Ends t0's tool call when t1's session closes (t1 has run every round by then)."""

        def close_session(self, session, release=False):
            super().close_session(session, release)
            if session == "t1":
                seen_at_fire.append(self.calls("t0"))
                for timer in ManualTimer.made:
                    timer.fire()

    backend = FiresWhenT1Closes()
    trajs = [
        traj("t0", Round((1,), 1, gap_s=9.0), Round((2,), 1, gap_s=0.25), Round((3,), 1)),
        traj("t1", Round((4,), 1), Round((5,), 1)),
    ]
    outs = run_trajectories(backend, trajs, progress=False)
    (timer,) = ManualTimer.made
    assert timer.started and timer.interval == 0.25 and timer.args == (0, 1)  # round 1 of t0
    assert seen_at_fire == [[("open", {}), ("submit", [1])]]  # t0 waited for its timer
    assert [o.rounds for o in outs] == [[[1], [2], [3]], [[4], [5]]]
    assert backend.calls("t0")[1:] == [
        ("submit", [1]),
        ("submit", [2]),
        ("submit", [3]),
        ("close", False),
    ]
    order = [d[0] for c, _, d, _ in backend.log if c == "submit"]
    assert order == [1, 4, 5, 2, 3]


def test_retention_reaches_open_session():
    backend = Recorder()
    trajs = [traj(f"t{k}", Round((k,), 1)) for k in range(3)]
    run_trajectories(backend, trajs, progress=False, priority=[3, -1, 0], ttl_s=12.0)
    assert [backend.opened[f"t{k}"] for k in range(3)] == [
        {"resume": False, "priority": 3, "ttl_s": 12.0},
        {"resume": False, "priority": -1, "ttl_s": 12.0},
        {"resume": False, "priority": 0, "ttl_s": 12.0},
    ]
    backend = Recorder()
    run_trajectories(backend, trajs, progress=False, priority=5)
    assert all(backend.opened[f"t{k}"] == {"resume": False, "priority": 5, "ttl_s": -1.0}
               for k in range(3))  # fmt: skip


@pytest.mark.parametrize("priority", [[1, 2], [1, 2, 3, 4], []])
def test_one_priority_per_trajectory_or_a_value_error(priority):
    backend = Recorder()
    trajs = [traj(f"t{k}", Round((k,), 1)) for k in range(3)]
    with pytest.raises(ValueError, match=f"{len(priority)} priorities for 3 trajectories"):
        run_trajectories(backend, trajs, progress=False, priority=priority)
    assert backend.log == []  # refused before any session opened


def test_without_retention_backends_get_the_old_call():
    backend = LegacyBackend()
    Session(backend, "s")
    Session(backend, "s", resume=True)
    assert backend.opened["s"] == {"resume": True}
    trajs = [traj("t", Round((1,), 2), Round((2,), 1, gap_s=GAP))]
    outs = run_trajectories(backend, trajs, progress=False)
    assert outs[0].error == "" and outs[0].rounds == [[1, 1], [2]]
    assert backend.calls("t") == [
        ("open", {}),
        ("submit", [1]),
        ("submit", [2]),
        ("close", False),
    ]


def test_a_session_with_retention_passes_it():
    backend = Recorder()
    Session(backend, "a", priority=2)
    Session(backend, "b", ttl_s=0.0)
    Session(backend, "c", priority=0, ttl_s=-1.0)  # the defaults: nothing extra
    assert backend.opened == {
        "a": {"resume": False, "priority": 2, "ttl_s": -1.0},
        "b": {"resume": False, "priority": 0, "ttl_s": 0.0},
        "c": {"resume": False},
    }


@pytest.mark.parametrize("release", [False, True])
def test_every_trajectory_closes_its_session_failed_or_not(release):
    backend = Recorder(fail=("bad",))
    trajs = [
        traj("ok", Round((1,), 1), Round((2,), 1)),
        traj("bad", Round((3,), 1), Round((4,), 1)),
        traj("empty"),
    ]
    outs = run_trajectories(backend, trajs, progress=False, release=release)
    assert [bool(o.error) for o in outs] == [False, True, False]
    assert "round of bad refused" in outs[1].error
    assert backend.calls("ok")[-1] == ("close", release)
    assert backend.calls("bad") == [("open", {}), ("submit", [3]), ("close", release)]
    assert backend.calls("empty") == [("open", {}), ("close", release)]


def test_a_failed_close_is_reported_on_its_trajectory():
    class CloseFails(Recorder):
        def close_session(self, session, release=False):
            raise RolloutError(f"unknown session {session!r}", "bad_request")

    outs = run_trajectories(CloseFails(), [traj("t", Round((1,), 1))], progress=False)
    assert outs[0].rounds == [[1]]
    assert outs[0].error == "closing the session failed: unknown session 't'"


class Stalling(Recorder):
    """Rounds of `stall` sessions never finish on their own: the test completes them later."""

    def __init__(self, stall: tuple[str, ...]):
        super().__init__()
        self.stall = stall
        self.pending: list[futures.Future] = []

    def submit(self, session, append, gen, **kw):
        if session not in self.stall:
            return super().submit(session, append, gen, **kw)
        self._note("submit", session, list(append))
        fut: futures.Future[RoundResult] = futures.Future()
        self.pending.append((fut, session, [append[-1]] * gen))
        return fut


def test_after_the_timeout_no_round_starts_and_the_unfinished_sessions_close():
    backend = Stalling(stall=("slow",))
    trajs = [
        traj("slow", Round((1,), 1), Round((2,), 1)),
        traj("fast", Round((3,), 1), Round((4,), 1)),
    ]
    outs = run_trajectories(backend, trajs, progress=False, timeout_s=0.2)
    assert outs[1].error == "" and outs[1].rounds == [[3], [4]]
    assert outs[0].error.startswith("timed out") and outs[0].rounds == []
    assert backend.calls("slow") == [("open", {}), ("submit", [1]), ("close", False)]
    # The stalled round completes after the call returned: nothing more is sent or recorded.
    ((fut, session, tokens),) = backend.pending
    fut.set_result(result(session, tokens))
    assert backend.calls("slow") == [("open", {}), ("submit", [1]), ("close", False)]
    assert outs[0].rounds == []


def test_tuples_are_still_taken_with_a_deprecation_warning():
    """The tuple form before `Trajectory` records (kept for one release) runs the same rounds."""
    typed = Recorder()
    want = run_trajectories(
        typed, [traj("t", Round((1,), 2), Round((2,), 1, gap_s=GAP))], progress=False
    )
    legacy = Recorder()
    with pytest.warns(DeprecationWarning, match="Trajectory records"):
        got = run_trajectories(legacy, [("t", [([1], 2), ([2], 1, GAP)])], progress=False)
    assert [o.rounds for o in got] == [o.rounds for o in want] == [[[1, 1], [2]]]
    assert legacy.calls("t") == typed.calls("t")


def test_an_append_that_is_a_length_is_refused_before_anything_opens():
    backend = Recorder()
    with pytest.raises(ValueError, match="materialize"):
        run_trajectories(backend, [traj("t", Round(3, 1))], progress=False)
    assert backend.log == []


def test_a_backend_outside_the_contract_is_refused():
    class Duck:  # the methods, not the contract
        open_session = close_session = submit = Recorder.submit

    with pytest.raises(TypeError, match="rollout.Backend"):
        run_trajectories(Duck(), [traj("t", Round((1,), 1))], progress=False)
    with pytest.raises(TypeError, match="rollout.Backend"):
        Session(Duck(), "s")
