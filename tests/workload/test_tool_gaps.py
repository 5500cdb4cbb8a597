"""Tool calls between rounds: `gap_s` in the JSONL trace, `workload.tool_gap_s` draws, and the
rounds `run_trajectories` is given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dualpath_jax.config import WorkloadConfig
from dualpath_jax.workload.arrivals import as_rounds, tool_gaps
from dualpath_jax.workload.trace import (
    Round,
    TraceError,
    Trajectory,
    materialize,
    parse_trajectory,
    trajectory_to_json,
    truncate,
)


def test_a_trace_round_carries_its_gap_through_parse_dump_materialize_and_truncate():
    line = (
        '{"id": "a", "rounds": [{"append": 5, "gen": 2}, {"append": 3, "gen": 1, "gap_s": 12.5}]}'
    )
    t = parse_trajectory(line)
    assert [r.gap_s for r in t.rounds] == [0.0, 12.5]
    assert parse_trajectory(trajectory_to_json(t)) == t
    assert '"gap_s"' not in trajectory_to_json(Trajectory("b", (Round(5, 2),)))
    m = materialize(t, vocab_size=50)
    assert [r.gap_s for r in m.rounds] == [0.0, 12.5] and len(m.rounds[1].append) == 3
    assert truncate(t, 100) == t
    assert as_rounds([m])[0][1][1] == (list(m.rounds[1].append), 1, 12.5)
    assert len(as_rounds([m])[0][1][0]) == 2  # no gap: the (ids, gen) pair as before


@pytest.mark.parametrize("gap", ["-1", '"soon"', "true", "1e999"])
def test_a_bad_gap_is_refused_naming_the_round(gap):
    line = f'{{"id": "a", "rounds": [{{"append": 5, "gen": 2, "gap_s": {gap}}}]}}'
    with pytest.raises(TraceError, match="round 0 of 'a': 'gap_s' must be a number >= 0"):
        parse_trajectory(line)


def test_a_round_refuses_a_negative_gap():
    with pytest.raises(ValueError, match="gap_s"):
        Round(5, 2, gap_s=-0.5)


def test_tool_gaps_draw_seeded_log_normal_gaps_after_the_first_round():
    trajs = [Trajectory(f"t{i}", tuple(Round(10, 2) for _ in range(50))) for i in range(40)]
    trajs[0] = Trajectory("t0", (Round(10, 2), Round(10, 2, gap_s=3.0)))
    w = WorkloadConfig(tool_gap_s=30.0, seed=4)
    got = tool_gaps(trajs, w)
    assert got == tool_gaps(trajs, w)  # seeded
    assert got != tool_gaps(trajs, dataclasses.replace(w, seed=5))
    assert all(t.rounds[0].gap_s == 0 for t in got)
    assert got[0].rounds[1].gap_s == 3.0  # the trace's own gap stays
    gaps = np.array([r.gap_s for t in got[1:] for r in t.rounds[1:]])
    assert (gaps > 0).all() and gaps.mean() == pytest.approx(30.0, rel=0.1)
    fixed = tool_gaps(trajs[1:], dataclasses.replace(w, tool_gap_sigma=0.0))
    assert {r.gap_s for t in fixed for r in t.rounds[1:]} == {30.0}
    assert tool_gaps(trajs, WorkloadConfig()) == trajs  # tool_gap_s=0: unchanged


def test_a_think_time_gap_survives_parse_dump_and_as_rounds_and_a_bad_flag_is_refused():
    line = (
        '{"id": "a", "rounds": [{"append": 5, "gen": 2},'
        ' {"append": 3, "gen": 1, "gap_s": 40.0, "tool_call": false}]}'
    )
    t = parse_trajectory(line)
    assert [r.tool_call for r in t.rounds] == [True, False]
    assert parse_trajectory(trajectory_to_json(t)) == t
    assert '"tool_call"' not in trajectory_to_json(Trajectory("b", (Round(5, 2, gap_s=1.0),)))
    m = materialize(t, vocab_size=50)
    assert as_rounds([m])[0][1][1] == (list(m.rounds[1].append), 1, 40.0, (), False)
    bad = line.replace("false", '"no"')
    with pytest.raises(TraceError, match="round 1 of 'a': 'tool_call' must be true or false"):
        parse_trajectory(bad)
