"""Trajectories that start after another trajectory's round (`Trajectory.after`: a subagent
starts when its parent's round that called it ends): which Weka round spawned each subagent and
with what delay, the JSONL field, the checks, and both replays: `run_trajectories` against a
fake backend whose rounds take a fixed time, and the simulator."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_rollout_waits import ROUND_S, Timed
from test_subagent_waits import SESSION
from trace_helpers import CPU_COST, WEKA_SESSIONS, req, sub

from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.rollout import run_trajectories
from dualpath_jax.sim import simulate
from dualpath_jax.workload.arrivals import as_rounds
from dualpath_jax.workload.sessions import load_weka, parse_weka_session
from dualpath_jax.workload.trace import (
    Round,
    TraceError,
    Trajectory,
    dump_trace,
    load_trace,
    parse_trace,
)

# test_subagent_waits' session (blocks of 4 tokens): request 0 is answered at 2 s and a and b
# start at 2.5 s; request 1 is sent at 15 s and answered at 16 s (`req`'s api_time is 1 s); c
# starts at 20 s.


def test_a_subagent_starts_after_the_parent_round_that_called_it():
    by = {t.id: t for t, _ in parse_weka_session(SESSION)}
    assert by["p"].after is None
    assert by["p:a"].after == ("p", 0, 0.5) and by["p:b"].after == ("p", 0, 0.5)
    assert by["p:c"].after == ("p", 1, 4.0)  # request 1: answered at 16 s, c started at 20 s


def test_nested_and_continued_parents():
    inner = sub("x", 6.0, [req(0.0, 8, 1, [3])], 4.0)  # ran 2..6 within its parent's time
    outer = sub("o", 30.0, [req(0.0, 8, 1, [2], api=1.0), inner, req(7.0, 12, 1, [2, 4])], 20.0)
    session = {"id": "q", "block_size": 4,
               "requests": [req(0.0, 8, 1, [1]), outer, req(31.0, 12, 1, [1, 5])]}  # fmt: skip
    by = {t.id: t for t, _ in parse_weka_session(session)}
    assert by["q:o"].after == ("q", 0, 9.0)
    assert by["q:o:x"].after == ("q:o", 0, 1.0)  # o's request 0 answered at 11, x began at 12
    # a rebuilt context: the spawning request is round 0 of the continuation q:2
    rebuilt = {"id": "q", "block_size": 4, "requests": [
        req(0.0, 8, 1, [1]), req(10.0, 12, 1, [9, 9, 9], api=1.0),
        sub("s", 20.0, [req(0.0, 8, 1, [4])], 5.0), req(21.0, 16, 1, [9, 9, 9, 8])]}  # fmt: skip
    by = {t.id: t for t, _ in parse_weka_session(rebuilt)}
    assert by["q:s"].after == ("q:2", 0, 4.0)


def test_the_jsonl_field_round_trips_and_is_checked(tmp_path):
    trajs = [t for t, _ in parse_weka_session(SESSION)]
    dump_trace(trajs, tmp_path / "t.jsonl")
    back = load_trace(tmp_path / "t.jsonl")  # (the JSONL keeps lengths, not content pieces)
    assert [(t.id, t.after) for t in back] == [(t.id, t.after) for t in trajs]
    line = {"id": "c", "rounds": [{"append": 3, "gen": 1}]}
    head = json.dumps({"id": "p", "rounds": [{"append": 3, "gen": 1}, {"append": 2, "gen": 1}]})
    ok = json.dumps({**line, "after": {"id": "p", "round": 1, "delay_s": 0.25}})
    assert parse_trace([head, ok])[1].after == ("p", 1, 0.25)
    for bad, why in [
        ({"id": "p", "round": 1}, "must be an object with"),
        ({"id": "p", "round": -1, "delay_s": 0}, "round index >= 0"),
        ({"id": "p", "round": 2, "delay_s": 0}, "not in the trace"),
        ({"id": "zz", "round": 0, "delay_s": 0}, "not in the trace"),
    ]:
        with pytest.raises(TraceError, match=why):
            parse_trace([head, json.dumps({**line, "after": bad})])
    # the parent's round 0 waits for c, which starts after its round 1: never
    waits = json.dumps(
        {
            "id": "p",
            "rounds": [{"append": 3, "gen": 1, "waits_for": ["c"]}, {"append": 2, "gen": 1}],
        }
    )
    with pytest.raises(TraceError, match="cycle"):
        parse_trace([waits, ok])
    with pytest.raises(ValueError, match="round index"):
        Trajectory("c", (Round(3, 1),), ("p", 1.5, 0.0))
    # the tuple form (`as_rounds`): the third field
    child = Trajectory("c", (Round((4, 5), 1),), ("p", 1, 0.25))
    assert as_rounds([child]) == [("c", [([4, 5], 1)], ("p", 1, 0.25))]


DELAY = 0.1
PARENT = Trajectory("p", (Round((1,), 1), Round((2,), 1, gap_s=0.2), Round((3,), 1)))


def child(*ids: int, after: tuple[str, int, float]) -> Trajectory:
    """A trajectory "c" of one-token rounds `ids` starting after `after`."""
    return Trajectory("c", tuple(Round((i,), 1) for i in ids), after)


def test_run_trajectories_starts_a_child_after_its_parents_round():
    backend = Timed()
    outs = run_trajectories(backend, [PARENT, child(10, 11, after=("p", 1, DELAY))], progress=False)
    assert not any(o.error for o in outs)
    # round 1 of p ended, then c's first round went DELAY later (not at the call's start)
    assert backend.at("submit", 10) - backend.at("done", 2) >= DELAY - 0.01
    assert backend.at("submit", 10) > backend.at("submit", 2) + ROUND_S


def test_a_child_starts_when_its_parent_fails_before_the_round():
    backend = Timed(fail=("p",))
    outs = run_trajectories(backend, [PARENT, child(10, after=("p", 2, 0.0))], progress=False)
    assert outs[0].error and not outs[1].error and outs[1].rounds == [[10]]
    assert backend.at("submit", 10) >= backend.at("done", 1)


def test_run_trajectories_refuses_what_could_never_start():
    waits = Trajectory("p", (Round((1,), 1, waits_for=("c",)), Round((2,), 1)))
    with pytest.raises(ValueError, match="cycle"):
        run_trajectories(Timed(), [waits, child(10, after=("p", 1, 0.0))], progress=False)
    with pytest.raises(ValueError, match="max_concurrent"):
        run_trajectories(
            Timed(), [PARENT, child(10, after=("p", 0, 0.0))], max_concurrent=2, progress=False
        )
    # a parent not in the call: the child starts at its arrival
    outs = run_trajectories(Timed(), [child(10, after=("gone", 0, 5.0))], progress=False)
    assert outs[0].rounds == [[10]]


def _sim(trajs, arrivals):
    run = simulate(
        emulated_cpu_experiment(1, 1), cost=CPU_COST, trajectories=trajs, arrivals=arrivals
    )
    out: dict[str, list] = {}
    for r in run.cluster.results:
        head, _, k = r.request.rpartition("/r")
        out.setdefault(head.rpartition("/a")[0], []).append((int(k), r))
    return {t: [r for _, r in sorted(rs, key=lambda x: x[0])] for t, rs in out.items()}


def test_the_simulator_starts_a_child_after_its_parents_round():
    parent = Trajectory("p", (Round(100, 8), Round(30, 8, gap_s=0.5), Round(30, 8)))
    child = Trajectory("c", (Round(200, 8),), ("p", 1, 0.75))
    got = _sim([parent, child], [0.0, 0.0])
    end = got["p"][1].submit_s + got["p"][1].jct_s
    assert got["c"][0].submit_s == pytest.approx(end + 0.75)
    free = _sim([parent, dataclasses.replace(child, after=None)], [0.0, 0.0])
    assert free["c"][0].submit_s == 0.0  # at its arrival without `after`


@pytest.mark.skipif(not WEKA_SESSIONS.exists(), reason="public traces not present")
def test_the_public_sessions_subagents_start_after_their_parents_rounds():
    trajs, _ = load_weka(WEKA_SESSIONS)
    children = [t for t in trajs if t.after]
    assert len(children) == 12
    ids = {t.id: t for t in trajs}
    for t in children:
        parent = ids[t.after[0]]
        assert t.after[1] < len(parent.rounds) and 0 <= t.after[2] < 5
