"""The in-process runtime (`InProcessCluster`): the router and engines as threads of the test's
process, running the code a `LocalCluster`'s processes run.

Every policy's tokens under it equal the reference model's (test_cluster.py's policy sweep runs
on it); here: it gives the same tokens and read paths as a `LocalCluster` on one workload, an
engine killed mid-run is survived and restarted, `run_local` runs on it, and what it cannot
run is refused clearly.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import threading

import pytest
from test_cluster import (
    PINNED_COST,
    RESULT_TIMEOUT_S,
    SWEEP,
    cluster_config,
    kill_busy_engine,
    make_trajectories,
    run_lockstep,
    tokens_of,
)
from trace_helpers import records

from dualpath_jax.cluster import InProcessCluster
from dualpath_jax.config import ConfigError, validate
from dualpath_jax.rollout import run_trajectories

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_the_same_tokens_and_paths_as_a_local_cluster(tmp_path, start_cluster, reference_tokens):
    expected = [reference_tokens(t) for t in SWEEP]
    runs = {}
    for runtime in ("thread", "process"):
        with start_cluster(cluster_config("dualpath"), tmp_path / runtime, runtime) as cluster:
            results = run_lockstep(cluster.client(), SWEEP)
        runs[runtime] = results
        assert tokens_of(results) == expected
    # the same scheduler code on the same arrivals: each round hits as much
    cached = {k: [[r.cached_tokens for r in rr] for rr in v] for k, v in runs.items()}
    assert cached["thread"] == cached["process"]


KILL = make_trajectories("kill", n=4, rounds=4, seed=2, gen=(8, 20))


def test_an_engine_killed_mid_run_is_survived_and_restarted(
    tmp_path, start_cluster, reference_tokens
):
    """`kill("de2")` ends a DE's thread while it holds a request: the router finds it silent,
    requeues its rounds on the other DE, every trajectory gets the reference tokens; then
    `restart` brings it back under its id."""
    expected = [reference_tokens(t) for t in KILL]
    cfg = cluster_config("dualpath", decode=2, heartbeat_timeout_s=4.0)
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        box: dict[str, list] = {}
        runner = threading.Thread(
            target=lambda: box.setdefault(
                "out",
                run_trajectories(client, records(KILL), progress=False, timeout_s=RESULT_TIMEOUT_S),
            )
        )
        runner.start()
        try:
            victim = kill_busy_engine(cluster, "decode", min_done=2)
        finally:
            runner.join(RESULT_TIMEOUT_S + 10)
        stats = client.stats()
        assert stats["engines"][str(cluster.engine_ids[victim])]["alive"] is False
        cluster.restart(victim)
        back = client.stats()["engines"][str(cluster.engine_ids[victim])]
        assert back["alive"] is True

    outputs = box["out"]
    assert [o.error for o in outputs] == [""] * len(KILL)
    assert [o.rounds for o in outputs] == expected
    assert stats["counters"]["engine_deaths"] == 1
    assert stats["counters"]["requeued"] >= 1, stats["counters"]
    assert stats["counters"]["errors"] == 0


def test_run_local_runs_on_threads_with_the_reference_tokens(tmp_path):
    """`cluster.runtime=thread`: the run launchers' function on an InProcessCluster writes the
    run's files, and its outputs are the reference model's greedy tokens."""
    from dualpath_jax import apply_overrides, load_config
    from dualpath_jax.experiment import build_trajectories, read_outputs, run_local
    from dualpath_jax.model.generation import reference_rounds
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.model.transformer import init_model

    cfg = apply_overrides(
        load_config(str(ROOT / "configs/cpu_1p1d.py:tiny")),
        [
            "cluster.runtime=thread",
            f"cluster.prefill_cost_json={PINNED_COST}",
            "workload.agents=2",
            "workload.trajectories=2",
            "workload.max_turns=2",
            "workload.max_len=256",
        ],
    )
    summary = run_local(cfg, tmp_path, progress=False)
    assert summary["errors"] == 0
    assert (
        json.loads((tmp_path / "summary.json").read_text())["policy"] == cfg.scheduler.policy.value
    )
    # every engine wrote its link report when it stopped
    assert sorted(p.name for p in (tmp_path / "links").glob("*.json")) == ["de1.json", "pe0.json"]
    runner = ModelRunner(init_model(cfg.model, seed=cfg.seed))
    trajs, _ = build_trajectories(cfg)
    outputs = read_outputs(tmp_path / "outputs.jsonl")
    assert len(outputs) == len(trajs) == 2
    for t in trajs:
        assert outputs[t.id] == reference_rounds(
            runner, [(list(r.append), r.gen) for r in t.rounds]
        )


def test_what_needs_processes_is_refused(tmp_path):
    cfg = cluster_config("dualpath")
    span = dataclasses.replace(
        cfg, cluster=dataclasses.replace(cfg.cluster, decode_mesh="tensor=2", decode_processes=2)
    )
    with pytest.raises(ValueError, match="need LocalCluster"):
        InProcessCluster(span, tmp_path)
    bad = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, runtime="threads"))
    with pytest.raises(ConfigError, match="cluster.runtime"):
        validate(bad)
    both = dataclasses.replace(span, cluster=dataclasses.replace(span.cluster, runtime="thread"))
    with pytest.raises(ConfigError, match="cluster.runtime"):
        validate(both)


def test_multi_step_decode_gives_the_single_step_tokens_and_streams(
    tmp_path, start_cluster, reference_tokens
):
    """`cluster.decode_steps=4`: every round's greedy tokens are the reference model's, sampled
    rounds (seeded) draw the tokens a single-step cluster draws, a round stopped by a stop token
    mid-dispatch ends there, and a streamed round's chunks arrive in order, gap-free."""
    from dualpath_jax.model.sampling_params import SamplingParams

    expected = [reference_tokens(t) for t in SWEEP]
    sampled = SamplingParams(temperature=0.8, seed=5, logprobs=0)
    draws, streamed = {}, {}
    for steps in (1, 4):
        with start_cluster(cluster_config("dualpath", decode_steps=steps), tmp_path / str(steps),
                           "thread") as cluster:  # fmt: skip
            client = cluster.client()
            assert tokens_of(run_lockstep(client, SWEEP)) == expected
            chunks: list[tuple[int, list[int]]] = []
            client.open_session("s")
            res = client.submit(
                "s", list(range(3, 40)), 24, sampling=sampled,
                on_tokens=lambda start, toks, lp: chunks.append((start, list(toks))),
            ).result(RESULT_TIMEOUT_S)  # fmt: skip
            draws[steps] = (list(res.tokens), list(res.logprobs.sampled))
            streamed[steps] = chunks
            client.open_session("stop")
            want = expected[0][0]
            stop = want[2]  # greedy: it ends at that token's first place
            got = client.submit("stop", SWEEP[0][1][0][0], 20, stop_tokens=[stop]).result(
                RESULT_TIMEOUT_S
            )
            assert list(got.tokens) == want[: want.index(stop) + 1]
            assert got.finish_reason == "stop"
    assert draws[4][0] == draws[1][0]
    assert draws[4][1] == pytest.approx(draws[1][1], rel=1e-5, abs=1e-6)
    for steps, chunks in streamed.items():
        flat = [t for _, toks in chunks for t in toks]
        assert [s for s, _ in chunks] == list(
            itertools.accumulate([0] + [len(t) for _, t in chunks[:-1]])
        )
        assert flat == draws[steps][0]
    assert len(streamed[4]) < len(streamed[1])  # several tokens per chunk
