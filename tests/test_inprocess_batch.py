"""`InProcessBackend(slots=S)`: rounds submitted meanwhile run together (batched prefill, S slots
decoded in one decoder) and give what one slot gives: greedy and sampled tokens, log-probs,
groups, stop tokens; a busy session, a group wider than the slots, a closed engine and a params
update are handled as the module says."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import (
    InProcessBackend,
    RolloutError,
    Round,
    Session,
    Trajectory,
    run_trajectories,
    step_group,
)


@pytest.fixture(scope="module")
def net():
    return init_model(TINY_QWEN2, seed=0)


@pytest.fixture(scope="module")
def engines(net):
    one, many = InProcessBackend(net, max_len=256), InProcessBackend(net, max_len=256, slots=4)
    yield one, many
    many.close()


def _trajectories(prefix: str, n: int = 6, seed: int = 0):
    rs = np.random.RandomState(seed)
    return [
        Trajectory(f"{prefix}{k}", tuple(
            Round(tuple(rs.randint(1, 256, rs.randint(3, 50)).tolist()), int(rs.randint(1, 9)))
            for _ in range(3)))
        for k in range(n)
    ]  # fmt: skip


def test_trajectories_run_together_and_draw_what_one_slot_draws(engines):
    one, many = engines
    for kw in ({}, {"temperature": 1.0, "key": jax.random.key(7), "logprobs": 2}):
        trajs = _trajectories("a" if not kw else "b", seed=len(kw))
        want = run_trajectories(one, trajs, progress=False, **kw)
        got = run_trajectories(many, trajs, progress=False, max_concurrent=6, **kw)
        assert [o.error for o in got] == [""] * len(trajs)
        assert [o.rounds for o in got] == [o.rounds for o in want]
        assert [[r.cached_tokens for r in o.results] for o in got] == [
            [r.cached_tokens for r in o.results] for o in want
        ]
        if kw:
            for a, b in zip(got, want):
                for ra, rb in zip(a.results, b.results):
                    np.testing.assert_allclose(ra.logprobs.sampled, rb.logprobs.sampled, atol=1e-4)
                    assert ra.logprobs.top_ids == rb.logprobs.top_ids


def test_groups_and_stop_tokens_as_with_one_slot(engines):
    one, many = engines
    prompt = list(range(3, 40))
    got = {}
    for name, e in (("one", one), ("many", many)):
        parent = Session(e, f"g-{name}")
        parent.step(prompt, 3)
        steps = step_group(
            parent.fork(3), [7, 8, 9], 6, temperature=1.0, key=jax.random.key(2), logprobs=True
        )
        stop = Session(e, f"s-{name}").step(
            prompt, 12, temperature=1.0, key=jax.random.key(4), stop_tokens=[17, 42, 99]
        )
        got[name] = ([s.tokens for s in steps], [s.result.read_path for s in steps], stop)
    assert got["many"] == got["one"]
    assert got["many"][1] == ["none", "fork", "fork"]


def test_a_busy_session_a_wide_group_and_an_unknown_session_are_refused(engines):
    _, many = engines
    s = Session(many, "busy")
    fut = s.step_async(list(range(1, 30)), 40)
    with pytest.raises(RolloutError, match="has a round running"):
        many.submit("busy", [5], 2).result(60)
    fut.result(60)
    kids = Session(many, "wide").fork(5)
    futs = many.submit_group([k.id for k in kids], [1, 2], 2, samplings=[SamplingParams()] * 5)
    with pytest.raises(RolloutError, match="needs as many decode slots"):
        futs[0].result(60)
    with pytest.raises(RolloutError, match="unknown session"):
        many.submit("nobody", [1], 1).result(60)
    assert len(s.step([3, 4], 2)) == 2  # the engine serves on


def test_a_params_update_lands_between_steps_and_drops_the_stale_kv(net):
    """An update while a round decodes lands between two steps; the round ends with tokens
    drawn under both params and leaves its session without cached KV, so the next round
    recomputes it and equals a fresh engine's with the new params."""
    other = init_model(TINY_QWEN2, seed=1)
    many = InProcessBackend(net, max_len=256, slots=2)
    ref = InProcessBackend(other, max_len=256)
    try:
        s = Session(many, "u")
        fut = s.step_async(list(range(1, 20)), 60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with many._run_lock:  # between two of the worker's turns
                live = list(many._batch.live.values())
                if live and 0 < len(live[0].out) < 60:
                    many.update_params(other)
                    break
            time.sleep(0.001)
        res = fut.result(120)
        assert len(res.tokens) == 60 and many._sessions["u"][1] is None
        ref.open_session("x")
        want = ref.submit("x", many._sessions["u"][0] + [5, 6], 4).result(60).tokens
        assert s.step([5, 6], 4) == list(want)
    finally:
        many.close()


def test_closing_ends_what_is_queued_or_decoding(net):
    many = InProcessBackend(net, max_len=256, slots=2)
    sessions = [Session(many, f"c{k}") for k in range(4)]
    futs = [s.step_async(list(range(1, 30)), 200) for s in sessions]
    deadline = time.monotonic() + 60
    while not many._batch.live and time.monotonic() < deadline:  # two of them decoding
        time.sleep(0.01)
    many.close()
    outcomes = []
    for f in futs:
        try:
            f.result(60)
            outcomes.append("done")
        except RolloutError as e:
            outcomes.append(e.kind)
    assert set(outcomes) <= {"done", "engine"} and "engine" in outcomes
    with pytest.raises(RolloutError):  # nothing runs any more
        sessions[0].step([1], 1)


def test_abort_ends_rounds_with_their_tokens_and_the_sessions_step_on(net):
    """`abort` (as `Client.abort`): a decoding round ends with its tokens so far, a queued one
    with none; either way its append and tokens join the context, and the session steps on
    with the reference's tokens for that context."""
    many = InProcessBackend(net, max_len=512, slots=2)
    ref = InProcessBackend(net, max_len=512)
    try:
        a, b, c = (Session(many, n) for n in ("ab-a", "ab-b", "ab-c"))
        futs = [s.step_async(list(range(1, 30)), 400) for s in (a, b, c)]  # c waits: 2 slots
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with many._run_lock:  # the worker waits for its next turn meanwhile
                if len(many._batch.live) == 2:
                    assert many.abort(sessions=["ab-c"]) == [futs[2].request]
                    assert sorted(many.abort(all=True)) == sorted(f.request for f in futs[:2])
                    break
            time.sleep(0.01)
        got = [f.result(60) for f in futs]
        assert [r.finish_reason for r in got] == ["abort"] * 3
        assert 0 < len(got[0].tokens) < 400 and got[2].tokens == []
        assert many.abort(all=True) == []  # nothing left
        for s, r in zip((a, c), (got[0], got[2])):
            context = list(range(1, 30)) + list(r.tokens)
            assert many._sessions[s.id][0] == context
            ref.open_session(s.id)
            want = ref.submit(s.id, context + [7], 3).result(60).tokens
            assert s.step([7], 3) == list(want)
    finally:
        many.close()
    assert InProcessBackend(net, max_len=64).abort(all=True) == []  # one slot: none in flight


def test_a_kv_budget_admits_what_fits_and_refuses_what_never_can(net):
    """`kv_tokens`: the decoder's pool; a round starts once its pages are free (here one at a
    time: each takes two of the three 64-token pages), and one that could never fit is
    refused at once."""
    one = InProcessBackend(net, max_len=256)
    small = InProcessBackend(net, max_len=256, slots=4, kv_tokens=3 * 64)
    try:
        trajs = [Trajectory(f"k{k}", (Round(tuple(range(1 + k, 60 + k)), 30),)) for k in range(3)]
        got = run_trajectories(small, trajs, progress=False, max_concurrent=3)
        want = run_trajectories(one, trajs, progress=False)
        assert [o.rounds for o in got] == [o.rounds for o in want]
        with pytest.raises(RolloutError, match="KV budget of 192 tokens"):
            Session(small, "big").step(list(range(1, 150)), 60)
        assert len(Session(small, "fits").step([1, 2, 3], 2)) == 2
    finally:
        small.close()
