"""End to end: a router and tiny-Qwen2 engines (at most 3) serving multi-turn trajectories.

Most clusters here are `InProcessCluster`s (the router and engines as threads: the same code,
fast to start); the process runtime (`LocalCluster`) keeps one policy run and the engine kills
(SIGKILL of a real process), marked `multiprocess` (the full tier).

The spine: greedy tokens are the same under every loading policy, every read
path, after an engine dies, after a corrupt block is recomputed, and equal the monolithic
reference model's `generate` on the same full context. Bad requests get a clear `RolloutError`
while other sessions keep going. A failing test reports its processes' logs (see conftest).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import signal
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from trace_helpers import records

from dualpath_jax.cluster import Client
from dualpath_jax.config import (
    ClusterConfig,
    ExperimentConfig,
    Policy,
    SchedulerConfig,
    StoreConfig,
)
from dualpath_jax.presets import TINY_CPU_PREFILL_COST, TINY_QWEN2
from dualpath_jax.rollout import RolloutError, Session, run_trajectories
from dualpath_jax.runtimes.inprocess import InProcessCluster
from dualpath_jax.runtimes.local import LocalCluster
from dualpath_jax.wire import messages

# The engines' prefill cost model is pinned: PEs start without calibrating.
PINNED_COST = TINY_CPU_PREFILL_COST.to_json()

BLOCK_TOKENS = 16
DECODE_MAX_LEN = 1024
VOCAB = TINY_QWEN2.vocab_size
RESULT_TIMEOUT_S = 180.0
# Rounds wait this long for a killed engine's replacement (30 s by default): on a loaded host a
# restart (a Ray node's death detected, a process started, its shapes compiled) can take longer.
RESTART_WAIT_S = 150.0

Trajectory = tuple[str, list[tuple[list[int], int]]]


def cluster_config(
    policy: str = "dualpath", *, prefill: int = 1, decode: int = 1, **cluster: object
) -> ExperimentConfig:
    """The tiny-Qwen2 cluster of these tests: P prefill and D decode nodes, 16-token blocks."""
    return ExperimentConfig(
        model=TINY_QWEN2,
        cluster=ClusterConfig(
            prefill_cost_json=PINNED_COST,
            prefill_nodes=prefill,
            decode_nodes=decode,
            decode_max_len=DECODE_MAX_LEN,
            **{"no_engine_timeout_s": RESTART_WAIT_S, **cluster},
        ),
        store=StoreConfig(block_tokens=BLOCK_TOKENS),
        scheduler=SchedulerConfig(policy=Policy(policy)),
    )


def make_trajectories(
    prefix: str,
    n: int,
    rounds: int,
    seed: int,
    gen: tuple[int, int] = (3, 7),
    first: tuple[int, int] = (33, 48),
) -> list[Trajectory]:
    """`n` trajectories of `results` rounds, first rounds of `first` tokens. Each append is at
    least one block long, so every later round hits blocks its earlier rounds persisted."""
    rs = np.random.RandomState(seed)
    out = []
    for k in range(n):
        rr = []
        for i in range(rounds):
            append = int(rs.randint(*first) if i == 0 else rs.randint(BLOCK_TOKENS, 32))
            rr.append((rs.randint(0, VOCAB, append).tolist(), int(rs.randint(*gen))))
        out.append((f"{prefix}{k}", rr))
    return out


def run_lockstep(client: Client, trajs: Sequence[Trajectory]) -> list[list[messages.RoundResult]]:
    """Runs round i of every trajectory at once (submitted back to back), then round i + 1.
    Returns each trajectory's results, round by round."""
    sessions = [Session(client, tid) for tid, _ in trajs]
    results: list[list[messages.RoundResult]] = [[] for _ in trajs]
    for i in range(max(len(r) for _, r in trajs)):
        futs = [
            (k, s.step_async(*trajs[k][1][i]))
            for k, s in enumerate(sessions)
            if i < len(trajs[k][1])
        ]
        for k, f in futs:
            results[k].append(f.result(RESULT_TIMEOUT_S))
    for s in sessions:
        s.close()
    return results


def tokens_of(results: Sequence[Sequence[messages.RoundResult]]) -> list[list[list[int]]]:
    return [[list(r.tokens) for r in rr] for rr in results]


def read_events(workdir: pathlib.Path) -> list[dict]:
    """The router's event log so far (complete lines only: the router may be mid-write)."""
    path = workdir / "events.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def busy_engines(events: Sequence[dict], role: str) -> collections.Counter:
    """Engine id -> requests of `role` it holds now: a PE from assignment until the first
    token, a DE from assignment until the round is answered."""
    holding: dict[str, dict] = {}
    for e in events:
        kind, rid = e["kind"], e.get("request")
        if kind == "assign":
            holding[rid] = e
        elif kind in ("done", "requeue", "failed", "error") or (
            kind == "first_token" and role == "prefill"
        ):
            holding.pop(rid, None)
    key = "pe" if role == "prefill" else "de"
    return collections.Counter(a[key] for a in holding.values())


def kill_busy_engine(
    cluster: LocalCluster | InProcessCluster, role: str, min_done: int, timeout_s: float = 120.0
) -> str:
    """Once `min_done` rounds are answered, kills an engine of `role` while it holds an
    unfinished request, and returns its name.

    The engine is frozen first (a process by SIGSTOP, a thread before its next turn), so it
    cannot finish its requests behind our back; once the router has logged whatever the
    engine sent before, the engine is killed if it still holds a request, else thawed and
    another moment is tried.
    """
    names = {eid: name for name, eid in cluster.engine_ids.items()}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = read_events(cluster.workdir)
        busy = busy_engines(events, role)
        if sum(e["kind"] == "done" for e in events) >= min_done and busy:
            name = names[busy.most_common(1)[0][0]]
            threads = isinstance(cluster, InProcessCluster)
            if threads:
                cluster.freeze(name)
            else:
                os.kill(cluster.procs[name].pid, signal.SIGSTOP)
            time.sleep(0.2)  # messages it sent before the freeze reach the router's log
            if busy_engines(read_events(cluster.workdir), role)[cluster.engine_ids[name]]:
                cluster.kill(name)
                return name
            if threads:
                cluster.freeze(name, frozen=False)
            else:
                os.kill(cluster.procs[name].pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"no {role} engine held a request after {min_done} rounds were done")


def counters(client: Client) -> dict[str, int]:
    return client.stats()["counters"]


def snic_read_bytes(client: Client) -> dict[str, int]:
    """Bytes each node's storage NIC read (storage -> node), from the engines' link reports."""
    out: dict[str, int] = {}
    for e in client.stats()["engines"].values():
        for link in (e.get("links") or {}).get("links", {}).values():
            if link["kind"] == "snic_rx":
                out[link["owner"]] = out.get(link["owner"], 0) + link["bytes"]
    return out


# ----------------------------------------------------------------------------- policies

SWEEP = make_trajectories("sweep", n=4, rounds=3, seed=1)


@pytest.mark.parametrize(
    ("policy", "runtime"),
    [(p.value, "thread") for p in Policy]
    + [pytest.param("dualpath", "process", marks=pytest.mark.multiprocess)],
)
def test_every_policy_generates_the_reference_tokens(
    policy, runtime, tmp_path, start_cluster, reference_tokens
):
    expected = [reference_tokens(t) for t in SWEEP]
    # Basic and layerwise also run with a device-KV bound of about one round's context per batch
    # (every layer resident under Basic, one under layerwise): batches shrink, tokens do not move.
    bound = {"prefill_max_kv_tokens": 64} if policy in ("basic", "layerwise") else {}
    # Split and round-robin DualPath prefill in chunks of at most 16 new tokens: each request's
    # earlier chunks' KV stays on the PE's device for its next chunk; the tokens do not move.
    if policy in ("split", "dualpath_rr"):
        bound = {"prefill_max_tokens": 16}
    with start_cluster(cluster_config(policy, **bound), tmp_path, runtime) as cluster:
        client = cluster.client()
        results = run_lockstep(client, SWEEP)
        stats = counters(client)
        snic = snic_read_bytes(client) if policy == "dualpath" else {}
        # link reports arrive with the engines' next fetch; wait for the last reads to show up
        deadline = time.monotonic() + 60  # liveness, not speed
        while (
            policy == "dualpath"
            and len([b for b in snic.values() if b]) < 2
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
            snic = snic_read_bytes(client)

    assert tokens_of(results) == expected
    first = [rr[0] for rr in results]
    later = [r for rr in results for r in rr[1:]]
    assert all(r.cached_tokens == 0 and r.read_path == "none" for r in first)
    # every later round reuses the blocks persisted by the rounds before it
    assert all(r.cached_tokens >= BLOCK_TOKENS for r in later), [r.cached_tokens for r in later]
    assert all(r.recomputed_blocks == 0 for rr in results for r in rr)
    assert stats["requests_done"] == sum(len(r) for _, r in SWEEP)
    assert stats["errors"] == stats["engine_deaths"] == stats["requeued"] == 0, stats

    paths = collections.Counter(r.read_path for r in later)
    if policy in ("basic", "layerwise"):
        assert paths == {"pe": len(later)}, paths
    elif policy == "oracle":
        assert paths == {"none": len(later)}, paths
    elif policy == "split":
        assert paths["split"] > 0, paths
    elif policy == "dualpath":
        # both read paths are taken (router counters) and both nodes' storage NICs really read
        assert stats["path_pe"] > 0 and stats["path_de"] > 0, stats
        assert paths["pe"] > 0 and paths["de"] > 0, paths
        assert len(snic) == 2 and all(b > 0 for b in snic.values()), snic
    else:
        assert paths["pe"] + paths["de"] + paths["split"] == len(later), paths


# ----------------------------------------------------------------------------- load or recompute

# First rounds of 3-4 blocks: every later round hits at least 3.
LEAD = make_trajectories("lead", n=4, rounds=3, seed=11, first=(56, 70))


@pytest.mark.parametrize(
    ("policy", "cap", "bound"),
    [
        ("dualpath", 1, {}),  # both read sides
        ("split", 2, {"prefill_max_tokens": 16}),  # chunked lead and tail, split reads
        ("basic", 1, {}),  # one program over the joined KV
    ],
)
def test_a_recomputed_lead_gives_the_reference_tokens(
    policy, cap, bound, tmp_path, start_cluster, reference_tokens
):
    """Load or recompute end to end: the PE recomputes the first `cap` blocks of every hit
    (`scheduler.recompute=always` capped by `recompute_max_blocks`) as a forward of their own
    and reads the rest; the new tokens attend over the lead's rows and the loaded blocks."""
    expected = [reference_tokens(t) for t in LEAD]
    cfg = cluster_config(policy, **bound)
    sched = dataclasses.replace(cfg.scheduler, recompute="always", recompute_max_blocks=cap)
    with start_cluster(dataclasses.replace(cfg, scheduler=sched), tmp_path, "thread") as cluster:
        client = cluster.client()
        results = run_lockstep(client, LEAD)
        stats = counters(client)

    assert tokens_of(results) == expected
    later = [r for rr in results for r in rr[1:]]
    # every later round recomputed `cap` leading blocks and loaded the rest of its hit
    assert all(r.recomputed_blocks == cap for r in later), [r.recomputed_blocks for r in later]
    assert all(r.cached_tokens >= BLOCK_TOKENS for r in later), [r.cached_tokens for r in later]
    assert stats["recompute_lead_hits"] == len(later), stats
    assert stats["recompute_hit_blocks"] == cap * len(later)
    assert stats["recomputed_blocks"] == 0  # nothing unreadable
    assert stats["errors"] == stats["requeued"] == 0, stats
    paths = collections.Counter(r.read_path for r in later)
    assert "none" not in paths, paths
    if policy == "split":
        assert paths["split"] > 0, paths


# ----------------------------------------------------------------------------- engine deaths

FAULT = make_trajectories("fault", n=6, rounds=4, seed=2, gen=(8, 20))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("role", "prefill", "decode"), [("decode", 1, 2), ("prefill", 2, 1)], ids=["kill_de", "kill_pe"]
)
def test_killing_an_engine_mid_run_still_completes_every_trajectory(
    role, prefill, decode, tmp_path, start_cluster, reference_tokens
):
    expected = [reference_tokens(t) for t in FAULT]
    # An engine's loop does not heartbeat while it compiles (seconds on a cold CPU cache), so a
    # tighter timeout declares live engines dead; 8 s still finds the killed one quickly.
    cfg = cluster_config("dualpath", prefill=prefill, decode=decode, heartbeat_timeout_s=8.0)
    with start_cluster(cfg, tmp_path) as cluster:
        client = cluster.client()
        box: dict[str, list] = {}
        runner = threading.Thread(
            target=lambda: box.setdefault(
                "out",
                run_trajectories(
                    client, records(FAULT), progress=False, timeout_s=RESULT_TIMEOUT_S
                ),
            )
        )
        runner.start()
        try:
            victim = kill_busy_engine(cluster, role, min_done=2)
        finally:
            runner.join(RESULT_TIMEOUT_S + 10)
        stats = client.stats()

    outputs = box["out"]
    assert [o.error for o in outputs] == [""] * len(FAULT)
    assert [o.rounds for o in outputs] == expected
    assert stats["engines"][str(cluster.engine_ids[victim])]["alive"] is False
    assert stats["counters"]["engine_deaths"] == 1
    assert stats["counters"]["requeued"] >= 1, stats["counters"]
    assert stats["counters"]["errors"] == 0


# ----------------------------------------------------------------------------- one shared cluster


@pytest.fixture(scope="module")
def dualpath_cluster(tmp_path_factory, start_cluster):
    """A 1P1D DualPath cluster shared by the tests below (each uses its own sessions)."""
    workdir = tmp_path_factory.mktemp("dualpath")
    with start_cluster(cluster_config("dualpath"), workdir, "thread") as cluster:
        yield cluster


def flip_stored_blocks(store: pathlib.Path) -> int:
    """Flips one byte in the middle of every stored block file; returns how many."""
    n = 0
    for path in store.glob("*/*"):
        if path.is_file() and len(path.parent.name) == 2:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            n += 1
    return n


CORRUPT = make_trajectories("corrupt", n=3, rounds=3, seed=3)


def test_corrupt_stored_blocks_are_recomputed_with_the_same_tokens(
    dualpath_cluster, reference_tokens
):
    expected = [reference_tokens(t) for t in CORRUPT]
    client = dualpath_cluster.client()
    before = counters(client)
    sessions = [Session(client, tid) for tid, _ in CORRUPT]
    got: list[list[messages.RoundResult]] = [[] for _ in CORRUPT]
    for i in range(3):
        if i == 1:  # the blocks round 0 persisted are damaged before round 1 reads them
            assert flip_stored_blocks(dualpath_cluster.workdir / "store") > 0
        futs = [s.step_async(*CORRUPT[k][1][i]) for k, s in enumerate(sessions)]
        for k, f in enumerate(futs):
            got[k].append(f.result(RESULT_TIMEOUT_S))
    after = counters(client)

    assert tokens_of(got) == expected
    assert all(rr[1].recomputed_blocks > 0 for rr in got), [
        [r.recomputed_blocks for r in rr] for rr in got
    ]
    assert after["recomputed_blocks"] - before["recomputed_blocks"] > 0
    assert after["errors"] == before["errors"]


BAD_ROUND_GOOD = make_trajectories("good", n=1, rounds=3, seed=4)[0]


def test_bad_requests_get_clear_errors_while_other_sessions_continue(
    dualpath_cluster, reference_tokens
):
    client = dualpath_cluster.client()
    before = counters(client)
    good = Session(client, BAD_ROUND_GOOD[0])
    bad = Session(client, "bad-requests")
    rounds = BAD_ROUND_GOOD[1]

    in_flight = good.step_async(*rounds[0])  # a good round runs while the bad ones are refused
    # refused by the router
    cases = [
        (client.submit("no-such-session", [1, 2, 3], 2), "unknown session 'no-such-session'"),
        (bad.step_async([5, VOCAB, 7], 2), rf"token id {VOCAB} is out of range \[0, {VOCAB}\)"),
        (bad.step_async([1] * (DECODE_MAX_LEN - 4), 8), f"exceeds the limit of {DECODE_MAX_LEN}"),
    ]
    # refused by the client before sending
    local = [
        (bad.step_async([5, -1], 2), r"token id -1 is out of range \[0, 2\*\*31\)"),
        (bad.step_async([1, 2], 0), "gen must be > 0, got 0"),
        (bad.step_async([1, 2], -3), "gen must be > 0, got -3"),
    ]
    for fut, message in cases + local:
        with pytest.raises(RolloutError, match=message) as err:
            fut.result(RESULT_TIMEOUT_S)
        assert err.value.kind == "bad_request"

    assert list(in_flight.result(RESULT_TIMEOUT_S).tokens) == reference_tokens(BAD_ROUND_GOOD)[0]
    # the refused rounds left the bad session's context empty: a valid round now is a first round
    fresh = ("bad-requests", [rounds[0]])
    assert bad.step(*rounds[0], timeout_s=RESULT_TIMEOUT_S) == reference_tokens(fresh)[0]
    # and the good session carries on
    for i in (1, 2):
        assert (
            good.step(*rounds[i], timeout_s=RESULT_TIMEOUT_S) == reference_tokens(BAD_ROUND_GOOD)[i]
        )
    after = counters(client)
    assert after["errors"] - before["errors"] == len(cases)


# ----------------------------------------------------------------------------- streaming, stops

STREAM = make_trajectories("stream", n=1, rounds=2, seed=6, gen=(12, 13))[0]


def test_streaming_stop_tokens_finish_and_keep(dualpath_cluster, reference_tokens):
    """Streamed tokens equal the result's; a stop token ends a round right after it; `keep`
    rewinds a session to an earlier context (the round then equals the reference's); `finish`
    completes a streamed round early with a prefix of the reference tokens."""
    client = dualpath_cluster.client()
    want = reference_tokens(STREAM)
    (a0, g0), (a1, g1) = STREAM[1]
    client.open_session("stream")
    streamed: dict[int, int] = {}

    def on_tokens(start: int, tokens: list[int]) -> None:
        for i, t in enumerate(tokens):
            streamed.setdefault(start + i, t)

    res = client.submit("stream", a0, g0, on_tokens=on_tokens).result(RESULT_TIMEOUT_S)
    assert res.tokens == want[0] and res.finish_reason == "length"
    assert [streamed[i] for i in sorted(streamed)] == want[0]

    stop = want[1][3]
    k = want[1].index(stop)
    res = client.submit("stream", a1, g1, stop_tokens=[stop]).result(RESULT_TIMEOUT_S)
    assert res.tokens == want[1][: k + 1] and res.finish_reason == "stop"

    # rewind to the context after round 0 and run round 1 again, in full
    keep = len(a0) + len(want[0])
    res = client.submit("stream", a1, g1, keep=keep).result(RESULT_TIMEOUT_S)
    assert res.tokens == want[1] and res.cached_tokens > 0
    bad = client.submit("stream", a1, g1, keep=10**6)
    with pytest.raises(RolloutError, match="keep=1000000 is outside") as err:
        bad.result(RESULT_TIMEOUT_S)
    assert err.value.kind == "bad_request"

    long = ("finish", [(a0, 200)])
    full = reference_tokens(long)[0]
    client.open_session("finish")
    first = threading.Event()
    fut = client.submit(
        "finish", a0, 200, on_tokens=lambda start, toks: start + len(toks) >= 2 and first.set()
    )
    assert first.wait(RESULT_TIMEOUT_S)
    client.finish(fut.request)
    res = fut.result(RESULT_TIMEOUT_S)
    assert res.finish_reason == "finished"
    assert 2 <= len(res.tokens) < 200 and res.tokens == full[: len(res.tokens)]


# ----------------------------------------------------------------------------- KV page budget

BUDGET = make_trajectories("budget", n=4, rounds=2, seed=5)


def test_a_small_decode_kv_budget_queues_requests_and_keeps_the_tokens(
    tmp_path, start_cluster, reference_tokens
):
    """A DE whose KV pool holds two requests' pages at a time: the others wait for pages (the
    tokens do not move), and a request larger than the whole pool fails with a clear error."""
    from dualpath_jax.model.layout import kv_bytes_per_token

    page_bytes = kv_bytes_per_token(TINY_QWEN2) * BLOCK_TOKENS
    # Rounds hold <= 48 + 31 prompt tokens + 7 generated: <= 6 pages; 12 pages hold two.
    cfg = cluster_config("dualpath", decode_kv_bytes=12 * page_bytes)
    expected = [reference_tokens(t) for t in BUDGET]
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        assert tokens_of(run_lockstep(client, BUDGET)) == expected
        big = Session(client, "too-big")
        with pytest.raises(RolloutError, match="exceeds the decode engines' KV budget of 192") as e:
            big.step([1] * (12 * BLOCK_TOKENS), 2, timeout_s=RESULT_TIMEOUT_S)
        assert e.value.kind == "bad_request"
        # the DE keeps serving
        again = Session(client, "after")
        assert again.step(*BUDGET[0][1][0], timeout_s=RESULT_TIMEOUT_S) == expected[0][0]
