"""Tool-gap prefetch in the real cluster (router/prefetch.py, transfer/prefetch_memory.py), on
the in-process runtime (the router and engines a `LocalCluster` runs, as threads).

A `tool_call` hint after a round makes a DE read the session's stored blocks into memory; the
next turn is routed there and its DE-side read takes them from memory (`de_reads` event:
`held_blocks` = its whole hit, nothing read from the store), with the reference tokens. Under
Basic (reads on the PE side only) a PE reads them, and the turn, pinned to that PE's node, takes
them there (`pe_reads`). A gap
that runs long is cancelled, a small budget holds only the leading blocks, and the rest is
read from the store as usual: the tokens never change.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from test_cluster import BLOCK_TOKENS, VOCAB, cluster_config, read_events

from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets.models import TINY_QWEN2
from dualpath_jax.rollout import Session

WAIT_S = 60.0


def prefetch_config(policy="dualpath", prefill=1, decode=2, **scheduler):
    cfg = cluster_config(policy, prefill=prefill, decode=decode)
    s = dataclasses.replace(cfg.scheduler, prefetch=True, prefetch_min_gap_s=0.1, **scheduler)
    return dataclasses.replace(cfg, scheduler=s)


def trajectory(seed: int, first: int = 80, later: int = 20, rounds: int = 3, gen: int = 5):
    rs = np.random.RandomState(seed)
    return (
        f"t{seed}",
        [(rs.randint(0, VOCAB, first if i == 0 else later).tolist(), gen) for i in range(rounds)],
    )


def wait_for(pred, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def held(client, session: str) -> dict | None:
    return client.stats()["prefetch"]["held"].get(session)


def held_blocks(workdir, request: str) -> int:
    """The blocks `request`'s DE took from prefetch memory (0 when its DE read nothing)."""
    assign = wait_for(lambda: events_of(workdir, "assign", request), f"{request}'s assignment")
    if assign[-1]["de_blocks"] == 0:
        return 0
    return de_reads(workdir, request)["held_blocks"]


def events_of(workdir, kind: str, request: str) -> list[dict]:
    return [e for e in read_events(workdir) if e["kind"] == kind and e.get("request") == request]


def de_reads(workdir, request: str, kind: str = "de_reads") -> dict:
    """The router's `de_reads` (or `pe_reads`) event of `request` (the log is written as the
    router goes)."""

    def found():
        evs = read_events(workdir)
        return [e for e in evs if e["kind"] == kind and e["request"] == request]

    got = wait_for(found, f"the {kind} event of {request}")
    assert len(got) == 1, got
    return got[0]


def prefetched_turn(cluster, client, s: Session, rounds, out: list, kind: str = "de_reads"):
    """Runs the first round, hints a tool call, waits until the session's whole hit is held and
    runs the second round, whose `kind` read must take that hit from the holder's memory.
    Returns the held entry, the second round's result and the blocks held."""
    out.append(s.step(*rounds[0]))
    want = stored_blocks(len(rounds[0][0]) + rounds[0][1])
    s.hint("tool_call", expected_s=30)
    entry = wait_for(lambda: (h := held(client, s.id)) and h["held"] == want and h, "the hold")
    res = s.step_async(*rounds[1]).result(WAIT_S)
    out.append(list(res.tokens))
    assert res.cached_tokens == want * BLOCK_TOKENS
    ev = de_reads(cluster.workdir, res.request, kind)
    assert ev["engine"] == entry["engine"] and ev["held_blocks"] == want
    return entry, res, want


def stored_blocks(context_tokens: int) -> int:
    """The whole blocks a round leaves in the store: every token whose KV exists (the
    context but its last generated token)."""
    return (context_tokens - 1) // BLOCK_TOKENS


def test_a_prefetched_turn_reads_its_hit_from_memory(tmp_path, start_cluster, reference_tokens):
    traj = trajectory(1)
    expected = reference_tokens(traj)
    with start_cluster(prefetch_config(), tmp_path, "thread") as cluster:
        client = cluster.client()
        s = Session(client, traj[0])
        rounds, out = traj[1], []
        _, _, want = prefetched_turn(cluster, client, s, rounds, out)
        # the next turn without a hint reads its hit from the store as before
        res = s.step_async(*rounds[2]).result(WAIT_S)
        out.append(list(res.tokens))
        assert held_blocks(cluster.workdir, res.request) == 0
        counters = client.stats()["counters"]
        s.close()
    assert out == expected
    assert counters["prefetch_started"] == 1 and counters["prefetch_used"] == 1
    assert counters["prefetch_used_blocks"] == want
    assert counters.get("errors", 0) == 0


def test_basic_prefetches_on_the_pe_side(tmp_path, start_cluster, reference_tokens):
    traj = trajectory(4)
    expected = reference_tokens(traj)
    # two PE nodes: the turn must go to the one whose PE holds its blocks
    cfg = prefetch_config("basic", prefill=2, decode=1)
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        s = Session(client, traj[0])
        rounds, out = traj[1], []
        entry, res, want = prefetched_turn(cluster, client, s, rounds, out, "pe_reads")
        assert entry["side"] == "pe"
        (assign,) = events_of(cluster.workdir, "assign", res.request)
        assert assign["path"] == "pe" and assign["de_blocks"] == 0
        res = s.step_async(*rounds[2]).result(WAIT_S)  # no hint: read from the store
        out.append(list(res.tokens))
        assert de_reads(cluster.workdir, res.request, "pe_reads")["held_blocks"] == 0
        counters = client.stats()["counters"]
        s.close()
    assert out == expected
    assert counters["prefetch_used"] == 1 and counters["prefetch_used_blocks"] == want
    assert counters.get("errors", 0) == 0


def test_a_gap_that_runs_long_is_cancelled(tmp_path, start_cluster, reference_tokens):
    traj = trajectory(2)
    expected = reference_tokens(traj)
    cfg = prefetch_config(prefetch_hold_factor=1.0)
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        s = Session(client, traj[0])
        out = [s.step(*traj[1][0])]
        s.hint("tool_call", expected_s=0.2)
        wait_for(lambda: client.stats()["counters"].get("prefetch_cancelled"), "the expiry")
        assert held(client, s.id) is None
        for append, gen in traj[1][1:]:
            res = s.step_async(append, gen).result(WAIT_S)
            out.append(list(res.tokens))
            assert held_blocks(cluster.workdir, res.request) == 0
        s.close()
    assert out == expected


def test_a_small_budget_holds_the_leading_blocks_and_the_rest_is_read(
    tmp_path, start_cluster, reference_tokens
):
    traj = trajectory(3, first=120)
    expected = reference_tokens(traj)
    block = BlockLayout.for_model(TINY_QWEN2, BLOCK_TOKENS).nbytes
    cfg = prefetch_config(prefetch_bytes_per_engine=3 * block)
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        s = Session(client, traj[0])
        out = [s.step(*traj[1][0])]
        context = len(traj[1][0][0]) + traj[1][0][1]
        s.hint("tool_call", expected_s=30)
        wait_for(lambda: (h := held(client, s.id)) and h["held"] == 3, "3 blocks")
        res = s.step_async(*traj[1][1]).result(WAIT_S)
        out.append(list(res.tokens))
        assert res.cached_tokens == stored_blocks(context) * BLOCK_TOKENS > 3 * BLOCK_TOKENS
        assert de_reads(cluster.workdir, res.request)["held_blocks"] == 3
        out.append(s.step(*traj[1][2]))
        s.close()
    assert out == expected


def test_a_tool_call_on_a_cluster_without_prefetch_only_keeps_the_kv(tmp_path, start_cluster):
    cfg = cluster_config("dualpath")
    with start_cluster(cfg, tmp_path, "thread") as cluster:
        client = cluster.client()
        s = Session(client, "plain")
        s.step(list(range(1, 60)), 3)
        s.hint("tool_call", expected_s=5)
        stats = client.stats()
        assert stats["prefetch"] == {"enabled": False, "held": {}}
        assert stats["counters"]["prefetch_started"] == 0
        s.close()
