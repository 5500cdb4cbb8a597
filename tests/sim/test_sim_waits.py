"""The simulator honours `Round.waits_for` (subagents a turn waits for): a waiting round is
submitted only after the trajectories it names finished, its gap counted from the last end
(`workload.trace.submit_time`), a first round included; ids not in the run are ignored and a
cycle is refused; a Weka session replays its subagent waits online; with tool-gap prefetch the
gap after the subagents is prefetched like any tool call; the public sessions' waiting rounds go
after their subagents."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest
from trace_helpers import CPU_COST, WEKA_SESSIONS, req, sub

from dualpath_jax import launcher
from dualpath_jax.presets import emulated_cpu_experiment, paper_experiment
from dualpath_jax.sim import simulate
from dualpath_jax.workload.sessions import load_weka
from dualpath_jax.workload.trace import Round, TraceError, Trajectory


def by_round(run) -> dict[tuple[str, int], object]:
    """`(trajectory id, round) -> RoundResult` of a simulated run."""
    out = {}
    for r in run.cluster.results:
        head, _, k = r.request.rpartition("/r")
        out[head.rpartition("/a")[0], int(k)] = r
    return out


def sim_rounds(trajs, arrivals=None):
    """The run of `trajs` on the CPU 1P1D layout, and each trajectory's results in round order."""
    run = simulate(
        emulated_cpu_experiment(1, 1), cost=CPU_COST, trajectories=trajs, arrivals=arrivals
    )
    out: dict[str, list] = {}
    for (tid, _), r in sorted(by_round(run).items()):
        out.setdefault(tid, []).append(r)
    return run, out


def end_of(results) -> float:
    return max(r.submit_s + r.jct_s for r in results)


CHILD = Trajectory("child", tuple(Round(200, 40, gap_s=1.0 if i else 0.0) for i in range(6)))


def parent(**waits):
    return Trajectory("parent", (Round(100, 8), Round(30, 8, gap_s=0.5, **waits), Round(30, 8)))


def test_the_simulator_submits_a_waiting_round_after_the_child_ends():
    _, free = sim_rounds([parent(), CHILD])
    run, waited = sim_rounds([parent(waits_for=("child",)), CHILD])
    child_end = end_of(waited["child"])
    # without the wait the parent's second round goes long before the child is done
    assert free["parent"][1].submit_s < end_of(free["child"]) - 1.0
    assert waited["parent"][1].submit_s == pytest.approx(child_end + 0.5)
    assert waited["parent"][2].submit_s >= waited["parent"][1].submit_s
    assert run.summary["errors"] == 0 and run.summary["requests"] == 9
    assert [len(r.tokens) for r in waited["parent"]] == [8, 8, 8]


def test_the_simulator_holds_a_waiting_first_round_and_ignores_ids_not_in_the_run():
    late = Trajectory("late", (Round(50, 4, gap_s=3.0, waits_for=("child", "gone")),))
    _, got = sim_rounds([CHILD, late], arrivals=[0.0, 1.0])
    assert got["late"][0].submit_s == pytest.approx(end_of(got["child"]) + 3.0)
    _, got = sim_rounds([CHILD, late], arrivals=[0.0, 1e4])  # it arrives after the child ended
    assert got["late"][0].submit_s == pytest.approx(1e4)
    with pytest.raises(TraceError, match="cycle"):
        a = Trajectory("a", (Round(5, 1, waits_for=("b",)),))
        sim_rounds([a, Trajectory("b", (Round(5, 1, waits_for=("a",)),))])


# 4-token blocks. Request 0 ends at 2 s and spawns a and b at 2.5 s; a returns at 12.5, b at
# 32.5: request 1 (15 s) waits for a (gap 2.5 s), not for b.
SESSION = {
    "id": "p",
    "block_size": 4,
    "requests": [
        req(0.0, 8, 2, [1, 2], api=2.0),
        sub("a", 12.5, [req(0.0, 8, 2, [7]), req(4.0, 14, 2, [7, 8, 9], think=1.0)], 10.0),
        sub("b", 32.5, [req(0.0, 8, 2, [7]), req(9.0, 14, 2, [7, 8, 9], think=8.0)], 30.0),
        req(15.0, 14, 2, [1, 2, 3], think=13.0),
        req(30.0, 24, 2, [1, 2, 3, 4, 5], think=3.0),
    ],
}


def test_a_weka_session_simulated_online_waits_for_its_subagents(tmp_path):
    d = tmp_path / "sessions"
    d.mkdir()
    (d / "p.json").write_text(json.dumps(SESSION))
    cfg = launcher.run_config(
        emulated_cpu_experiment(1, 1), "online", trace=str(d), trace_format="weka", aps=0.0
    )
    run = simulate(cfg, cost=CPU_COST)
    by = by_round(run)
    assert run.summary["errors"] == 0 and run.summary["requests"] == 7
    a_end, b_end = (end_of([r for (t, _), r in by.items() if t == c]) for c in ("p:a", "p:b"))
    p0_end = end_of([by["p", 0]])
    # they start as recorded after the parent's round that called them: 0.5 s after its end
    assert by["p:a", 0].submit_s == by["p:b", 0].submit_s == pytest.approx(p0_end + 0.5)
    # round 1 waits for a, with its gap after a's end; b (which runs 9 s more) goes on after it
    assert by["p", 1].submit_s == pytest.approx(max(a_end, p0_end) + 2.5)
    assert by["p", 1].submit_s < b_end


def _agent_sessions(tmp_path, n=6):
    """`n` coding-agent sessions of 64-token blocks: a 24K-token first turn, then a subagent of
    4 turns (about 25 s) the next turn waits for, 10 s after its end; then turns after 5-20 s
    tool calls. Sessions start 3 s apart."""
    d = tmp_path / "weka"
    d.mkdir(parents=True)
    for s in range(n):
        nxt, ids, t, ctx, reqs = s * 100_000, [], 3.0 * s, 24_000 + 512 * s, []
        for i in range(6):
            ids = ids + list(range(nxt + len(ids), nxt + ctx // 64))
            reqs.append(req(t, ctx, 200, ids, think=0.0, api=2.0))
            t += 2.0
            if i == 0:
                sub_ids, sub_reqs, sub_ctx = [], [], 12_000
                for j in range(4):
                    sub_ids = sub_ids + list(
                        range(nxt + 50_000 + len(sub_ids), nxt + 50_000 + sub_ctx // 64)
                    )
                    sub_reqs.append(
                        req(6.0 * j, sub_ctx, 200, sub_ids, think=1.0 if j else 0.0, api=5.0)
                    )
                    sub_ctx += 2_000
                reqs.append(sub("a", t + 25.0, sub_reqs, 25.0))
                t += 35.0
            else:
                t += 5.0 + 3.0 * ((s + i) % 6)
            ctx += 200 + 900
        (d / f"s{s}.json").write_text(
            json.dumps({"id": f"s{s}", "block_size": 64, "requests": reqs})
        )
    return d


def test_with_prefetch_the_turn_after_the_subagents_starts_sooner_with_the_same_hits(tmp_path):
    sessions = _agent_sessions(tmp_path)
    runs = {}
    for prefetch in (False, True):
        cfg, cost = paper_experiment("ds660b", 2, 4, policy="dualpath", snic_bytes_per_s=2e9)
        w = dataclasses.replace(cfg.workload, trace=str(sessions), trace_format="weka",
                                agents=None, mode="online", max_turns=0)  # fmt: skip
        sched = dataclasses.replace(cfg.scheduler, prefetch=prefetch)
        runs[prefetch] = simulate(dataclasses.replace(cfg, workload=w, scheduler=sched), cost=cost)
    waiting = [(f"s{s}", 1) for s in range(6)]
    for run in runs.values():
        by = by_round(run)
        assert run.summary["errors"] == 0 and len(by) == 6 * 6 + 6 * 4
        for tid, i in waiting:
            child = end_of([r for (t, _), r in by.items() if t == f"{tid}:a"])
            assert by[tid, i].submit_s == pytest.approx(max(child, end_of([by[tid, 0]])) + 10.0)
    off, on = (
        statistics.median(by_round(runs[p])[k].ttft_s for k in waiting) for p in (False, True)
    )
    assert on < 0.8 * off
    assert runs[True].cluster.counters["prefetch_hit_tokens"] > 0

    def key(run):
        return sorted((r.request, r.prompt_tokens, r.cached_tokens) for r in run.cluster.results)

    assert key(runs[True]) == key(runs[False])


@pytest.mark.skipif(
    not WEKA_SESSIONS.is_dir(), reason="the public traces are not beside the repository"
)
def test_the_public_sessions_simulated_waiting_rounds_go_after_their_subagents():
    cfg = launcher.run_config(
        emulated_cpu_experiment(1, 2),
        "offline",
        overrides=["workload.length_scale=0.015625"],
        trace=str(WEKA_SESSIONS),
        trace_format="weka",
    )
    run = simulate(cfg, cost=CPU_COST)
    assert run.summary["errors"] == 0 and run.summary["requests"] == 917
    by = by_round(run)
    ends: dict[str, float] = {}
    for (tid, _), r in by.items():
        ends[tid] = max(ends.get(tid, -math.inf), r.submit_s + r.jct_s)
    trajs, _ = load_weka(WEKA_SESSIONS, length_scale=1 / 64)
    n = 0
    for t in trajs:
        for i, rd in enumerate(t.rounds):
            if rd.waits_for:
                last = max(ends[w] for w in rd.waits_for)
                assert by[t.id, i].submit_s >= last + rd.gap_s - 1e-9
                n += 1
    assert n == 5
