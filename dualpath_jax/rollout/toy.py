"""What the RL notebooks share: a tiny policy served from a checkpoint and a toy task to learn.

    from dualpath_jax.rollout import toy

    model, cfg = toy.tiny_policy(workdir, "rl-tiny")   # cfg: a 1P1D cluster serving `model`
    task = toy.TargetTask()
    trajs = task.trajectories("it0", 16, np.random.RandomState(0))
    outputs = run_trajectories(client, trajs, temperature=1.0, key=key)
    tokens, gen_mask, rewards = task.batch(trajs, outputs)          # [B, T], [B, T], [B]
    logp = toy.generated_logprob(model, tokens, gen_mask)           # [B]

The task: the environment appends tokens that never come from the target set `{0, ...,
target - 1}`; the reward of a trajectory is the share of its generated tokens that do (about
`target / vocab_size` for a random policy), so a policy learns it in a few REINFORCE or GRPO
steps of a notebook. Nothing here runs a learner: the optimizer stays the notebook's.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.workload.trace import Round, Trajectory


def tiny_policy(
    workdir: str | pathlib.Path, name: str, *, seed: int = 0, **config: Any
) -> tuple[Any, ExperimentConfig]:
    """The tiny Qwen2 model (random weights of `seed`) saved as an orbax checkpoint in
    `workdir/init_params`, and the config of a 1P1D cluster that starts from it
    (`cluster.params_path`; 16 decode slots of 128 tokens, 16-token KV blocks so that short
    prompts already fill blocks). `config`: other `ExperimentConfig` fields (e.g. `ray=`)."""
    from dualpath_jax.model.checkpoint import save_params_tree
    from dualpath_jax.model.transformer import init_model

    model = init_model(TINY_QWEN2, seed=seed)
    checkpoint = save_params_tree(model, pathlib.Path(workdir) / "init_params")
    cfg = ExperimentConfig(
        name=name,
        model=TINY_QWEN2,
        cluster=ClusterConfig(decode_slots=16, decode_max_len=128, params_path=str(checkpoint)),
        store=StoreConfig(block_tokens=16),
        seed=seed,
        **config,
    )
    return model, cfg


@dataclasses.dataclass(frozen=True)
class TargetTask:
    """The toy task (module docstring). `turns`: `(environment tokens, generated tokens)` per
    turn of a trajectory."""

    target: int = 32
    vocab_size: int = TINY_QWEN2.vocab_size
    turns: tuple[tuple[int, int], ...] = ((12, 6), (4, 6))

    def environment(self, n: int, rng: np.random.RandomState) -> list[int]:
        """`n` environment tokens: none of them a target token."""
        return rng.randint(self.target, self.vocab_size, n).tolist()

    def trajectories(self, name: str, n: int, rng: np.random.RandomState) -> list[Trajectory]:
        """`n` trajectories `"{name}-{k}"` of `turns` (their environment tokens drawn from
        `rng`, trajectory by trajectory, turn by turn)."""
        return [
            Trajectory(
                f"{name}-{k}",
                tuple(Round(tuple(self.environment(a, rng)), gen) for a, gen in self.turns),
            )
            for k in range(n)
        ]

    def reward(self, generated: Sequence[int]) -> float:
        """The share of `generated` that are target tokens."""
        return float(np.mean([t < self.target for t in generated])) if generated else 0.0

    def batch(
        self, trajs: Sequence[Trajectory], outputs: Sequence[Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a learning step takes from the rollouts (`run_trajectories`' outputs, in
        order; a failed one raises ValueError): each trajectory's token ids `[B, T]` (every
        turn's environment tokens, then its generated ones), the mask of generated positions
        `[B, T]` (float32) and the rewards `[B]`."""
        tokens, mask, rewards = [], [], []
        for t, out in zip(trajs, outputs, strict=True):
            if out.error:
                raise ValueError(f"trajectory {t.id!r} failed: {out.error}")
            seq: list[int] = []
            gen: list[int] = []
            for rd, generated in zip(t.rounds, out.rounds, strict=True):
                seq += [*rd.append, *generated]
                gen += [0] * len(rd.append) + [1] * len(generated)
            tokens.append(seq)
            mask.append(gen)
            rewards.append(self.reward([x for g in out.rounds for x in g]))
        return np.array(tokens, np.int32), np.array(mask, np.float32), np.array(rewards)


def token_logprobs(model: Any, tokens: Any) -> Any:
    """`log p(tokens[:, i + 1] | tokens[:, :i + 1])` under `model` (a `Transformer`; one
    forward of the whole sequences, no cache): `[B, T - 1]` float32 for tokens `[B, T]`."""
    import jax
    import jax.numpy as jnp

    logits, _ = model(tokens)  # [B, T, V]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def generated_logprob(model: Any, tokens: Any, gen_mask: Any) -> Any:
    """The sum of `log p(token)` over the generated positions of each sequence (`gen_mask`
    `[B, T]`, as `TargetTask.batch` gives it): `[B]`, REINFORCE's sequence log-probability."""
    return (token_logprobs(model, tokens) * gen_mask[:, 1:]).sum(-1)
