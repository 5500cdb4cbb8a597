"""Coding-agent session traces (Weka JSON, TraceLab JSONL) as trajectories: rounds, think-time
gaps, subagents and continuations with their start times, hash-id sharing as equal tokens; a trace
replayed as recorded (no expansion, cuts or scaling unless the run sets them), the up-front
context error, the workload record in summary.json; the public Weka sessions when they are
beside the repository."""

from __future__ import annotations

import csv
import json
import pathlib

import pytest
from trace_helpers import CPU_COST, REAL_TRACES, req

from dualpath_jax import launcher
from dualpath_jax.config import ConfigError, WorkloadConfig
from dualpath_jax.presets import emulated_cpu_experiment
from dualpath_jax.sim import simulate
from dualpath_jax.workload.arrivals import check_context, plan_agents, plan_workload
from dualpath_jax.workload.formats import read_trace
from dualpath_jax.workload.sessions import load_tracelab, load_weka, parse_weka_session
from dualpath_jax.workload.trace import Round, TraceError, Trajectory, materialize

# A session of 4-token blocks: a continuation (r1), a subagent sharing the parent's first block,
# and a rebuilt context (r2 keeps 1 of the previous request's 4 blocks: under half), which comes
# after the subagent's end and so waits for it.
SESSION = {
    "id": "s1",
    "block_size": 4,
    "hash_id_scope": "local",
    "requests": [
        req(0.0, 10, 3, [1, 2]),
        req(5.0, 18, 2, [1, 2, 3, 4], think=4.0),
        {
            "t": 9.0,  # when it returned, after 3 s: it started at 6
            "duration_ms": 3000,
            "type": "subagent",
            "agent_id": "agent_001",
            "requests": [req(0.0, 9, 1, [1, 7]), req(2.0, 12, 1, [1, 7, 8], think=1.0)],
        },
        req(30.0, 13, 2, [1, 9, 10], think=20.0),
    ],
}


def write_sessions(tmp_path, *sessions) -> pathlib.Path:
    d = tmp_path / "sessions"
    d.mkdir()
    for s in sessions:
        (d / f"{s['id']}.json").write_text(json.dumps(s))
    return d


def pieces_of(t: Trajectory) -> list[int]:
    return [c for c, _ in t.rounds[0].pieces]


def test_a_weka_session_is_a_trajectory_with_its_subagent_and_continuation():
    pairs = parse_weka_session(SESSION)
    by_id = {t.id: (t, start) for t, start in pairs}
    assert sorted(by_id) == ["s1", "s1:2", "s1:agent_001"]
    parent, start = by_id["s1"]
    assert start == 0.0
    # Round 0: 2 hashed blocks + a 2-token private tail; round 1: 18 - 10 - 3 new tokens after
    # the think time.
    assert [(r.append, r.gen, r.gap_s) for r in parent.rounds] == [(10, 3, 0.0), (5, 2, 4.0)]
    assert [n for _, n in parent.rounds[0].pieces] == [4, 4, 2]
    child, start = by_id["s1:agent_001"]
    assert start == 6.0  # the entry's time less its duration
    assert [(r.append, r.gen, r.gap_s) for r in child.rounds] == [(9, 1, 0.0), (2, 1, 1.0)]
    cont, start = by_id["s1:2"]
    assert start == 30.0 and [(r.append, r.gen) for r in cont.rounds] == [(13, 2)]
    assert cont.rounds[0].waits_for == ("s1:agent_001",) and cont.rounds[0].gap_s == 21.0
    # Equal hash ids, equal content; the parent's first block heads all three.
    assert pieces_of(parent)[0] == pieces_of(child)[0] == pieces_of(cont)[0]
    assert pieces_of(parent)[1] != pieces_of(child)[1]


def test_equal_hash_ids_give_equal_token_prefixes(tmp_path):
    trajs, starts = load_weka(write_sessions(tmp_path, SESSION))
    assert starts == [0.0, 6.0, 30.0]
    ids = {t.id: materialize(t, 257, seed=0).rounds[0].append for t in trajs}
    parent, child, cont = ids["s1"], ids["s1:agent_001"], ids["s1:2"]
    assert parent[:4] == child[:4] == cont[:4]
    assert parent[4:8] != child[4:8] and parent[4:8] != cont[4:8]


def test_hash_ids_are_per_session_unless_global(tmp_path):
    other = dict(SESSION, id="s2")
    trajs, _ = load_weka(write_sessions(tmp_path, SESSION, other))
    firsts = {t.id: t.rounds[0] for t in trajs}
    assert firsts["s1"].pieces[0][0] != firsts["s2"].pieces[0][0]  # "local": namespaced
    glob = [dict(SESSION, id=f"g{k}", hash_id_scope="global") for k in (1, 2)]
    trajs, _ = parse_weka_sessions(glob)
    assert trajs[0].rounds[0].pieces[:2] == trajs[1].rounds[0].pieces[:2] == ((1, 4), (2, 4))


def parse_weka_sessions(sessions):
    from dualpath_jax.workload.sessions import parse_weka

    return parse_weka([(s["id"], s) for s in sessions])


def test_weka_lengths_and_blocks_scale():
    pairs = parse_weka_session(SESSION, length_scale=0.5)
    parent = next(t for t, _ in pairs if t.id == "s1")
    # A 4-token block scales to 2, the 2-token tail to 1: 5 tokens; 3 generated -> 2.
    assert parent.rounds[0] == Round(5, 2, parent.rounds[0].pieces)
    assert [n for _, n in parent.rounds[0].pieces] == [2, 2, 1]
    assert parent.rounds[1].append == round(18 * 0.5) - 5 - 2


def test_weka_errors_name_the_request(tmp_path):
    bad = dict(SESSION, requests=[req(0.0, 4, 1, [1, 2, 3])])
    with pytest.raises(TraceError, match=r"s1 request 0: 3 hash_ids for 'in' 4"):
        parse_weka_session(bad)
    with pytest.raises(TraceError, match=r"'out' must be an int >= 0"):
        parse_weka_session(dict(SESSION, requests=[req(0.0, 4, -1, [1])]))
    with pytest.raises(TraceError, match="no \\*.json session files"):
        load_weka(tmp_path)


def tl_row(sid, k, n_in, n_out, events):
    return json.dumps(
        {
            "session_id": sid,
            "round_index": k,
            "input_tokens_total": n_in,
            "output_tokens": n_out,
            "timing_events": [
                {"event_type": e, "timestamp": f"2026-06-01T05:40:{s:06.3f}Z"} for e, s in events
            ],
        }
    )


def test_tracelab_rounds_become_trajectories_with_gaps(tmp_path):
    path = tmp_path / "rounds.jsonl"
    rows = [
        tl_row("a", 1, 130, 20, [("tool_result", 15.0), ("text", 17.0)]),
        tl_row("a", 0, 100, 10, [("user_message", 1.0), ("text", 3.0), ("tool_call", 4.0)]),
        tl_row("b", 0, 50, 5, [("user_message", 11.5), ("text", 12.0)]),
        "",
    ]
    path.write_text("\n".join(rows))
    trajs, starts = load_tracelab(path)
    assert [t.id for t in trajs] == ["a", "b"] and starts == [0.0, 10.5]
    a = trajs[0]
    # Round 1 arrives at its tool result (15 s), 11 s after round 0's last event (4 s).
    assert a.rounds == (Round(100, 10), Round(130 - 100 - 10, 20, gap_s=11.0))
    path.write_text("\n".join(rows[:2] + [rows[0]]))
    with pytest.raises(TraceError, match="round_index 1 twice"):
        load_tracelab(path)


# ----------------------------------------------------------------------------- replay as recorded


def test_a_run_switching_to_a_trace_replays_it_as_recorded(tmp_path):
    trace = str(write_sessions(tmp_path, SESSION))
    base = emulated_cpu_experiment(1, 1)  # a synthetic workload: 16 agents, 1/16, 1,024, 16
    cfg = launcher.run_config(base, "offline", trace=trace, trace_format="weka")
    w = cfg.workload
    assert (w.agents, w.length_scale, w.max_len, w.max_turns) == (None, 1.0, 0, 0)
    plan = plan_workload(cfg)
    assert [t.id for t in plan.trajectories] == ["s1", "s1:agent_001", "s1:2"]
    assert plan.record["expanded"] == 0 and plan.record["truncated"] == 0
    assert plan.record["agents"] == plan.record["trajectories"] == 3
    # What the run sets applies: --agents, --set workload.length_scale / max_len.
    cfg = launcher.run_config(
        base,
        "offline",
        overrides=["workload.length_scale=0.5", "workload.max_len=12"],
        agents=5,
        trace=trace,
        trace_format="weka",
    )
    w = cfg.workload
    assert (w.agents, w.length_scale, w.max_len, w.max_turns) == (5, 0.5, 12, 0)
    rec = plan_workload(cfg).record
    assert (rec["agents"], rec["expanded"], rec["length_scale"], rec["max_len"]) == (5, 2, 0.5, 12)
    # The synthetic workload keeps the config file's knobs.
    w = launcher.run_config(base, "offline").workload
    assert (w.agents, w.length_scale, w.max_len, w.max_turns) == (16, 1 / 16, 1024, 16)


def test_a_config_file_naming_its_trace_keeps_its_knobs(tmp_path):
    import dataclasses

    trace = str(write_sessions(tmp_path, SESSION))
    base = emulated_cpu_experiment(1, 1)
    base = dataclasses.replace(
        base,
        workload=dataclasses.replace(base.workload, trace=trace, trace_format="weka", agents=4),
    )
    w = launcher.run_config(base, "offline", trace=trace).workload
    assert (w.agents, w.length_scale) == (4, 1 / 16)


def test_a_trace_longer_than_the_context_fails_up_front(tmp_path):
    import dataclasses

    long = dict(SESSION, requests=[req(0.0, 10, 3, [1, 2]), req(1.0, 5000, 7, [1, 2])])
    trace = str(write_sessions(tmp_path, long))
    cfg = launcher.run_config(emulated_cpu_experiment(1, 1), "offline", trace=trace)
    cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, trace_format="weka"))
    trajs, _ = plan_agents(cfg)
    with pytest.raises(ConfigError) as e:
        check_context(cfg, trajs)
    msg = str(e.value)
    assert "round 1 of trajectory 's1'" in msg and "5007 tokens" in msg
    assert "cluster.decode_max_len" in msg and "workload.length_scale" in msg


def test_the_simulator_replays_a_weka_session_at_its_times(tmp_path):
    trace = str(write_sessions(tmp_path, SESSION))
    cfg = launcher.run_config(
        emulated_cpu_experiment(1, 1), "online", trace=trace, trace_format="weka", aps=0.0
    )
    run = simulate(cfg, cost=CPU_COST)
    s = run.summary
    assert (s["agents"], s["requests"], s["errors"]) == (3, 5, 0)
    assert s["workload"]["arrivals"] == "recorded" and s["workload"]["length_scale"] == 1.0


# ----------------------------------------------------------------------------- public sessions


@pytest.mark.skipif(
    not REAL_TRACES.is_dir(), reason="the public traces are not beside the repository"
)
def test_the_public_weka_sessions_parse_as_summarized():
    rows = {
        r["trace"]: r
        for r in csv.DictReader(open(REAL_TRACES / "weka_claude_code_sessions_summary.csv"))
    }
    files = sorted((REAL_TRACES / "weka_claude_code_sessions").glob("*.json"))
    assert len(files) == 28
    all_trajs, starts = load_weka(REAL_TRACES / "weka_claude_code_sessions")
    assert len(all_trajs) == len(starts) and starts == sorted(starts)
    for f in files:
        row = rows[f.stem]
        pairs = parse_weka_session(json.loads(f.read_text()), name=f.stem)
        own = [t for t, _ in pairs if t.id == f.stem or t.id.startswith(f"{f.stem}:") and
               t.id[len(f.stem) + 1:].isdigit()]  # fmt: skip
        subs = {t.id.split(":")[1] for t, _ in pairs if t not in own}
        assert sum(len(t.rounds) for t in own) == int(row["n_requests"]), f.stem
        assert len(subs) == int(row["n_subagents"]), f.stem
        first = next(t for t in own if t.id == f.stem)
        assert first.rounds[0].append == int(row["first_in"]), f.stem
    assert sum(int(rows[f.stem]["n_subagents"]) for f in files) == 12


@pytest.mark.skipif(
    not REAL_TRACES.is_dir(), reason="the public traces are not beside the repository"
)
def test_the_public_weka_sessions_simulate_scaled_down():
    cfg = launcher.run_config(
        emulated_cpu_experiment(1, 2),
        "offline",
        overrides=["workload.length_scale=0.015625"],
        trace=str(REAL_TRACES / "weka_claude_code_sessions"),
        trace_format="weka",
    )
    trajs, _ = read_trace(cfg.workload)
    run = simulate(cfg, cost=CPU_COST)
    s = run.summary
    assert s["errors"] == 0 and s["agents"] == len(trajs)
    assert s["requests"] == sum(len(t.rounds) for t in trajs) == 917
    assert s["workload"]["expanded"] == 0 and s["workload"]["length_scale"] == 1 / 64
    assert WorkloadConfig().agents == 8  # the synthetic default is unchanged


def test_a_gap_after_the_model_ended_its_turn_is_a_think_time_not_a_tool_call():
    reqs = [
        dict(req(0.0, 8, 2, [1, 2]), stop="tool_use"),
        dict(req(4.0, 12, 2, [1, 2, 3], think=2.0), stop="end_turn"),
        dict(req(60.0, 16, 2, [1, 2, 3, 4], think=50.0), stop="tool_use"),
        req(70.0, 20, 2, [1, 2, 3, 4, 5], think=5.0),  # after a tool call
    ]
    ((t, _),) = parse_weka_session({"id": "u", "block_size": 4, "requests": reqs})
    assert [r.gap_s for r in t.rounds] == [0.0, 2.0, 50.0, 5.0]
    assert [r.tool_call for r in t.rounds] == [True, True, False, True]
    assert "tool_call=False" in repr(t.rounds[2]) and "tool_call" not in repr(t.rounds[1])
