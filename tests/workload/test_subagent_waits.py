"""Rounds that wait for other trajectories (`Round.waits_for`): which Weka rounds wait for their
subagents (the parent's next request came at or after the subagent's end) and with what gap, the
JSONL field, `submit_time`, cycles; the public sessions' parents wait for all 12 of their
subagents. The simulator's side: tests/sim/test_sim_waits.py; the local cluster's:
tests/test_rollout_waits.py and tests/integration/test_subagent_waits_cluster.py."""

from __future__ import annotations

import json

import pytest
from trace_helpers import WEKA_SESSIONS, req, sub

from dualpath_jax.workload.sessions import load_weka, parse_weka, parse_weka_session
from dualpath_jax.workload.trace import (
    Round,
    TraceError,
    Trajectory,
    check_waits,
    dump_trace,
    expand,
    load_trace,
    parse_trace,
    submit_time,
)

# Blocks of 4 tokens. The parent's request 0 ends at 2 s and spawns a and b at 2.5 s; a returns
# at 12.5, b at 32.5. Request 1 (15 s) came after a's end (waits for it, gap 2.5 s), before b's
# (the parent went on without b). c has no duration_ms: its requests span 4 s, so it ran from
# 20 to 24; request 2 (25 s) waits for it, gap 1 s. Request 3 is an ordinary think time.
SESSION = {
    "id": "p",
    "block_size": 4,
    "requests": [
        req(0.0, 8, 2, [1, 2], api=2.0),
        sub("a", 12.5, [req(0.0, 8, 2, [7]), req(4.0, 14, 2, [7, 8, 9], think=1.0)], 10.0),
        sub("b", 32.5, [req(0.0, 8, 2, [7])], 30.0),
        req(15.0, 14, 2, [1, 2, 3], think=13.0),
        sub("c", 24.0, [req(0.0, 8, 1, [5]), req(3.0, 12, 1, [5, 6], think=2.0)]),
        req(25.0, 20, 2, [1, 2, 3, 4], think=9.0),
        req(30.0, 24, 2, [1, 2, 3, 4, 5], think=3.0),
    ],
}


def test_a_parent_round_waits_for_the_subagents_that_ended_before_it():
    pairs = parse_weka_session(SESSION)
    starts = {t.id: s for t, s in pairs}
    assert starts == {"p": 0.0, "p:a": 2.5, "p:b": 2.5, "p:c": 20.0}
    parent = next(t for t, _ in pairs if t.id == "p")
    assert [(r.waits_for, r.gap_s) for r in parent.rounds] == [
        ((), 0.0),
        (("p:a",), 2.5),  # not b: it was still running at 15 s
        (("p:c",), 1.0),  # c's end is its entry's t: 20 + its requests' span
        ((), 3.0),  # the recorded think time
    ]
    for t, _ in pairs:  # subagents wait for nobody
        assert t.id == "p" or not any(r.waits_for for r in t.rounds)


def test_a_continuation_after_a_subagent_waits_for_it_in_its_first_round():
    rebuilt = dict(SESSION, requests=[*SESSION["requests"][:2], req(40.0, 12, 2, [9, 9, 9])])
    pairs = parse_weka_session(rebuilt)
    cont = next(t for t, _ in pairs if t.id == "p:2")
    # a returned at 12.5 and the rebuilt context (a new trajectory) came at 40
    assert cont.rounds[0].waits_for == ("p:a",) and cont.rounds[0].gap_s == 27.5


def test_nested_subagents_wait_in_their_parent_subagent():
    inner = sub("x", 6.0, [req(0.0, 8, 1, [3])], 4.0)  # ran 2..6 within its parent's time
    outer = sub("o", 30.0, [req(0.0, 8, 1, [2], api=1.0), inner, req(7.0, 12, 1, [2, 4])], 20.0)
    session = {"id": "q", "block_size": 4,
               "requests": [req(0.0, 8, 1, [1]), outer, req(31.0, 12, 1, [1, 5])]}  # fmt: skip
    pairs = parse_weka_session(session)
    by = {t.id: (t, s) for t, s in pairs}
    assert by["q:o"][1] == 10.0 and by["q:o:x"][1] == 12.0
    assert by["q:o"][0].rounds[1].waits_for == ("q:o:x",) and by["q:o"][0].rounds[1].gap_s == 1.0
    assert by["q"][0].rounds[1].waits_for == ("q:o",)  # only its own child, not the grandchild


def test_the_waits_and_their_gaps_survive_a_jsonl_round_trip(tmp_path):
    trajs, _ = parse_weka([("p", SESSION)])
    dump_trace(trajs, tmp_path / "p.jsonl")
    back = load_trace(tmp_path / "p.jsonl")  # (JSONL keeps lengths, not the content pieces)
    assert [[(r.gap_s, r.waits_for) for r in t.rounds] for t in back] == [
        [(r.gap_s, r.waits_for) for r in t.rounds] for t in trajs
    ]
    line = (tmp_path / "p.jsonl").read_text().splitlines()[0]
    assert '"waits_for":["p:a"]' in line
    r = Round(3, 1, gap_s=2.5, waits_for=("p:a",))
    assert repr(r) == "Round(append=3, gen=1, gap_s=2.5, waits_for=('p:a',))"


def test_jsonl_waits_must_name_trajectories_of_the_trace_without_a_cycle():
    def parse(*rounds_by_id):
        return parse_trace(json.dumps({"id": i, "rounds": rs}) for i, rs in rounds_by_id)

    ok = parse(("c", [{"append": 3, "gen": 1}]), ("p", [{"append": 3, "gen": 1},
               {"append": 2, "gen": 1, "gap_s": 1, "waits_for": ["c"]}]))  # fmt: skip
    assert ok[1].rounds[1].waits_for == ("c",)
    with pytest.raises(TraceError, match="line 1: round 0 of 'p' waits for 'x', which is not in"):
        parse(("p", [{"append": 3, "gen": 1, "waits_for": ["x"]}]))
    with pytest.raises(TraceError, match="must be a list of trajectory ids"):
        parse(("p", [{"append": 3, "gen": 1, "waits_for": "c"}]))
    with pytest.raises(TraceError, match="cycle: a -> b -> a"):
        parse(("a", [{"append": 3, "gen": 1, "waits_for": ["b"]}]),
              ("b", [{"append": 3, "gen": 1}, {"append": 3, "gen": 1, "waits_for": ["a"]}]))  # fmt: skip
    with pytest.raises(TraceError, match="cycle: a -> a"):
        check_waits([Trajectory("a", (Round(3, 1, waits_for=("a",)),))])
    check_waits([Trajectory("a", (Round(3, 1, waits_for=("gone",)),))])  # not in the run: ignored


def test_submit_time_counts_the_gap_from_the_later_end():
    assert submit_time(10.0, 2.0, [], first=False) == 12.0  # a plain tool call
    assert submit_time(10.0, 2.0, [15.0, 13.0], first=False) == 17.0  # the last subagent's end
    assert submit_time(10.0, 2.0, [5.0], first=False) == 12.0  # it ended before the turn did
    assert submit_time(10.0, 2.0, [], first=True) == 10.0  # a first round: at its arrival
    assert submit_time(10.0, 2.0, [9.0], first=True) == 11.0
    assert submit_time(10.0, 2.0, [5.0], first=True) == 10.0


def test_copies_of_a_waiting_trajectory_wait_for_nobody():
    import numpy as np

    t = Trajectory("p", (Round(3, 1), Round(2, 1, waits_for=("c",))))
    copies = expand([t], 3, np.random.default_rng(0))
    assert copies[0] is t and all(not r.waits_for for c in copies[1:] for r in c.rounds)


# ----------------------------------------------------------------------------- public sessions


@pytest.mark.skipif(
    not WEKA_SESSIONS.is_dir(), reason="the public traces are not beside the repository"
)
def test_the_public_sessions_parents_wait_for_every_subagent():
    trajs, starts = load_weka(WEKA_SESSIONS)
    by_id = dict(zip([t.id for t in trajs], starts))
    waiting = [(t.id, i, r) for t in trajs for i, r in enumerate(t.rounds) if r.waits_for]
    waited = [w for _, _, r in waiting for w in r.waits_for]
    # 12 subagents in 4 sessions, each waited for by its parent's next turn (5 turns in all)
    assert len(waited) == len(set(waited)) == 12 and len(waiting) == 5
    assert {w.rsplit(":", 1)[0] for w in waited} == {
        "trace_0274", "trace_0277", "trace_0282", "trace_0291"}  # fmt: skip
    for tid, _, r in waiting:
        assert r.gap_s < 60 and all(by_id[w] > by_id[tid] for w in r.waits_for)
    # trace_0274's three start together just after its first request ended (t 0 + api 19 s),
    # not at their entries' t (161, 173 and 300 s: when each returned)
    assert [round(by_id[f"trace_0274:agent_00{k}"], 1) for k in (1, 2, 3)] == [19.5] * 3
