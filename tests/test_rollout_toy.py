"""`dualpath_jax.rollout.toy`, the RL notebooks' shared setup: the tiny policy's checkpoint and
cluster config, the toy task's trajectories, rewards and learning arrays, and the log-probs a
learning step takes (against a hand computation over the model's logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.config import RayConfig, validate
from dualpath_jax.model.checkpoint import load_params
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import InProcessBackend, Trajectory, run_trajectories, toy
from dualpath_jax.rollout.replay import TrajectoryOutput


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return toy.tiny_policy(tmp_path_factory.mktemp("policy"), "toy-test")


def test_tiny_policy_serves_its_checkpoint(policy, tmp_path):
    model, cfg = policy
    validate(cfg)
    assert cfg.name == "toy-test" and cfg.model == TINY_QWEN2 and cfg.store.block_tokens == 16
    loaded = load_params(cfg.cluster.params_path, TINY_QWEN2)
    tokens = jnp.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(loaded(tokens)[0], model(tokens)[0])
    _, with_ray = toy.tiny_policy(tmp_path, "r", ray=RayConfig(strategy="PACK"))
    assert with_ray.ray.strategy == "PACK"


def test_the_task_draws_no_target_token_and_rewards_the_generated_ones():
    task = toy.TargetTask(target=32)
    trajs = task.trajectories("it0", 5, np.random.RandomState(0))
    assert [t.id for t in trajs] == [f"it0-{k}" for k in range(5)]
    assert all(isinstance(t, Trajectory) for t in trajs)
    assert [[(r.append_len, r.gen) for r in t.rounds] for t in trajs] == [[(12, 6), (4, 6)]] * 5
    assert min(x for t in trajs for r in t.rounds for x in r.append) >= 32
    # seeded: the same generator state draws the same trajectories
    again = task.trajectories("it0", 5, np.random.RandomState(0))
    assert again == trajs
    assert task.reward([0, 31, 32, 100]) == 0.5 and task.reward([]) == 0.0


def test_batch_lays_out_each_trajectory_and_its_generated_positions():
    task = toy.TargetTask(target=32, turns=((3, 2), (1, 2)))
    (t,) = task.trajectories("b", 1, np.random.RandomState(1))
    out = TrajectoryOutput(t.id, [[0, 40], [5, 6]], [])
    tokens, mask, rewards = task.batch([t], [out])
    a0, a1 = list(t.rounds[0].append), list(t.rounds[1].append)
    assert tokens.tolist() == [a0 + [0, 40] + a1 + [5, 6]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 1, 1]] and mask.dtype == np.float32
    assert rewards.tolist() == [0.75]
    with pytest.raises(ValueError, match="failed: boom"):
        task.batch([t], [TrajectoryOutput(t.id, [], [], error="boom")])


def test_logprobs_are_the_models_log_softmax_of_the_next_token(policy):
    model, _ = policy
    tokens = jnp.array([[5, 9, 33, 2, 7], [1, 1, 4, 250, 3]])
    logits, _ = model(tokens)
    want = np.array(
        [[float(jax.nn.log_softmax(logits[b, i])[tokens[b, i + 1]]) for i in range(4)]
         for b in range(2)]
    )  # fmt: skip
    got = np.asarray(toy.token_logprobs(model, tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    mask = jnp.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], jnp.float32)
    np.testing.assert_allclose(
        np.asarray(toy.generated_logprob(model, tokens, mask)),
        [want[0, 1] + want[0, 2], want[1].sum()],
        rtol=1e-5,
    )


def test_a_rollout_of_the_task_feeds_a_batch(policy):
    model, _ = policy
    task = toy.TargetTask()
    trajs = task.trajectories("r", 3, np.random.RandomState(2))
    outs = run_trajectories(InProcessBackend(model, max_len=128), trajs, progress=False)
    tokens, mask, rewards = task.batch(trajs, outs)
    assert tokens.shape == mask.shape == (3, 28) and rewards.shape == (3,)
    assert mask.sum() == 3 * 12
    assert all(0.0 <= r <= 1.0 for r in rewards)
