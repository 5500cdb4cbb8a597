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
# # 06: RL rollouts on Ray: the trainer as the Ray driver, the engines as actors
#
# The RL frameworks dualpath_jax is paired with (veRL, OpenRLHF, slime, SkyRL, NeMo-RL) place
# their inference engines with Ray and drive them from the trainer's Ray driver. `RayCluster`
# runs the router and every engine as a Ray actor (each owning its own process and JAX
# runtime), placed by resources in one placement group, restarted by Ray when they die; the
# client API is the one of `LocalCluster`. This notebook is that loop in miniature:
#
# 1. this process joins Ray (a local one here; `ray.init(address="auto")` on a real cluster)
#    and starts a `RayCluster` of one prefill and one decode engine on it;
# 2. each iteration samples G completions of a few prompts through the cluster
#    (`run_trajectories`, temperature 1, the engines' log-probabilities of the sampled tokens);
# 3. the trainer (this process) takes a policy-gradient step in JAX on a toy reward and pushes
#    the new weights to every engine with `client.update_params`, streamed over the transfer
#    layer (no shared disk needed, as across Ray nodes);
# 4. every round of the next iteration reports the params version that drew its tokens
#    (`RoundResult.params_versions`), and the reward goes up.
#
# It takes about two minutes on a laptop CPU. **Install.** From a clone of the repository:
# `pip install -e '.[ray]'`, and open this notebook with that Python. On Colab, upload a copy of
# the repository and `%cd` into it first. The next cell installs that clone
# (`colab/setup/install.py`) only when the package is not importable.

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

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import ray
from flax import nnx

from dualpath_jax.cluster import RayCluster
from dualpath_jax.config import ClusterConfig, ExperimentConfig, RayConfig, StoreConfig
from dualpath_jax.model.checkpoint import save_params_tree
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.rollout import run_trajectories

# %% [markdown]
# ## Ray and the cluster
#
# `ray.init` starts a local Ray here (4 CPUs: one per actor, the router's included). The
# `ray` config section says what each actor asks of Ray: `CPU=1` here; on GPU nodes
# `prefill_resources="GPU=8"`, or a node pool's custom resource (docs/multihost.md, "On Ray").
# The policy is the tiny Qwen2 model with random weights, saved as the checkpoint the engines
# start from (on several nodes that path must be on storage every node reads).

# %%
WORKDIR = pathlib.Path("runs/06_ray_rl").absolute()
shutil.rmtree(WORKDIR, ignore_errors=True)
model = init_model(TINY_QWEN2, seed=0)
init_ckpt = save_params_tree(model, WORKDIR / "init_params")

cfg = ExperimentConfig(
    name="ray-rl-tiny",
    model=TINY_QWEN2,
    cluster=ClusterConfig(decode_slots=16, decode_max_len=128, params_path=str(init_ckpt)),
    store=StoreConfig(block_tokens=16),
    ray=RayConfig(router_resources="CPU=1", prefill_resources="CPU=1", decode_resources="CPU=1"),
)
ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 << 20)
cluster = RayCluster(cfg, WORKDIR / "cluster")
t0 = time.monotonic()
cluster.start()
print(f"RayCluster up in {time.monotonic() - t0:.1f} s; where each actor runs:")
for name, where in cluster.where().items():
    print(f"  {name:6s} node {where['node_id'][:8]}  pid {where['pid']}")

# %% [markdown]
# ## The task and the update
#
# A prompt is 16 random tokens none of which is a target (ids below 32). The policy generates 8
# tokens; the reward is the share of them that are targets (about 1/8 at random). Each
# iteration samples G = 4 completions of 4 prompts (16 trajectories, concurrently) and takes
# two Adam steps of the clipped policy-gradient objective with the group-normalised reward as
# the advantage; the behaviour log-probs are the engines' (`logprobs=True`).

# %%
TARGET, PROMPTS, G, GEN, PROMPT_LEN = 32, 4, 4, 8, 16
ITERATIONS, EPOCHS, LR, CLIP = 6, 2, 1e-2, 0.2
env = np.random.RandomState(0)
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
tx = optax.adam(LR)
opt_state = tx.init(params)


@jax.jit
def token_logprobs(params, tokens):
    logits, _ = nnx.merge(graphdef, params, rest)(tokens)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


@jax.jit
def train_step(params, opt_state, tokens, old_logp, advantage):
    def loss_fn(p):
        ratio = jnp.exp(token_logprobs(p, tokens)[:, -GEN:] - old_logp)
        adv = advantage[:, None]
        return -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# %% [markdown]
# ## The loop
#
# `cluster.client(params_dir=None)` makes `update_params` stream the weights from this process
# to every engine over the transfer layer (each engine pulls, checks and commits them together;
# the weights never pass through Ray's object store). `pause="abort"` would end rounds still in
# flight at once (an asynchronous trainer); here nothing is in flight when it pushes.

# %%
client = cluster.client(params_dir=None)
history, version = [], client.stats()["params_version"]
key = jax.random.key(7)
try:
    for it in range(ITERATIONS):
        key, k = jax.random.split(key)
        prompts = [env.randint(TARGET, 250, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
        trajs = [(f"it{it}-p{j}-g{i}", [(prompts[j], GEN)]) for j in range(PROMPTS) for i in range(G)]
        t0 = time.monotonic()
        outs = run_trajectories(client, trajs, temperature=1.0, key=k, logprobs=True, progress=False, release=True)
        rollout_s = time.monotonic() - t0
        results = [o.results[0] for o in outs]
        assert all(o.error == "" for o in outs)
        # every token of this iteration was drawn by the params pushed last
        assert {v for r in results for _, v in r.params_versions} == {version}
        tokens = jnp.asarray([p + list(r.tokens) for (_, [(p, _)]), r in zip(trajs, results)], jnp.int32)
        old_logp = jnp.asarray([r.logprobs.sampled for r in results], jnp.float32)
        rewards = np.array([np.mean([t < TARGET for t in r.tokens]) for r in results]).reshape(PROMPTS, G)
        adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
        for _ in range(EPOCHS):
            params, opt_state, loss = train_step(params, opt_state, tokens, old_logp, jnp.asarray(adv.reshape(-1)))
        t1 = time.monotonic()
        version = client.update_params(nnx.merge(graphdef, params, rest), version=f"step-{it + 1}")
        push_s = time.monotonic() - t1
        history.append(dict(reward=rewards.mean(), rollout_s=rollout_s, push_s=push_s))
        print(f"iteration {it + 1}: reward {rewards.mean():.3f}; rollout {rollout_s:.1f} s, push "
              f"{push_s:.2f} s ({client.last_params_update['via']}) -> {version!r}")
    serving = client.stats()["params_version"]
finally:
    cluster.stop()
    ray.shutdown()

assert serving == f"step-{ITERATIONS}"

# %% [markdown]
# ## The reward went up

# %%
r = [h["reward"] for h in history]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(range(1, len(r) + 1), r, "o-")
ax.axhline(TARGET / TINY_QWEN2.vocab_size, color="grey", ls="--", label="uniform random policy")
ax.set_xlabel("iteration")
ax.set_ylabel("mean reward")
ax.set_ylim(0, 1)
ax.legend()
ax.set_title(f"policy gradient through RayCluster, {PROMPTS} prompts x G={G}")
fig.tight_layout()
plt.show()
print(f"reward: first 2 iterations {np.mean(r[:2]):.3f}, last 2 {np.mean(r[-2:]):.3f}")
assert np.mean(r[-2:]) > np.mean(r[:2])

# %% [markdown]
# ## On a real Ray cluster
#
# - Join it: `ray.init(address="auto")` (or `RayCluster(cfg, workdir, address="auto")`); give
#   the engines their accelerators with `RayConfig(prefill_resources="GPU=8", ...)` or a node
#   pool's custom resource, and `strategy="SPREAD"` to put them on different nodes.
# - The store root (`store.root`) must be one every node reads (gcs://, s3://, a shared file
#   system); a local path on a multi-node Ray cluster is refused.
# - `launch/ray_cluster.py --config=... --address=auto --serve` runs the cluster as a service
#   (an OpenAI-compatible server in front); `deploy/kuberay-raycluster.yaml` is a KubeRay
#   manifest with GPU and TPU node pools.
# - A node that dies takes its engines with it: the router requeues their rounds (no
#   trajectory is lost) and Ray restarts the actors; a router that dies is restarted at its
#   address and clients reconnect (docs/failures.md).
