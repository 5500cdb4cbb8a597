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
# # 06: RL with Ray: the trainer is the Ray driver
#
# RL frameworks built on Ray (veRL, OpenRLHF, SkyRL) run the trainer as the Ray driver (or one
# of its actors) and the rollout engines as Ray actors it places. `RayCluster` is dualpath_jax's
# cluster in that shape: the router and every engine are Ray actors in one placement group, each
# owning one engine process with its own JAX runtime; KV moves between engines over the transfer
# layer as always, never through Ray's object store. This notebook:
#
# 1. starts a local Ray (`ray.init` with 4 logical CPUs) and a `RayCluster` on it: a router, one
#    prefill engine and one decode engine, each an actor of its bundle;
# 2. runs a few REINFORCE steps (the toy task of `04_rl_rollout`): rollouts through
#    `cluster.client()` and `run_trajectories`, a learning step in JAX here in the driver, then
#    `client.update_params(model)` pushes the new weights to every engine;
# 3. checks after every push that the next rollouts were drawn by the new parameters (each
#    round's `params_versions`), and at the end that the cluster's tokens equal the final model's
#    run in this process.
#
# It takes about a minute on a laptop CPU. **Install.** From a clone of the repository:
# `pip install -e .` with the Ray extra, `pip install -e '.[ray]'`, and open this notebook with
# that Python. On Colab, upload a copy of the repository and `%cd` into it first. The next cell
# installs that clone (`colab/setup/install.py`) only when the package is not importable; Ray
# comes with the extra.

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
import numpy as np
import optax
import ray
from flax import nnx

from dualpath_jax.cluster import RayCluster
from dualpath_jax.config import RayConfig
from dualpath_jax.rollout import InProcessBackend, Session, run_trajectories, toy

# %% [markdown]
# ## Ray, the policy and the cluster's placement
#
# A local Ray of 4 logical CPUs stands in for a Ray cluster (`ray.init(address="auto")` joins a
# real one; the rest of the notebook is the same). The cluster asks Ray for one bundle per actor,
# of its role's resources (`RayConfig`: the router's, each prefill engine's, each decode
# engine's; `GPU=1`, `TPU=4` or a node pool's custom resource on a real cluster), placed together
# with `ray.strategy`. The policy is the tiny Qwen2 model (random weights), saved as an orbax
# checkpoint the engines start from (`toy.tiny_policy`, as in `04_rl_rollout`).

# %%
ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)

WORKDIR = pathlib.Path("runs/06_ray_rl").absolute()
shutil.rmtree(WORKDIR, ignore_errors=True)
model, cfg = toy.tiny_policy(
    WORKDIR,
    "ray-rl-tiny",
    ray=RayConfig(router_resources="CPU=1", prefill_resources="CPU=1", decode_resources="CPU=1", strategy="PACK"),
)

# %% [markdown]
# ## The task and the learning step
#
# As in `04_rl_rollout` (`toy.TargetTask`): two turns of 6 generated tokens after
# "observation" tokens that never come from the target set `{0, ..., 31}`; the reward is the
# share of generated tokens that do. REINFORCE with the batch-normalised reward as advantage,
# log-probabilities from one forward of each whole trajectory in JAX
# (`toy.generated_logprob`), Adam on the `nnx.Param` leaves.

# %%
task = toy.TargetTask(target=32)
BATCH, ITERATIONS, LR = 8, 4, 1e-2
env = np.random.RandomState(0)

graphdef, params, rest = nnx.split(model, nnx.Param, ...)
tx = optax.adam(LR)
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state, tokens, gen_mask, advantage):
    def loss_fn(p):
        return -(advantage * toy.generated_logprob(nnx.merge(graphdef, p, rest), tokens, gen_mask)).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# %% [markdown]
# ## The loop, with the cluster on Ray
#
# Everything that needs the cluster runs in one cell: leaving the `with` block shuts the router
# down, ends every actor and removes the placement group (also when the cell fails). Per step:
# rollouts with `run_trajectories` (sampled at temperature 1 with explicit keys), a learning
# step, then `client.update_params(model, version=...)`: on one node (or with
# `ray.shared_filesystem`) it writes an orbax checkpoint under `WORKDIR/params/<version>` that
# every engine loads; across nodes without a shared file system it streams the weights over
# the transfer layer instead. The router drains the running rounds, every engine loads and
# checks the new weights, and they are served together. Each round's result names the params
# version that drew its tokens (`params_versions`), which is how the loop checks that the
# rollouts after a push come from the pushed weights.

# %%
history = []
key = jax.random.key(42)
with RayCluster(cfg, WORKDIR) as cluster:
    for name, w in cluster.where().items():
        print(f"{name:6s} actor on node {w['node_id'][:8]}, engine process {w['pid']}")
    client = cluster.client()
    serving = initial = client.stats()["params_version"]  # the checkpoint the engines started from
    for it in range(ITERATIONS):
        t0 = time.monotonic()
        trajs = task.trajectories(f"it{it}", BATCH, env)
        key, rollout_key = jax.random.split(key)
        outputs = run_trajectories(client, trajs, temperature=1.0, key=rollout_key, progress=False, release=True)
        drawn_by = {v for o in outputs for r in o.results for _, v in r.params_versions}
        assert drawn_by == {serving}, (drawn_by, serving)  # every token from the served weights
        t1 = time.monotonic()
        tokens, gen_mask, rewards = task.batch(trajs, outputs)
        advantage = jnp.asarray((rewards - rewards.mean()) / (rewards.std() + 1e-6), jnp.float32)
        params, opt_state, loss = train_step(params, opt_state, tokens, gen_mask, advantage)
        model = nnx.merge(graphdef, params, rest)
        t2 = time.monotonic()
        serving = client.update_params(model, version=f"step-{it + 1}")
        t3 = time.monotonic()
        history.append(dict(reward=rewards.mean(), drawn_by=drawn_by.pop(), pushed=serving))
        print(f"step {it + 1}: rollouts drawn by {history[-1]['drawn_by']!r}, reward {rewards.mean():.3f}; "
              f"rollout {t1 - t0:.1f} s, learn {t2 - t1:.1f} s, push {t3 - t2:.2f} s "
              f"({client.last_params_update['via']}) -> serving {serving!r}")

    # After the last push: the cluster's rollouts come from the pushed weights, and its tokens
    # (greedy and sampled) equal the same model run in this process.
    prompt = list(task.trajectories("final", 1, env)[0].rounds[0].append)
    after = Session(client)
    cluster_greedy = after.step(prompt, 8)
    last_versions = after.results[-1].params_versions
    cluster_sampled = Session(client).step(prompt, 8, temperature=2.0, key=jax.random.key(1))
    stats = client.stats()

local = InProcessBackend(model, max_len=128)
local_greedy = Session(local).step(prompt, 8)
local_sampled = Session(local).step(prompt, 8, temperature=2.0, key=jax.random.key(1))
ray.shutdown()

print("drawn by        :", last_versions, "(serving", repr(stats["params_version"]) + ")")
print("cluster greedy  :", cluster_greedy, "\nin-process      :", local_greedy)
print("cluster sampled :", cluster_sampled, "\nin-process      :", local_sampled)
assert [h["drawn_by"] for h in history] == [initial] + [f"step-{i}" for i in range(1, ITERATIONS)]
assert last_versions == [(0, f"step-{ITERATIONS}")] and stats["params_version"] == f"step-{ITERATIONS}"
assert cluster_greedy == local_greedy and cluster_sampled == local_sampled
assert stats["counters"]["errors"] == 0

# %% [markdown]
# ## In a Ray RL framework
#
# The pieces map one to one onto a veRL/OpenRLHF-style driver:
#
# - **placement**: `cfg.ray` says what each actor needs (`prefill_resources="GPU=1"`,
#   `decode_resources="TPU=4,tpu_pool=1"`, ...) and how the placement group packs them;
#   `cluster.where()` says where they landed;
# - **rollouts**: `cluster.client()` is a plain client of the router (it may be handed to any
#   process that reaches it); `run_trajectories`, `Session.step`, `step_group` as elsewhere;
# - **weights**: `client.update_params(model)` after each learning step (`pause="abort"` to end
#   rollouts still in flight at once);
# - **shutdown**: leaving the `with` block (or `cluster.stop()`); Ray itself stays up when the
#   cluster joined one the driver started.
#
# `docs/rl.md` ("With Ray") and `docs/multihost.md` ("On Ray") have the details: failures,
# secrets, what each node must see, KubeRay.
