"""`bench/agentic_traces.py`: every policy and store on the same Weka-format sessions (built here;
the public ones beside the repository in the slow test, skipped when absent)."""

from __future__ import annotations

import json
import pathlib

import pytest
from trace_helpers import WEKA_SESSIONS


def _sessions(tmp_path) -> pathlib.Path:
    d = tmp_path / "weka"
    d.mkdir()
    for s in range(3):
        reqs, ids, ctx = [], [], 20_000 + 640 * s
        for i in range(4):
            ids = ids + list(range(s * 1000 + len(ids), s * 1000 + ctx // 64))
            gap = 8.0 + 4 * i if i else 0.0
            reqs.append({"t": 2.0 * s + 20.0 * i, "type": "n", "in": ctx, "out": 100,
                         "hash_ids": ids, "think_time": gap})  # fmt: skip
            ctx += 900
        body = {"id": f"s{s}", "block_size": 64, "requests": reqs}
        (d / f"s{s}.json").write_text(json.dumps(body))
    return d


def test_rows_for_every_policy_and_store_with_the_same_hits(tmp_path, bench_modules):
    with bench_modules("agentic_traces") as (at,):
        rows = at.run_all(str(_sessions(tmp_path)), capacity_fraction=0.5, snic_gbps=16.0)
        table = at.format_table(rows)
    assert [(r["store"], r["run"]) for r in rows] == [
        (s, name) for s in ("unlimited", "limited") for name, _, _ in at.RUNS
    ]
    assert table.count("\n") == len(rows) + 1
    by = {(r["store"], r["run"]): r for r in rows}
    for store in ("unlimited", "limited"):
        pf, dp = by[store, "dualpath+prefetch"], by[store, "dualpath"]
        assert pf["hit_rate"] == dp["hit_rate"] == by[store, "basic"]["hit_rate"]
        assert pf["prefetch_hit_tokens"] > 0 and dp["prefetch_hit_tokens"] == 0
        assert pf["ttft_after_tool_p50_s"] < dp["ttft_after_tool_p50_s"]
    assert by["limited", "dualpath"]["capacity_gb"] > 0


@pytest.mark.slow
@pytest.mark.skipif(
    not WEKA_SESSIONS.exists(), reason="the public Weka sessions are not beside the repo"
)
def test_the_28_weka_sessions_turns_after_a_tool_call_start_sooner_with_prefetch(bench_modules):
    with bench_modules("agentic_traces") as (at,):
        runs = [r for r in at.RUNS if r[0] in ("dualpath", "dualpath+prefetch")]
        dp, pf = at.run_all(str(WEKA_SESSIONS), runs=runs, stores=("unlimited",))
    assert len(list(WEKA_SESSIONS.glob("*.json"))) == 28
    assert pf["ttft_after_tool_p50_s"] < dp["ttft_after_tool_p50_s"]
    assert pf["jct_s"] <= dp["jct_s"] * (1 + 1e-6)


@pytest.mark.slow  # four in-process clusters
def test_the_cluster_mode_gives_every_run_the_same_tokens_and_prefetches(tmp_path, bench_modules):
    with bench_modules("agentic_traces") as (at,):
        rows, same = at.run_cluster(
            str(_sessions(tmp_path)), str(tmp_path / "runs"), length_scale=1 / 64,
            max_turns=3, gap_scale=0.1,
        )  # fmt: skip
        table = at.format_table(rows)
    assert same
    assert [r["run"] for r in rows] == [name for name, _, _ in at.RUNS]
    assert table.count("\n") == len(rows) + 1
    assert all(r["errors"] == 0 and r["rounds"] == 9 for r in rows)
    by = {r["run"]: r for r in rows}
    assert by["dualpath+prefetch"]["prefetch_blocks_used"] > 0
    assert by["dualpath"]["prefetch_blocks_used"] == 0
