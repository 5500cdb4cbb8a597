# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05: GRPO with group sampling, engine log-probabilities and a tool call
#
# GRPO (Group Relative Policy Optimization) samples a **group** of G completions of each prompt
# and uses each completion's reward relative to its group as the advantage, without a value
# model. This notebook runs it on a local dualpath_jax cluster (a router, one prefill engine and
# one decode engine, each its own process), on a two-turn toy task with a tool call between the
# turns:
#
# 1. **group sampling**: `Session.fork(G)` and `step_group` draw the G = 4 first turns of a
#    prompt; the prompt is prefilled once, and the other G - 1 continuations start from its
#    pages on the decode engine (no read, no prefill of their own);
# 2. a python **tool** turns each first turn into an observation, appended before the second
#    turn (sampled in each of the G sessions, over its stored KV);
# 3. the engines return each sampled token's log-probability (`logprobs=True`): they are the
#    **behaviour policy's log-probs** in the clipped importance-ratio objective, and we check
#    that they equal the trainer's own for the current parameters;
# 4. after each learning step `client.update_params(model, pause="abort")` pushes the new
#    parameters to every engine (rounds still in flight would end at once, with their partial
#    tokens and `finish_reason="abort"`);
# 5. the reward climbs (plotted at the end).
#
# It takes one to two minutes on a laptop CPU. **Install.** From a clone of the repository:
# `pip install -e .`, and open this notebook with that Python. On Colab, upload a copy of the
# repository and `%cd` into it first. The next cell installs that clone (`colab/setup/install.py`)
# only when the package is not importable.

# %%
import importlib.util
import os
import runpy

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: this process and the engines use the CPU
if importlib.util.find_spec("dualpath_jax") is None:  # not installed: install this clone
    runpy.run_path("colab/setup/install.py")  # from the clone's root

# %%
import pathlib
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

from dualpath_jax.cluster import LocalCluster
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import Session, step_group, toy

# %% [markdown]
# ## The policy and the cluster
#
# The policy is the tiny Qwen2 model (3 layers, vocabulary of 257 token ids, random weights),
# saved as an orbax checkpoint that the cluster starts from (`toy.tiny_policy`, as in
# `04_rl_rollout`). KV blocks of 16 tokens, so that a 24-token prompt fills one block that the
# group shares.

# %%
WORKDIR = pathlib.Path("runs/05_grpo").absolute()
shutil.rmtree(WORKDIR, ignore_errors=True)
model, cfg = toy.tiny_policy(WORKDIR, "grpo-tiny")

# %% [markdown]
# ## The task: two turns with a tool call between them
#
# A prompt is 24 random "instruction" tokens, none of them in the target set `{0, ..., 31}`.
#
# - **turn 1**: the policy generates 6 tokens;
# - **tool**: a python function reads them and answers with an observation of 3 tokens,
#   `[TOOL, 64 + hits, END]`, where `hits` is how many of the 6 were target tokens (what a
#   checker, a calculator or a search would return in a real agent);
# - **turn 2**: the observation is appended and the policy generates 6 more tokens.
#
# The reward of a trajectory is the share of its 12 generated tokens that are target tokens
# (about 1/8 for a random policy; `toy.TargetTask.reward`); it is computed from the token ids
# alone.

# %%
task = toy.TargetTask(target=32)
TARGET = task.target  # target token ids: 0 .. TARGET-1
TOOL, END = 250, 251  # the tool's markers (never target tokens)
PROMPTS, G, GEN, PROMPT_LEN = 4, 4, 6, 24  # per iteration: 4 prompts x 4 samples
ITERATIONS, EPOCHS, LR, CLIP = 10, 2, 1e-2, 0.2
env = np.random.RandomState(0)


def make_prompts() -> list[list[int]]:
    return [env.randint(TARGET, TOOL, PROMPT_LEN).tolist() for _ in range(PROMPTS)]


def tool(turn1: list[int]) -> list[int]:
    """The environment's tool: an observation computed from the policy's first turn."""
    hits = sum(t < TARGET for t in turn1)
    return [TOOL, 64 + hits, END]


# %% [markdown]
# ## Rollouts: one group per prompt
#
# For each prompt, a parent session (empty context) is forked into G sessions and `step_group`
# runs their first turns at temperature 1: the prompt's KV is computed once (by the first
# sample's round; the others fork its pages on the decode engine), choice i sampled with
# `fold_in(key, i)`. Each of the G sessions then runs its own
# second turn after its tool observation. `logprobs=True` makes every round return a `Step`
# whose `logprobs.sampled` is each token's log-probability under the distribution it was drawn
# from (at temperature 1: the model's `log_softmax`). The prompts' groups run concurrently.
# Sessions are closed with `release=True` at the end, which deletes their stored KV blocks.


# %%
def rollout_group(client, prompt, key, name):
    """G two-turn trajectories of one prompt: tokens, generated-token mask, engine log-probs,
    reward and the rounds' results, one dict per trajectory."""
    k1, k2 = jax.random.split(key)
    parent = Session(client, name)
    kids = parent.fork(G)
    try:
        turn1 = step_group(kids, prompt, GEN, temperature=1.0, key=k1, logprobs=True)
        obs = [tool(s.tokens) for s in turn1]
        futs = [
            kid.step_async(o, GEN, temperature=1.0, key=jax.random.fold_in(k2, i), logprobs=True)
            for i, (kid, o) in enumerate(zip(kids, obs))
        ]
        turn2 = [f.result() for f in futs]
    finally:
        for s in [*kids, parent]:
            s.close(release=True)
    out = []
    for s1, o, r2 in zip(turn1, obs, turn2):
        assert s1.finish_reason == r2.finish_reason == "length", (s1.finish_reason, r2.finish_reason)
        tokens = prompt + s1.tokens + o + list(r2.tokens)
        mask = [0] * len(prompt) + [1] * GEN + [0] * len(o) + [1] * GEN
        behaviour = s1.logprobs.sampled + r2.logprobs.sampled  # one per generated token
        out.append(dict(tokens=tokens, mask=mask, behaviour=behaviour,
                        reward=task.reward(s1.tokens + list(r2.tokens)), results=[s1.result, r2]))  # fmt: skip
    return out


def batch_of(groups):
    """Arrays for the loss: tokens [B, T], the generated positions' mask, the behaviour
    log-probs aligned with next-token predictions [B, T-1], rewards [P, G]."""
    trajs = [t for g in groups for t in g]
    tokens = np.array([t["tokens"] for t in trajs], np.int32)
    mask = np.array([t["mask"] for t in trajs], np.float32)[:, 1:]  # predicts tokens[:, 1:]
    old_logp = np.zeros_like(mask)
    for b, t in enumerate(trajs):
        old_logp[b, mask[b] > 0] = t["behaviour"]
    rewards = np.array([[t["reward"] for t in g] for g in groups], np.float32)
    return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(old_logp), rewards


# %% [markdown]
# ## The GRPO objective
#
# For the G trajectories of a prompt with rewards `r_1..r_G`, the advantage of trajectory i is
# `A_i = (r_i - mean(r)) / (std(r) + eps)` (group-normalised; a group whose rewards are all equal
# teaches nothing). Every generated token t of trajectory i has the importance ratio
# `rho = exp(log pi_theta(t) - log pi_old(t))` where `log pi_old` is the **engine's** log-prob of
# the sampled token (the behaviour policy), and the loss is the clipped surrogate
#
# `L = -mean over generated tokens of min(rho * A_i, clip(rho, 1 - 0.2, 1 + 0.2) * A_i)`
#
# (no KL penalty here). Each batch is used for `EPOCHS = 2` Adam steps: on the first the ratio
# is 1 (the trainer's params are those that sampled), on the second the clip acts. The printed
# `clipped` is the share of tokens whose ratio left `[0.8, 1.2]` at the second step: large here,
# because Adam at 1e-2 moves this tiny model far in one step (which makes the toy learn in ten
# iterations); a real run takes smaller steps.
# `log pi_theta` comes from one monolithic forward of the whole trajectory in JAX; only
# `nnx.Param` leaves are trained.

# %%
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
tx = optax.adam(LR)
opt_state = tx.init(params)


@jax.jit
def token_logprobs(params, tokens):
    """log pi_theta(tokens[:, 1:] | prefix): [B, T-1]."""
    return toy.token_logprobs(nnx.merge(graphdef, params, rest), tokens)


@jax.jit
def train_step(params, opt_state, tokens, mask, old_logp, advantage):
    def loss_fn(p):
        ratio = jnp.exp(token_logprobs(p, tokens) - old_logp)
        adv = advantage[:, None]
        surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv)
        loss = -(surrogate * mask).sum() / mask.sum()
        clipped = ((jnp.abs(ratio - 1) > CLIP) * mask).sum() / mask.sum()
        return loss, clipped

    (loss, clipped), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, clipped


# %% [markdown]
# ## The loop
#
# Everything that needs the cluster runs in one cell (leaving the `with` block stops every
# process, also when a cell fails). Per iteration: the groups' rollouts; the check that the
# engines' log-probs equal the trainer's for the parameters being served (their largest
# absolute difference over every generated token); `EPOCHS` GRPO steps; then
# `client.update_params(model, pause="abort")`. In this synchronous loop nothing is in flight
# at that point; an asynchronous trainer that pushes while rollouts run gets the rounds in
# flight back at once with `finish_reason="abort"` and the tokens they generated (the session
# can continue them under the new parameters, or the trainer drops them).

# %%
history = []
key = jax.random.key(42)
with LocalCluster(cfg, WORKDIR) as cluster:
    client = cluster.client()
    pool = ThreadPoolExecutor(PROMPTS)
    for it in range(ITERATIONS):
        t0 = time.monotonic()
        key, rollout_key = jax.random.split(key)
        prompts = make_prompts()
        groups = list(pool.map(
            lambda j: rollout_group(client, prompts[j], jax.random.fold_in(rollout_key, j), f"it{it}-p{j}"),
            range(PROMPTS),
        ))  # fmt: skip
        t1 = time.monotonic()
        tokens, mask, old_logp, rewards = batch_of(groups)
        # the engines' log-probs are those of the parameters the trainer holds
        mine = token_logprobs(params, tokens)
        lp_diff = float(jnp.max(jnp.abs(mine - old_logp) * mask))
        advantage = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
        advantage = jnp.asarray(advantage.reshape(-1))
        for _ in range(EPOCHS):
            params, opt_state, loss, clipped = train_step(params, opt_state, tokens, mask, old_logp, advantage)
        model = nnx.merge(graphdef, params, rest)
        t2 = time.monotonic()
        version = client.update_params(model, version=f"iter-{it + 1}", pause="abort")
        t3 = time.monotonic()
        turn1 = [t["results"][0] for g in groups for t in g]
        tail = sum(r.prompt_tokens - r.cached_tokens for r in turn1)
        history.append(dict(reward=rewards.mean(), lp_diff=lp_diff, clipped=float(clipped),
                            rollout_s=t1 - t0, learn_s=t2 - t1, push_s=t3 - t2))  # fmt: skip
        print(
            f"iteration {it + 1:2d}: reward {rewards.mean():.3f}, engine vs trainer log-probs "
            f"max |diff| {lp_diff:.1e}, clipped {float(clipped):.2f}, turn-1 prompt tokens "
            f"computed per sample {tail / len(turn1):.0f} of {PROMPT_LEN}; rollout {t1 - t0:.1f} s, "
            f"learn {t2 - t1:.1f} s, push {t3 - t2:.2f} s -> {version!r}"
        )
    pool.shutdown()
    serving = client.stats()["params_version"]

assert serving == f"iter-{ITERATIONS}"
assert max(h["lp_diff"] for h in history) < 1e-3, [h["lp_diff"] for h in history]
print("largest engine-vs-trainer log-prob difference over the run:", max(h["lp_diff"] for h in history))

# %% [markdown]
# ## The reward went up
#
# Left: the mean reward per iteration (rollouts of iteration i use the parameters after i - 1
# pushes). Right: the largest absolute difference between the log-probs the engines returned
# and the trainer's recomputation, per iteration: float32 rounding (the engines compute the
# prompt in a prefill batch and each token in a decode step over cached KV; the trainer in one
# forward), far below what would bias the importance ratio.

# %%
rewards_seen = [h["reward"] for h in history]
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
ax.plot(range(1, len(rewards_seen) + 1), rewards_seen, "o-")
ax.axhline(TARGET / TINY_QWEN2.vocab_size, color="grey", ls="--", label="uniform random policy")
ax.set_xlabel("iteration")
ax.set_ylabel("mean reward")
ax.set_ylim(0, 1)
ax.legend()
ax.set_title(f"GRPO, {PROMPTS} prompts x G={G} per iteration")
ax2.semilogy(range(1, len(history) + 1), [max(h["lp_diff"], 1e-9) for h in history], "s-", color="#e94")
ax2.set_xlabel("iteration")
ax2.set_ylabel("max |engine - trainer| log-prob")
ax2.set_title("behaviour log-probs from the engines")
fig.tight_layout()
plt.show()
print(f"reward: first 3 iterations {np.mean(rewards_seen[:3]):.3f}, last 3 {np.mean(rewards_seen[-3:]):.3f}")
assert np.mean(rewards_seen[-3:]) > np.mean(rewards_seen[:3]) + 0.1

# %% [markdown]
# ## Next
#
# - `bench/group_sampling.py` measures what group sampling saves on a long prompt: the prefill
#   tokens computed, the KV bytes stored and the wall time, against G separate sessions.
# - `Client.submit_group` is the lower-level call behind `step_group` (one future per sample;
#   `share="store"` shares the prompt through the store instead); over HTTP, the OpenAI
#   endpoints take `n > 1`, streamed or not.
# - `Client.abort`, `Client.pause(mode="abort"|"wait")` and `Client.resume()` stop and hold
#   rollouts around updates; `docs/rl.md` describes them and the update protocol.
