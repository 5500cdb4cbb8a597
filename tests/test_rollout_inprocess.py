"""The rollout API over the in-process backend: multi-turn tokens equal the reference."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_jax.model.generation import reference_generate
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
)


@pytest.fixture(scope="module")
def engine():
    return InProcessBackend(init_model(TINY_QWEN2, seed=0), max_len=512)


def reference_rounds(runner, rounds: tuple[Round, ...]) -> list[list[int]]:
    ctx, out = [], []
    for r in rounds:
        ctx += r.append
        toks = reference_generate(runner, ctx, r.gen)
        out.append(toks)
        ctx += toks
    return out


def test_sessions_match_reference(engine):
    rs = np.random.RandomState(0)
    trajs = [
        Trajectory(
            f"t{k}",
            tuple(
                Round(tuple(rs.randint(0, 257, a).tolist()), g)
                for a, g in ((30, 4), (9, 3), (20, 5))
            ),
        )  # fmt: skip
        for k in range(2)
    ]
    outs = run_trajectories(engine, trajs, progress=False)
    for t, o in zip(trajs, outs):
        assert o.id == t.id
        assert o.error == ""
        assert o.rounds == reference_rounds(engine.runner, t.rounds)
        # Every token but the last generated one of the previous round already has KV.
        assert [r.cached_tokens for r in o.results] == [0, 30 + 4 - 1, 30 + 4 + 9 + 3 - 1]


def test_bad_requests_get_errors_and_the_session_survives(engine):
    s = Session(engine, "bad")
    with pytest.raises(RolloutError, match="out of range"):
        s.step([300], 2)
    with pytest.raises(RolloutError, match="gen must be > 0"):
        s.step([1, 2], 0)
    with pytest.raises(RolloutError, match="exceeds the limit"):
        s.step([1] * 600, 2)
    assert len(s.step([1, 2, 3], 2)) == 2  # still serving
    with pytest.raises(RolloutError, match="unknown session"):
        engine.submit("nope", [1], 1).result()


def test_tool_gaps_and_retention_keep_the_tokens_and_close_the_sessions(engine):
    rs = np.random.RandomState(1)
    trajs = [
        Trajectory(f"g{k}", tuple(Round(tuple(rs.randint(0, 257, a).tolist()), g, gap_s=gap)
                                  for a, g, gap in ((20, 3, 0.0), (7, 2, 0.05), (5, 2, 0.0))))
        for k in range(2)
    ]  # fmt: skip
    outs = run_trajectories(engine, trajs, progress=False, priority=[2, -1], ttl_s=5.0)
    for t, o in zip(trajs, outs):
        assert o.id == t.id and o.error == ""
        assert o.rounds == reference_rounds(engine.runner, t.rounds)
        # closed when it ended: the id opens afresh, without resume
        Session(engine, t.id).close()


def test_a_group_prefills_once_and_draws_what_separate_rounds_draw(engine):
    """`step_group` on the in-process backend: one prefill, the samples decoding together (the
    others forking the first one's prompt pages), the tokens and log-probabilities of the same
    rounds run one by one; each sample goes on as a session of its own."""
    import jax

    from dualpath_jax.rollout import round_sampling, step_group

    rs = np.random.RandomState(3)
    parent = Session(engine, "group-parent")
    parent.step(rs.randint(0, 257, 40).tolist(), 3)
    append, key = rs.randint(0, 257, 25).tolist(), jax.random.key(4)
    kids = parent.fork(3)
    group = step_group(kids, append, 5, temperature=1.0, key=key, logprobs=True)
    alone = parent.fork(3)
    params = [round_sampling(1.0, 1.0, jax.random.fold_in(key, i), True) for i in range(3)]
    one = [engine.submit(s.id, append, 5, sampling=p).result() for s, p in zip(alone, params)]
    assert [g.tokens for g in group] == [list(r.tokens) for r in one]
    assert len({tuple(g.tokens) for g in group}) == 3
    for g, r in zip(group, one):
        np.testing.assert_allclose(g.logprobs.sampled, r.logprobs.sampled, atol=1e-4)
    assert [g.result.read_path for g in group] == ["none", "fork", "fork"]
    prompt = group[0].result.prompt_tokens
    assert [g.result.cached_tokens for g in group][1:] == [prompt - 1] * 2
    assert kids[1].step([7, 8], 3) == alone[1].step([7, 8], 3)
    # sessions of different contexts run one by one
    kids[0].step([9], 2)
    mixed = step_group([kids[0], kids[2]], [5], 2)
    assert len(mixed[0]) == 2 and mixed[1] == alone[2].step([5], 2)
    assert kids[2].results[-1].read_path == "none"


def test_stop_tokens_end_a_round_and_its_context(engine):
    """A stop token ends the round (its last token, finish_reason "stop") and the session's
    context there: the next round sees the prompt, the tokens up to the stop and its append; a
    group's samples each stop on their own; min_tokens holds a stop token back."""
    import jax

    from dualpath_jax.rollout import step_group

    rs = np.random.RandomState(8)
    prompt, nxt = rs.randint(0, 257, 30).tolist(), rs.randint(0, 257, 6).tolist()
    ref = reference_generate(engine.runner, prompt, 8)
    k = next(k for k in range(2, 8) if ref[k] not in ref[:k])  # a token seen first at k
    s = Session(engine, "stops")
    got = s.step(prompt, 8, logprobs=True, stop_tokens=[ref[k]])
    assert got.tokens == ref[: k + 1] and got.finish_reason == "stop"
    assert len(got.logprobs.sampled) == k + 1
    assert s.step(nxt, 3) == reference_generate(engine.runner, prompt + ref[: k + 1] + nxt, 3)
    held = engine.submit(
        "stops", [5], 6, sampling=SamplingParams(min_tokens=6), stop_tokens=[ref[k]]
    ).result()
    assert held.finish_reason == "length" and len(held.tokens) == 6
    # a group: each sample stops at its own first stop token, as its round alone would
    parent = Session(engine, "stops-parent")
    parent.step(prompt, 1)
    key = jax.random.key(9)
    stop = list(range(0, 257, 4))  # a quarter of the vocabulary: samples stop early
    group = step_group(parent.fork(3), nxt, 8, temperature=1.0, key=key, stop_tokens=stop)
    alone = [
        Session(engine, f"stops-alone{i}", fork_of="stops-parent").step(
            nxt, 8, temperature=1.0, key=jax.random.fold_in(key, i), stop_tokens=stop
        )
        for i in range(3)
    ]
    assert group == alone
    assert all(g[-1] in stop or len(g) == 8 for g in group)
    assert all(t not in stop for g in group for t in g[:-1])


def test_rounds_within_one_length_bucket_compile_nothing_new(engine):
    """The in-process decoder's length is bucketed: a round whose prompt and tokens fall in the
    bucket of an earlier one (here 256) runs the programs that one compiled."""
    from dualpath_jax.model.runner import compile_count

    rs = np.random.RandomState(4)
    Session(engine, "bucket-a").step(rs.randint(0, 257, 135).tolist(), 4)
    before = compile_count()
    Session(engine, "bucket-b").step(rs.randint(0, 257, 195).tolist(), 4)
    assert compile_count() == before
