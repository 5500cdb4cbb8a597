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
# # 01: quickstart, a disaggregated cluster on your CPU
#
# This notebook starts a small **local cluster** on this machine (a router process, one prefill
# engine and one decode engine, each its own JAX runtime on the CPU, with the paper's storage
# bottleneck emulated), then:
#
# 1. runs a two-turn conversation with a `Session` and shows the generated tokens, checking them
#    against the same model run in this process;
# 2. replays a few synthetic agent trajectories with `run_trajectories` under the DualPath
#    policy;
# 3. reads what the run wrote (`events.jsonl`, per-engine link reports) to show how many KV
#    bytes each read path loaded and a timeline of every request.
#
# It takes about a minute.
#
# **Install.** From a clone of the repository: `pip install -e .` (or `make demo` once, which
# creates `.venv` with the package), then open this notebook with that Python (the README's
# "Notebooks" section shows how). On Colab, upload a copy of the repository and `%cd` into it
# first. The next cell installs that clone (`colab/setup/install.py`) only when the package is not
# importable.

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

import matplotlib.pyplot as plt
import numpy as np

from dualpath_jax import apply_overrides, cluster, load_config, model, rollout

# %% [markdown]
# ## The configuration
#
# `configs/cpu_1p1d.py` is one of the `configs/cpu_*` family: the tiny Qwen2 model (random
# weights), one engine per node, and token-bucket links that make one CPU host behave like the
# paper's storage-bound cluster: each node's storage NIC is slow, each engine's compute NIC is
# 8x faster (8 x 400 Gbps vs 1 x 400 Gbps per node in the paper) and its host<->device copies
# 16x faster. We take one prefill and one decode node (`1p1d`), storage NICs of 1 MB/s (the
# other links scaled with them), the DualPath scheduler, and 4 agents of at most 6 rounds each.
# Every config field can be overridden with `"section.field=value"` strings, like the
# launchers' `--set`.

# %%
cfg = apply_overrides(
    load_config("cpu_1p1d:tiny"),  # the repository's configs/cpu_1p1d.py, ARG "tiny"
    ["hardware.snic_bytes_per_s=1e6", "hardware.cnic_bytes_per_s=8e6",
     "hardware.h2d_bytes_per_s=16e6", "hardware.d2h_bytes_per_s=16e6",
     "scheduler.policy=dualpath", "workload.agents=4", "workload.trajectories=4", "workload.max_turns=6"],
)
hw = cfg.hardware
print(f"{cfg.name}: model {cfg.model.name}, policy {cfg.scheduler.policy.value}")
print(f"per node: storage NIC {hw.snic_bytes_per_s / 1e6:g} MB/s; per engine: compute NIC "
      f"{hw.cnic_bytes_per_s / 1e6:g} MB/s, host<->device {hw.h2d_bytes_per_s / 1e6:g} MB/s (emulated: {hw.emulated})")
WORKDIR = pathlib.Path("runs/01_quickstart").absolute()
shutil.rmtree(WORKDIR, ignore_errors=True)  # a fresh block store, so the first round finds no KV

# %% [markdown]
# ## Start the cluster and run
#
# `LocalCluster` is a context manager: entering starts the router and the engine processes
# (each writes a log to `WORKDIR/logs`) and waits until every engine registered; leaving shuts
# all of them down, also when a cell fails. Everything that needs the cluster therefore runs
# in this one cell:
#
# - a `Session` is one trajectory: `step(append, gen)` appends token ids to the conversation
#   and generates **exactly** `gen` tokens (greedy). The second round's prompt starts with the
#   first round's prompt and answer, whose KV the decode engine persisted to the block store:
#   the router picks a read path for it (`pe`: storage -> prefill node, `de`: storage -> decode
#   node -> prefill engine);
# - `run_trajectories` replays many trajectories concurrently, each one's rounds in order.

# %%
agents, _ = rollout.workload_trajectories(cfg)  # the synthetic 64k-shaped trace (Trajectory records), scaled to the tiny model
first_turn = list(range(1, 120))  # token ids of the user's first message
second_turn = list(range(200, 230))

with cluster.LocalCluster(cfg, WORKDIR) as local_cluster:
    client = local_cluster.client()
    session = rollout.Session(client, "chat-0")
    answer_1 = session.step(first_turn, 8)
    answer_2 = session.step(second_turn, 8)
    outputs = rollout.run_trajectories(client, agents, progress=False)
    stats = client.stats()

print("round 1 tokens:", answer_1)
print("round 2 tokens:", answer_2)
for r in session.results:
    print(f"  {r.prompt_tokens} prompt tokens, {r.cached_tokens} loaded from the store via read path "
          f"{r.read_path!r}, TTFT {r.ttft_s * 1e3:.0f} ms, {len(r.tokens)} tokens in {r.jct_s:.2f} s")
print(f"{len(outputs)} agents, {sum(len(o.rounds) for o in outputs)} rounds, errors: {[o.error for o in outputs if o.error]}")
print("rounds per read path (router):", stats["read_path_counts"])

# %% [markdown]
# Greedy decoding is deterministic: the same model in this process (`InProcessBackend`, no
# disaggregation, no store) gives the same tokens, whichever path the KV took in the cluster.

# %%
local = rollout.Session(rollout.InProcessBackend(model.init_model(cfg.model, seed=cfg.seed), max_len=1024), "chat-0")
same = local.step(first_turn, 8) == answer_1 and local.step(second_turn, 8) == answer_2
print("cluster tokens == in-process tokens:", same)
assert same

# %% [markdown]
# ## Where the KV bytes went
#
# Each engine process wrote a link report when it stopped (`WORKDIR/links/*.json`): bytes per
# named link. `snic_rx:node0` is the prefill node's storage NIC (PE read path), `snic_rx:node1`
# the decode node's (DE read path); `cnic_*` are the engines' compute NICs, `h2d`/`d2h` the
# host<->device copies, `dram` the nodes' memory.

# %%
totals = cluster.link_totals(cluster.read_link_reports(WORKDIR))
for name, nbytes in totals.items():
    print(f"{name:<16}{nbytes / 1e6:8.2f} MB")
pe_mb, de_mb = totals.get("snic_rx:node0", 0) / 1e6, totals.get("snic_rx:node1", 0) / 1e6
print(f"\nKV read from storage: PE read path {pe_mb:.2f} MB, DE read path {de_mb:.2f} MB")

# %% [markdown]
# ## A timeline of the run
#
# The router logs every request's life in `events.jsonl`: `submit`, `assign` (PE, DE and read
# path chosen), `first_token` (KV loaded and prefill done), `done`. Each row below is one
# round of one agent: grey while it queues, coloured by its read path while its KV is read and
# its prompt prefilled, green while it decodes. Below, the two storage NICs' read rates from
# the link reports: DualPath keeps both busy.

# %%
events = cluster.read_events(WORKDIR / "events.jsonl")
t0 = min(e["t"] for e in events if e["kind"] == "submit")
life: dict[str, dict] = {}
for e in events:
    if "request" in e:
        life.setdefault(e["request"], {})[e["kind"]] = e
rows = sorted((r for r in life.values() if {"submit", "assign", "first_token", "done"} <= r.keys()),
              key=lambda r: r["submit"]["t"])
path_color = {"pe": "#e94", "de": "#36c", "split": "#a4c", "none": "#c69"}  # none: nothing stored yet

fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
for y, r in enumerate(rows):
    ts, ta, tf, td = (r[k]["t"] - t0 for k in ("submit", "assign", "first_token", "done"))
    ax.barh(y, ta - ts, left=ts, color="#ddd")
    ax.barh(y, tf - ta, left=ta, color=path_color[r["assign"]["path"]])
    ax.barh(y, td - tf, left=tf, color="#4a4")
for path, color in path_color.items():
    ax.barh(0, 0, color=color, label=f"KV read + prefill, read path {path}")
ax.barh(0, 0, color="#ddd", label="queued")
ax.barh(0, 0, color="#4a4", label="decode")
ax.set_ylabel("request (by submit time)")
ax.legend(fontsize=7, loc="lower right")
ax.set_title(f"{cfg.name}, {cfg.scheduler.policy.value}: {len(rows)} rounds (links emulated)")
for r in cluster.read_link_reports(WORKDIR):
    for name, pts in r["windows"].items():
        if name.startswith("snic_rx:") and pts:
            t = np.maximum(np.array([p[0] for p in pts]) - t0, 0.0)  # window starts may precede t0
            k = np.floor(t / 0.5).astype(int)  # 0.5 s windows
            mbps = np.bincount(k, weights=[p[1] for p in pts]) / 0.5 / 1e6
            side = "PE" if r["role"] == "prefill" else "DE"
            ax2.step(np.arange(len(mbps)) * 0.5, mbps, where="post", label=f"{name} ({side} node)")
ax2.set_xlabel("seconds since the first submit")
ax2.set_ylabel("storage reads, MB/s")
ax2.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Next
#
# - One command runs a whole experiment and writes `summary.json` (JCT, TTFT/TPOT percentiles,
#   bytes per read path, storage-NIC balance): `python launch/rollout.py
#   --config=configs/cpu_1p1d.py --policy=dualpath --agents=4 --workdir=/tmp/dp_run`; in Python,
#   in Python, the replay above (`rollout.workload_trajectories(cfg)` through
#   `rollout.run_trajectories` on a `cluster.LocalCluster`) is that run.
# - `make demo` compares Basic, DualPath and Oracle side by side.
# - Notebook 02 follows one request's KV through both read paths; 03 runs the cluster
#   simulator at the paper's scale; 04 drives the cluster from a JAX RL loop.
