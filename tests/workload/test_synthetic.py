"""The synthetic generator against Table 2, its scaling knobs and the arrival schedules."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dualpath_jax.config import WorkloadConfig
from dualpath_jax.workload.arrivals import (
    agent_trajectories,
    offline_arrivals,
    poisson_arrivals,
    schedule,
)
from dualpath_jax.workload.synthetic import PRESETS, from_config, generate
from dualpath_jax.workload.trace import TraceError, dump_trace, trace_stats


@pytest.mark.parametrize("name", ["32k", "48k", "64k"])
def test_presets_match_table_2_within_5_percent(name):
    p = PRESETS[name]
    trajs = generate(name, 500, seed=1)
    s = trace_stats(trajs)
    t = p.target
    for ours, paper in [
        (s.turns, t.turns),
        (s.append, t.append),
        (s.gen, t.gen),
        (s.total, t.total),
        (s.context, t.context),
    ]:
        assert ours == pytest.approx(paper, rel=0.05)
    assert s.hit_rate == pytest.approx(t.context / (t.context + t.append), abs=0.005)
    assert s.max_total <= p.max_len
    assert all(r.append >= 1 and r.gen >= 1 for tr in trajs for r in tr.rounds)


def test_generation_is_a_pure_function_of_its_arguments():
    a = generate("32k", 20, seed=5)
    assert generate("32k", 20, seed=5) == a
    assert generate("32k", 20, seed=6) != a
    assert len({t.id for t in a}) == 20


def test_length_scale_makes_cpu_sized_replays():
    full = generate("64k", 50, seed=0)
    small = generate("64k", 50, seed=0, length_scale=1 / 64)
    assert max(t.total_len for t in small) <= 1024
    s_full, s_small = trace_stats(full), trace_stats(small)
    # Appends shrink about 64x (rounding to >= 1 token keeps a floor); turns are kept unless
    # the scaled trajectory would pass the scaled MaxLen.
    assert s_small.append == pytest.approx(s_full.append / 64, rel=0.35)
    assert s_small.turns <= s_full.turns


def test_append_and_gen_scales_truncate_at_max_len():
    base = generate("64k", 40, seed=2)
    doubled = generate("64k", 40, seed=2, append_scale=2.0)
    assert max(t.total_len for t in doubled) <= PRESETS["64k"].max_len
    b, d = trace_stats(base), trace_stats(doubled)
    assert d.append > 1.5 * b.append
    assert d.turns < b.turns  # trajectories now hit MaxLen earlier
    g = trace_stats(generate("64k", 40, seed=2, gen_scale=0.5))
    assert g.gen == pytest.approx(b.gen / 2, rel=0.05)
    tight = generate("64k", 40, seed=2, max_len=4096)
    assert max(t.total_len for t in tight) <= 4096


def test_from_config():
    cfg = WorkloadConfig(preset="48k", trajectories=7, seed=3, length_scale=0.25)
    trajs = from_config(cfg)
    assert len(trajs) == 7 and max(t.total_len for t in trajs) <= 48 * 1024 // 4
    with pytest.raises(KeyError, match="unknown trace preset"):
        from_config(dataclasses.replace(cfg, preset="128k"))


def test_from_config_reads_a_trace_file(tmp_path):
    p = tmp_path / "t.jsonl"
    dump_trace(generate("32k", 3, seed=0), p)
    cfg = WorkloadConfig(trace=str(p), max_len=1000)
    trajs = from_config(cfg)
    assert [t.id for t in trajs] == ["32k-0-0", "32k-0-1", "32k-0-2"]
    assert max(t.total_len for t in trajs) <= 1000
    p.write_text('{"id": "a", "rounds": [{"append": [300], "gen": 1}]}\n')
    with pytest.raises(TraceError, match="line 1: .*token id 300 >= vocab size 257"):
        from_config(cfg, vocab_size=257)


def test_offline_and_poisson_arrivals():
    assert [(a.time_s, a.agent) for a in offline_arrivals(3)] == [(0.0, 0), (0.0, 1), (0.0, 2)]
    arr = list(poisson_arrivals(2.0, np.random.default_rng(0), count=4000))
    times = np.array([a.time_s for a in arr])
    assert (np.diff(times) > 0).all() and [a.agent for a in arr[:3]] == [0, 1, 2]
    assert np.diff(times, prepend=0.0).mean() == pytest.approx(0.5, rel=0.05)
    within = list(poisson_arrivals(2.0, np.random.default_rng(0), duration_s=100.0))
    assert within and within[-1].time_s <= 100.0 and 150 < len(within) < 250
    again = list(poisson_arrivals(2.0, np.random.default_rng(0), duration_s=100.0))
    assert again == within
    with pytest.raises(ValueError, match="duration_s or count"):
        next(poisson_arrivals(1.0, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="aps must be > 0"):
        next(poisson_arrivals(0.0, np.random.default_rng(0), count=1))


def test_schedule_and_agent_trajectories_from_config():
    rng = np.random.default_rng(0)
    off = list(schedule(WorkloadConfig(mode="offline", agents=5), rng))
    assert len(off) == 5 and {a.time_s for a in off} == {0.0}
    on = list(schedule(WorkloadConfig(mode="online", aps=1.0, agents=6), rng))
    assert len(on) == 6 and on[-1].time_s > 0
    with pytest.raises(ValueError, match="offline' or 'online"):
        schedule(WorkloadConfig(mode="batch"), rng)
    trajs = generate("32k", 3, seed=0)
    agents = agent_trajectories(trajs, 8, np.random.default_rng(1), max_len=32 * 1024)
    assert len(agents) == 8 and agents[:3] == trajs
    assert all(t.total_len <= 32 * 1024 for t in agents)
