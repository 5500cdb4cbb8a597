"""Trace JSONL parsing and validation, the appendix A.3 replay rule, expansion, stats."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_jax.workload.trace import (
    Round,
    TraceError,
    Trajectory,
    dump_trace,
    expand,
    load_trace,
    materialize,
    parse_trace,
    prompt_tokens,
    trace_stats,
    truncate,
    turn_specs,
)

GOOD = [
    '{"id": "a", "rounds": [{"append": 5, "gen": 2}, {"append": [1, 2, 3], "gen": 1}]}',
    "",
    '{"id": "b", "rounds": [{"append": 4, "gen": 3}]}',
]


def test_parse_good_trace():
    a, b = parse_trace(GOOD)
    assert a == Trajectory("a", (Round(5, 2), Round((1, 2, 3), 1)))
    assert b.rounds == (Round(4, 3),)
    assert a.total_len == 5 + 2 + 3 + 1


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected an object"),
        ('{"id": "x"}', "line 2: 'rounds' must be a non-empty list"),
        ('{"id": "", "rounds": [{"append": 1, "gen": 1}]}', "line 2: 'id' must be a non-empty"),
        ('{"id": "x", "rounds": []}', "line 2: 'rounds' must be a non-empty list"),
        ('{"id": "x", "rounds": [{"append": 1}]}', "line 2: round 0 of 'x' must be an object"),
        ('{"id": "x", "rounds": [{"append": 1, "gen": 0}]}', "'gen' must be >= 1, got 0"),
        ('{"id": "x", "rounds": [{"append": -3, "gen": 1}]}', "'append' must be >= 1, got -3"),
        ('{"id": "x", "rounds": [{"append": 2.5, "gen": 1}]}', "'append' must be an int"),
        ('{"id": "x", "rounds": [{"append": true, "gen": 1}]}', "'append' must be an int"),
        ('{"id": "x", "rounds": [{"append": [], "gen": 1}]}', "'append' list is empty"),
        ('{"id": "x", "rounds": [{"append": [1, "a"], "gen": 1}]}', "token id must be an int"),
        (
            '{"id": "x", "rounds": [{"append": [1, 999], "gen": 1}]}',
            "token id 999 >= vocab size 257",
        ),
        (
            '{"id": "x", "extra": 1, "rounds": [{"append": 1, "gen": 1}]}',
            "unknown key(s) ['extra']",
        ),
        (
            '{"id": "a", "rounds": [{"append": 1, "gen": 1}]}',
            "line 2: duplicate id 'a' (first on line 1)",
        ),
    ],
)
def test_malformed_lines_name_the_line(line, message):
    with pytest.raises(TraceError) as e:
        parse_trace([GOOD[0], line], vocab_size=257)
    assert message in str(e.value)


def test_empty_trace_and_file_errors(tmp_path):
    with pytest.raises(TraceError, match="no trajectories"):
        parse_trace(["", "  "])
    p = tmp_path / "bad.jsonl"
    p.write_text(GOOD[0] + "\n" + '{"id": "z", "rounds": 3}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl: line 2"):
        load_trace(p)


def test_dump_load_round_trip(tmp_path):
    trajs = parse_trace(GOOD)
    p = tmp_path / "t.jsonl"
    dump_trace(trajs, p)
    assert load_trace(p) == trajs


def test_materialize_is_seeded_and_in_vocab():
    (a, _) = parse_trace(GOOD)
    m1, m2 = materialize(a, 50, seed=3), materialize(a, 50, seed=3)
    assert m1 == m2
    assert len(m1.rounds[0].append) == 5 and all(0 <= t < 50 for t in m1.rounds[0].append)
    assert m1.rounds[1].append == (1, 2, 3)  # explicit ids are kept
    assert materialize(a, 50, seed=4) != m1


def test_replay_rule_appendix_a3():
    t = Trajectory("t", (Round((1, 2), 2), Round((3,), 1), Round((4, 5, 6), 2)))
    specs = turn_specs(t)
    assert [(s.context, s.append, s.gen, s.prompt) for s in specs] == [
        (0, 2, 2, 2),
        (4, 1, 1, 5),
        (6, 3, 2, 9),
    ]
    g = [[90, 91], [92]]
    assert prompt_tokens(t, g, 0) == [1, 2]
    assert prompt_tokens(t, g, 1) == [1, 2, 90, 91, 3]  # A_1 G_1 A_2
    assert prompt_tokens(t, g, 2) == [1, 2, 90, 91, 3, 92, 4, 5, 6]  # A_1 G_1 A_2 G_2 A_3
    with pytest.raises(ValueError, match="must have generated 2 tokens"):
        prompt_tokens(t, [[90], [92]], 1)
    with pytest.raises(ValueError, match="not materialized"):
        prompt_tokens(Trajectory("u", (Round(3, 1),)), [], 0)


def test_expand_prepends_a_random_round_with_one_generated_token():
    base = parse_trace(GOOD)
    rng = np.random.default_rng(0)
    out = expand(base, 7, rng, max_first_append=8)
    assert out[:2] == base
    ids = [t.id for t in out]
    assert len(set(ids)) == 7
    for t in out[2:]:
        src = next(b for b in base if t.id.startswith(b.id + "+x"))
        assert t.rounds[0].gen == 1 and 1 <= t.rounds[0].append_len <= 8
        assert t.rounds[1:] == src.rounds
    assert expand(base, 7, np.random.default_rng(0), max_first_append=8) == out


def test_truncate_at_max_len():
    t = Trajectory("t", (Round(10, 5), Round(10, 5), Round(10, 5)))
    assert truncate(t, 30).rounds == t.rounds[:2]
    assert truncate(t, 100) == t
    cut = truncate(t, 8)  # the first round alone is too long: cut it
    assert cut.total_len <= 8 and cut.rounds[0].gen >= 1


def test_stats_on_a_hand_example():
    t1 = Trajectory("a", (Round(10, 2), Round(4, 2)))  # contexts 0, 12; total 18
    t2 = Trajectory("b", (Round(6, 1), Round(2, 1), Round(2, 1)))  # contexts 0, 7, 10; total 13
    s = trace_stats([t1, t2])
    assert s.turns == 2.5
    assert s.total == 15.5
    assert s.append == pytest.approx((7 + 10 / 3) / 2)
    assert s.gen == pytest.approx((2 + 1) / 2)
    assert s.context == pytest.approx((6 + 17 / 3) / 2)
    assert s.append_pooled == pytest.approx(24 / 5)
    assert s.context_pooled == pytest.approx(29 / 5)
    assert s.hit_rate == pytest.approx(s.context / (s.context + s.append))
    assert s.max_total == 18
