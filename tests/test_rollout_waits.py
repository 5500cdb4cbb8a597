"""`run_trajectories` with rounds that wait for other trajectories (`Round.waits_for`:
subagents), against a fake backend whose rounds take a fixed time (no model, no JAX): a waiting
round is submitted only after every trajectory it names has ended, its gap counted from the last
end; a failed subagent still ends; a waiting first round; ids not in the call are ignored; cycles
and waits that `max_concurrent` could starve are refused."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import pytest

from dualpath_jax.model.sampling_params import GREEDY
from dualpath_jax.rollout import (
    Backend,
    RolloutError,
    Round,
    RoundResult,
    Trajectory,
    run_trajectories,
)

ROUND_S = 0.05  # each fake round takes this long
GAP = 0.05


class Timed(Backend):
    """A backend whose rounds finish `ROUND_S` after their submission (tokens: `gen` copies of
    the last appended id). It logs `(event, session, first appended id, monotonic time)` for
    every submission and completion, and every tool_call hint. `fail`: sessions whose rounds
    fail."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.fail = fail
        self.log: list[tuple[str, str, object, float]] = []
        self._lock = threading.Lock()

    def _note(self, event: str, session: str, detail: object) -> None:
        with self._lock:
            self.log.append((event, session, detail, time.monotonic()))

    def open_session(self, session, resume=False, **retention):
        pass

    def close_session(self, session, release=False):
        pass

    def tool_call(self, session, expected_s):
        self._note("tool_call", session, expected_s)

    def submit(self, session, append, gen, *, sampling=GREEDY, stop_tokens=()):
        self._note("submit", session, append[0])
        fut: futures.Future[RoundResult] = futures.Future()

        def finish():
            self._note("done", session, append[0])
            if session in self.fail:
                fut.set_exception(RolloutError(f"round of {session} refused", "bad_request"))
            else:
                fut.set_result(_result(session, [append[-1]] * gen))

        threading.Timer(ROUND_S, finish).start()
        return fut

    def at(self, event: str, token: int) -> float:
        return next(t for e, _, d, t in self.log if e == event and d == token)

    def ended(self, session: str) -> float:
        return max(t for e, s, _, t in self.log if e == "done" and s == session)


def _result(request: str, tokens: list[int]) -> RoundResult:
    return RoundResult(request=request, tokens=tokens, ttft_s=0.0, ttst_s=0.0, tpot_s=0.0,
                       jct_s=0.0, queue_s=0.0, cached_tokens=0, prompt_tokens=1,
                       read_path="none", recomputed_blocks=0)  # fmt: skip


def traj(tid: str, *rounds: Round) -> Trajectory:
    return Trajectory(tid, rounds)


# three rounds and a gap: > 0.2 s
CHILD = traj("c", Round((10,), 1), Round((11,), 1, gap_s=GAP), Round((12,), 1))


def parent(*waits: str) -> Trajectory:
    return traj("p", Round((1,), 1), Round((2,), 1, gap_s=GAP, waits_for=waits), Round((3,), 1))


def test_a_waiting_round_goes_a_gap_after_the_child_ends():
    backend = Timed()
    outs = run_trajectories(backend, [parent("c"), CHILD], progress=False, timeout_s=30)
    assert [o.error for o in outs] == ["", ""]
    assert outs[0].rounds == [[1], [2], [3]] and outs[1].rounds == [[10], [11], [12]]
    assert backend.at("submit", 2) >= backend.ended("c") + GAP
    free = Timed()
    run_trajectories(free, [parent(), CHILD], progress=False, timeout_s=30)
    assert free.at("submit", 2) < free.ended("c") - ROUND_S  # without it: long before


def test_it_waits_for_every_named_trajectory_and_hints_the_gap_after_the_last():
    backend = Timed()
    other = traj("d", Round((20,), 1))
    outs = run_trajectories(
        backend, [parent("c", "d"), CHILD, other], progress=False, timeout_s=30, tool_calls=True
    )
    assert all(not o.error for o in outs)
    assert backend.at("submit", 2) >= max(backend.ended("c"), backend.ended("d")) + GAP
    hints = [d for e, s, d, _ in backend.log if e == "tool_call" and s == "p"]
    assert hints == [pytest.approx(GAP)]  # the gap after the child, not the whole wait


def test_a_think_time_gap_gets_no_tool_call_hint():
    backend = Timed()
    think = traj(
        "q", Round((1,), 1), Round((2,), 1, gap_s=GAP, tool_call=False), Round((3,), 1, gap_s=GAP)
    )
    outs = run_trajectories(backend, [think], progress=False, timeout_s=30, tool_calls=True)
    assert outs[0].error == "" and outs[0].rounds == [[1], [2], [3]]
    assert backend.at("submit", 2) >= backend.at("done", 1) + GAP  # the gap is kept
    hints = [d for e, _, d, _ in backend.log if e == "tool_call"]
    assert hints == [pytest.approx(GAP)]  # only before the third round


def test_a_failed_child_still_ends_and_releases_its_parent():
    backend = Timed(fail=("c",))
    outs = run_trajectories(backend, [parent("c"), CHILD], progress=False, timeout_s=30)
    assert outs[0].error == "" and outs[0].rounds == [[1], [2], [3]]
    assert "refused" in outs[1].error
    assert backend.at("submit", 2) >= backend.ended("c") + GAP


def test_a_waiting_first_round_and_ids_not_in_the_call():
    backend = Timed()
    late = traj("late", Round((30,), 1, waits_for=("c", "not-here")))
    outs = run_trajectories(backend, [CHILD, late], progress=False, timeout_s=30)
    assert all(not o.error for o in outs)
    assert backend.at("submit", 30) >= backend.ended("c")
    # only ids outside the call: no wait at all
    backend = Timed()
    run_trajectories(backend, [parent("x"), CHILD], progress=False, timeout_s=30)
    assert backend.at("submit", 2) < backend.ended("c")


def test_cycles_and_starvable_waits_are_refused():
    a = traj("a", Round((1,), 1, waits_for=("b",)))
    b = traj("b", Round((2,), 1), Round((3,), 1, waits_for=("a",)))
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        run_trajectories(Timed(), [a, b], progress=False)
    with pytest.raises(ValueError, match="waits for a later trajectory"):
        run_trajectories(Timed(), [parent("c"), CHILD], progress=False, max_concurrent=1)
    backend = Timed()  # the child first: one slot at a time works
    outs = run_trajectories(backend, [CHILD, parent("c")], progress=False, max_concurrent=1)
    assert all(not o.error for o in outs) and backend.at("submit", 1) >= backend.ended("c")
