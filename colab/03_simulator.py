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
# # 03: the cluster simulator at the paper's scale
#
# The paper's results come from clusters of 48 to 1,152 Hopper GPUs. The simulator runs the
# framework's **own scheduler code** (the same `GlobalScheduler`, Algorithm 1, compute quota and
# link arbitration as the real router and engines) over a discrete-event model of such a
# cluster: H800 nodes with 8 GPUs, 8 x 400 Gbps compute NICs and one 400 Gbps storage NIC each,
# prefill and decode times from a roofline calibrated to DeepSeek's published H800 serving
# numbers. Everything runs in virtual time on one CPU core.
#
# This notebook
#
# 1. reproduces the shape of **Figure 7** (job completion time vs number of agents; Basic vs
#    DualPath vs Oracle) for DeepSeek-V3.2 660B on 2 prefill + 4 decode nodes (2P4D, 48 GPUs);
# 2. asks the **deployment advisor** for the best P/D split of a 6-node cluster, beside the
#    analysis tool's bottleneck-free P/D range (section 4.2), and compares Basic on each split;
# 3. plots the storage NICs' read traffic, the paper's Figure 13 view;
# 4. replays **coding-agent sessions** (tool calls between turns, subagents a turn waits for)
#    under Basic and DualPath, each with and without tool-gap prefetch, and Oracle.
#
# To run in a couple of minutes it uses fewer agents than the paper (see the note on scaling
# below).
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

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the simulator needs no accelerator
if importlib.util.find_spec("dualpath_jax") is None:  # not installed: install this clone
    runpy.run_path("colab/setup/install.py")  # from the clone's root

# %%
import dataclasses
import functools
import json
import math
import pathlib
import statistics
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np

from dualpath_jax.analysis import format_pd_range, pd_range
from dualpath_jax.config import Policy
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.presets import paper_config, paper_experiment
from dualpath_jax.sim import simulate
from dualpath_jax.sim.advisor import AdviseSpace, advise, format_report, pd_splits
from dualpath_jax.workload import plan_workload

# %% [markdown]
# ## The simulated testbed
#
# `presets.paper_config("ds660b_2p4d,agents=...,snic_gbps=...")` is the experiment config of one
# of the paper's runs, what `configs/paper.py:ARG` loads (`python launch/simulate.py
# --config=configs/paper.py:ds660b_2p4d` runs it): H800 nodes (`HOPPER_NODE`), the model preset,
# HBM left for KV, the Table 2 trace (`64k`: ~157 rounds per agent, contexts up to 64K tokens),
# and the cost model, which the config names (`hardware.calibration`, `fp8`, `ep_decode_nodes`,
# and `kv_format`: DeepSeek's FP8 FlashMLA layout). `simulate(cfg)` builds that calibrated
# roofline, replays the trace and returns the same `summary.json` the real launchers write.
#
# **Scaling.** The paper's Figure 7 uses 256-2,048 agents; one such run is about 10-40 minutes
# of CPU here. We take `1/SCALE` of the agents and give every storage NIC `1/SCALE` of its
# 50 GB/s, so that the storage load per byte of bandwidth matches the paper's, while the GPUs
# stay the paper's (so they are relatively less loaded: storage binds harder than at full size,
# and Oracle sits further below DualPath). `bench/paper_figures.py` runs the full-size figures;
# the README's "Simulator: paper reproduction" section has the 2,048-agent run (DualPath/Basic
# 1.52 with 50 GB/s storage NICs, where DualPath is bound by prefill compute; 2.55 at the
# paper-implied 21 GB/s; the paper reports 1.87).

# %%
MODEL = "ds660b"
SCALE = 64  # agents and storage bandwidth divided by this
PAPER_AGENTS = [512, 1024, 2048]
AGENTS = [n // SCALE for n in PAPER_AGENTS]
SNIC_GBPS = 400 / SCALE  # per node (the paper's: 400 Gbps = 50 GB/s)
POLICIES = ["basic", "dualpath", "oracle"]


def paper(prefill_nodes: int, decode_nodes: int, policy: str, agents: int):
    """The config `configs/paper.py:ds660b_<P>p<D>d,policy=...,agents=...,snic_gbps=...`."""
    return paper_config(f"{MODEL}_{prefill_nodes}p{decode_nodes}d,policy={policy},agents={agents},"
                        f"snic_gbps={SNIC_GBPS}")


cfg = paper(2, 4, "dualpath", AGENTS[-1])
hw, cl = cfg.hardware, cfg.cluster
print(f"{cfg.name}: {cfg.model.name}, {cl.prefill_nodes}P{cl.decode_nodes}D = "
      f"{(cl.prefill_nodes + cl.decode_nodes) * hw.engines_per_node} GPUs ({hw.gpu}), trace {cfg.workload.preset}")
print(f"per node: storage NIC {hw.snic_bytes_per_s / 1e9:.2f} GB/s (1/{SCALE} of 50), compute NIC "
      f"{hw.cnic_bytes_per_s / 1e9:.0f} GB/s per GPU, DRAM buffer {hw.dram_buffer_bytes / 1e9:.0f} GB per GPU")
print("agents:", AGENTS, f"(the paper's {PAPER_AGENTS} / {SCALE})")


# %%
@functools.cache  # each configuration is simulated once (the P/D sweep reuses the 2P4D runs)
def run(policy: str, agents: int, prefill_nodes: int, decode_nodes: int):
    return simulate(paper(prefill_nodes, decode_nodes, policy, agents))  # the cost model it names


t0 = time.perf_counter()
fig7 = {(n, p): run(p, n, cl.prefill_nodes, cl.decode_nodes) for n in AGENTS for p in POLICIES}
print(f"{len(fig7)} simulations in {time.perf_counter() - t0:.0f} s of wall time\n")
print(f"{'agents':>7}{'rounds':>8}" + "".join(f"{p + ' JCT s':>15}" for p in POLICIES) + f"{'Basic/DualPath':>16}")
for n in AGENTS:
    jct = [fig7[(n, p)].jct_s for p in POLICIES]
    print(f"{n:>7}{fig7[(n, 'dualpath')].summary['requests']:>8}" + "".join(f"{j:>15.0f}" for j in jct)
          + f"{jct[0] / jct[1]:>16.2f}")
print("\npaper (2,048 agents, 64K, DS 660B 2P4D): Basic 10,052 s, DualPath 5,365 s -> 1.87x; Oracle ~ DualPath")

# %% [markdown]
# ## Figure 7: JCT vs agents
#
# With Basic only the 2 prefill nodes' storage NICs read KV; DualPath also reads through the 4
# decode nodes' and streams each layer to the prefill GPUs over the compute network, so up to
# (P+D)/P = 3x the storage bandwidth serves the same work. Oracle charges no storage reads at
# all. The gap grows with the agent count, as the storage NICs saturate.

# %%
fig, ax = plt.subplots(figsize=(7, 4))
x = np.arange(len(AGENTS))
colors = {"basic": "#999", "dualpath": "#36c", "oracle": "#2a7"}
for k, p in enumerate(POLICIES):
    ys = [fig7[(n, p)].jct_s for n in AGENTS]
    bars = ax.bar(x + (k - 1) * 0.27, ys, 0.27, label=p, color=colors[p])
    if p == "dualpath":
        for b, n in zip(bars, AGENTS):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(),
                    f"{fig7[(n, 'basic')].jct_s / fig7[(n, p)].jct_s:.2f}x", ha="center", va="bottom", fontsize=8)
ax.set_xticks(x, [f"{n}\n(paper {m})" for n, m in zip(AGENTS, PAPER_AGENTS)])
ax.set_xlabel("agents")
ax.set_ylabel("JCT (s, simulated)")
ax.set_title(f"DS 660B 2P4D, 64K trace, agents and storage NICs / {SCALE}")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Storage NICs over time (Figure 13 view)
#
# Each simulated run keeps its link time series (`run.cluster.link_reports`, the same shape as
# the real engines' `links/*.json`). Under Basic the prefill nodes' storage NICs run flat out
# while the decode nodes' idle; DualPath spreads the reads over all six, and its scheduler keeps
# them even (`snic_max_over_avg` in the summary: max over mean across NICs, per time window).

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6), sharey=True)
for ax, p in zip(axes, ["basic", "dualpath"]):
    r = fig7[(AGENTS[-1], p)]
    for rep in r.cluster.link_reports(r.cluster.loop.now):
        pts = np.array(rep["windows"].get(f"snic_rx:node{rep['node']}", []), dtype=float).reshape(-1, 2)
        if len(pts):
            k = (pts[:, 0] // 30).astype(int)  # 30 s windows
            gbps = np.bincount(k, weights=pts[:, 1]) / 30 / 1e9
            side = "PE" if rep["role"] == "prefill" else "DE"
            ax.plot(np.arange(len(gbps)) * 30, gbps, label=f"node{rep['node']} ({side})", lw=1)
    ax.set_title(f"{p}: storage NIC reads, {AGENTS[-1]} agents (max/avg {r.summary['snic_max_over_avg']:.2f})")
    ax.set_xlabel("simulated time (s)")
    ax.legend(fontsize=7, ncol=2)
axes[0].set_ylabel("GB/s")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Choosing P/D: the advisor
#
# Section 4.2 of the paper derives the P/D ratios for which no NIC or memory link becomes the
# bottleneck under DualPath, from the GPUs per node `g`, the storage-to-compute NIC bandwidth
# ratio `s`, DRAM bandwidth `M` and the storage NIC bandwidth `B*s` (`analysis.pd_range`; the
# same as `python launch/analyze.py --g=8 --s=1 --mem_gbps=500 --bs_gbps=50`). For the paper's
# hardware it is 1/7 <= P/D <= 7/2. Inside it, which ratio is best depends on the workload's
# compute vs storage demand, which only a simulation measures.
#
# `sim.advise(cfg, space)` does that: it simulates every combination of P/D split,
# alpha and beta (the scheduler's read-queue and overload thresholds, in seconds of work) of
# `space` on the same agents, and reports the best by JCT (or, given arrival rates, by APS
# capacity under the SLO) beside the bottleneck-free range of the configured hardware.
# `python launch/simulate.py --advise` is the same from the command line (it writes
# `advise.json`).
#
# DeepSeek's cost depends on the split (its routed experts are spread over the decode GPUs: 32 on
# 2P4D, 8 on 5P1D), so we pass no `cost`: the advisor then builds each candidate's calibrated
# roofline from that candidate's config, as `simulate(cfg)` does; `configure` builds each split's
# config, so each gets the HBM for KV that its GPUs keep after their share of the weights. We sweep
# the 6-node splits at the default alpha and beta.

# %%
print("paper hardware:", format_pd_range(pd_range(g=8, s=1, mem_gbps=500, bs_gbps=50)).splitlines()[0], "\n")
SWEEP_AGENTS = AGENTS[1]
t0 = time.perf_counter()
sweep_cfg = paper(2, 4, "dualpath", SWEEP_AGENTS)
sc = sweep_cfg.scheduler
report = advise(sweep_cfg, AdviseSpace(pd=pd_splits(6), alpha_s=(sc.alpha_s,), beta_s=(sc.beta_s,)),
                configure=lambda p, d: paper(p, d, "dualpath", SWEEP_AGENTS))
print(format_report(report))
print(f"({len(report['candidates'])} candidates, {SWEEP_AGENTS} agents each, in {time.perf_counter() - t0:.0f} s "
      "of wall time)")

# %% [markdown]
# With the storage NICs scaled down 64x, the compute NICs and DRAM have that much more headroom,
# so the bottleneck-free range of *this* hardware is far wider than the paper's and every split
# is inside it. 5P1D cannot be deployed at all: routed experts spread over one decode node's 8
# GPUs are 99.7 GB per GPU, more than an 80 GB H800 holds, so the advisor reports it infeasible.
# The picture sets the advisor's DualPath runs beside Basic on the feasible splits, with the
# paper hardware's range shaded.

# %%
SPLITS = [(r["prefill_nodes"], r["decode_nodes"]) for r in report["candidates"] if "infeasible" not in r]
dualpath_jct = {(r["prefill_nodes"], r["decode_nodes"]): r["jct_s"] for r in report["candidates"] if "infeasible" not in r}
basic_jct = {(pn, dn): run("basic", SWEEP_AGENTS, pn, dn).jct_s for pn, dn in SPLITS}
assert abs(dualpath_jct[(2, 4)] - fig7[(SWEEP_AGENTS, "dualpath")].jct_s) < 1e-6  # same run as Figure 7's

fig, ax = plt.subplots(figsize=(7, 4))
ratios = [pn / dn for pn, dn in SPLITS]
ax.plot(ratios, [basic_jct[s] for s in SPLITS], "o-", label="basic", color=colors["basic"])
ax.plot(ratios, [dualpath_jct[s] for s in SPLITS], "o-", label="dualpath (advisor)", color=colors["dualpath"])
best = report["best"]
ax.plot(best["prefill_nodes"] / best["decode_nodes"], best["jct_s"], "*", ms=16, color="#e94", label="advisor's best")
r = pd_range(g=8, s=1, mem_gbps=500, bs_gbps=50)
ax.axvspan(r.lower, r.upper, color="#36c", alpha=0.08, label="bottleneck-free range (paper hardware)")
ax.set_xscale("log")
ax.set_xticks(ratios, [f"{pn}P{dn}D" for pn, dn in SPLITS])
ax.minorticks_off()
ax.set_xlabel("P/D (6 nodes)")
ax.set_ylabel("JCT (s, simulated)")
ax.set_title(f"DS 660B, {SWEEP_AGENTS} agents, storage NICs / {SCALE}")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Basic needs many prefill nodes because only their storage NICs read KV; DualPath reads
# through every node, so it stays fast with few prefill nodes and frees nodes for decode.

# %% [markdown]
# ## Coding-agent sessions: tool calls and subagents
#
# A coding agent's session is not the Table 2 trace's back-to-back rounds: after most turns the
# agent runs a tool for seconds to minutes, and some turns hand work to **subagents** that run
# beside it while the parent waits for their answers. `workload.trace_format="weka"` reads
# such sessions in the format kv-cache-tester records real Claude Code sessions in (NVIDIA
# AIPerf replays the same corpus): each session and each subagent is a trajectory, the think
# times are the tool-call gaps, and the turn that waited for subagents waits for their
# trajectories to finish in the replay too (`Round.waits_for`), then for the recorded rest of
# its gap (docs/traces.md, "Weka coding-agent sessions").
#
# The cell below writes 32 small sessions in that format (set `SESSIONS` to a directory of
# real session files to replay those instead): 8 turns each on a 16-24K-token context growing by
# a tool result per turn, tool calls of a few seconds, and after the third turn two subagents
# of four turns that the next turn waits for. All sessions start together, their subagents at
# their recorded offsets. The testbed is 2P4D with the storage NICs scaled as above.

# %%
SESSIONS = None  # or a directory of Weka-format session files (*.json)
BLOCK = 64  # tokens per hash id


def weka_session(k: int, rng: np.random.Generator, turns: int = 8) -> dict:
    """One session: its requests (t, in, out, hash_ids, think_time, api_time) and, after turn 2,
    two subagent entries (t: when each returned, duration_ms: how long it ran)."""
    reqs, ids, nxt, t, ctx = [], [], k * 1_000_000, 0.0, int(rng.integers(16_000, 24_000))
    for i in range(turns):
        new = ctx // BLOCK - len(ids)  # this turn's new whole blocks
        ids, nxt = ids + list(range(nxt, nxt + new)), nxt + new
        out, think = int(rng.integers(100, 600)), float(min(60.0, rng.lognormal(np.log(6), 0.6))) if i else 0.0
        t += think
        reqs.append({"t": round(t, 3), "type": "n", "in": ctx, "out": out, "hash_ids": ids,
                     "think_time": round(think, 3), "api_time": 2.0 + out / 60})
        t += 2.0 + out / 60
        if i == 2:  # spawn two subagents; the next turn comes 5 s after the longer one returns
            start, ends = t + 0.5, []
            for a in range(2):
                sub, sub_ids, sub_ctx = [], [], int(rng.integers(8_000, 14_000))
                for j in range(4):
                    n = sub_ctx // BLOCK - len(sub_ids)
                    sub_ids, nxt = sub_ids + list(range(nxt, nxt + n)), nxt + n
                    sub.append({"t": 6.0 * j, "type": "n", "in": sub_ctx, "out": 200, "hash_ids": sub_ids,
                                "think_time": 1.0 if j else 0.0, "api_time": 5.0})
                    sub_ctx += int(rng.integers(1_000, 4_000))
                duration = 6.0 * 4 + 1.0 + a * 6.0
                ends.append(start + duration)
                reqs.append({"t": round(ends[-1], 3), "type": "subagent", "agent_id": f"agent_{a}",
                             "duration_ms": duration * 1000, "requests": sub})
            t = max(ends) + 5.0
        ctx += out + int(rng.integers(500, 4_000))
    return {"id": f"session_{k:02d}", "block_size": BLOCK, "requests": sorted(reqs, key=lambda r: r["t"])}


if SESSIONS is None:
    written = tempfile.TemporaryDirectory()  # removed with this kernel
    SESSIONS = pathlib.Path(written.name)
    rng = np.random.default_rng(0)
    for k in range(32):
        (SESSIONS / f"session_{k:02d}.json").write_text(json.dumps(weka_session(k, rng)))

agentic_base, _ = paper_experiment(MODEL, 2, 4, snic_bytes_per_s=SNIC_GBPS / 8 * 1e9)
agentic_base = dataclasses.replace(agentic_base, workload=dataclasses.replace(
    agentic_base.workload, trace=str(SESSIONS), trace_format="weka", mode="online", aps=0.0,
    agents=None, max_turns=0, max_len=0, length_scale=1.0))  # replayed as recorded
plan = plan_workload(agentic_base)
trajs = plan.trajectories
after_tool = {(t.id, i) for t in trajs for i, r in enumerate(t.rounds) if i and r.gap_s > 0 and not r.waits_for}
after_subagents = {(t.id, i) for t in trajs for i, r in enumerate(t.rounds) if r.waits_for}
print(f"{len(trajs)} trajectories ({sum(':' in t.id for t in trajs)} subagents), "
      f"{sum(len(t.rounds) for t in trajs)} rounds: {len(after_tool)} after a tool call, "
      f"{len(after_subagents)} waiting for subagents; longest context {max(t.total_len for t in trajs):,} tokens")

# %%
AGENTIC_RUNS = {"basic": (Policy.BASIC, False), "basic + prefetch": (Policy.BASIC, True),
                "dualpath": (Policy.DUALPATH, False), "dualpath + prefetch": (Policy.DUALPATH, True),
                "oracle": (Policy.ORACLE, False)}
kvb = kv_bytes_per_token(agentic_base.model, agentic_base.hardware.kv_format or None)
hw = agentic_base.hardware  # each engine's DRAM buffer holds the longest context
hw = dataclasses.replace(hw, dram_buffer_bytes=max(hw.dram_buffer_bytes, math.ceil(1.05 * max(t.total_len for t in trajs) * kvb)))

t0 = time.perf_counter()
agentic = {}
for name, (policy, prefetch) in AGENTIC_RUNS.items():
    cfg = dataclasses.replace(agentic_base, hardware=hw, scheduler=dataclasses.replace(
        agentic_base.scheduler, policy=policy, prefetch=prefetch))
    r = simulate(cfg, trajectories=trajs, arrivals=plan.arrivals)
    ttft = {}
    for res in r.cluster.results:  # request ids: "<trajectory>/a<agent>/r<round>"
        head, _, k = res.request.rpartition("/r")
        ttft[head.rpartition("/a")[0], int(k)] = res.ttft_s
    agentic[name] = {"JCT s": r.jct_s, "TTFT p50 s": statistics.median(ttft.values()),
                     "after a tool call": statistics.median(ttft[k] for k in after_tool),
                     "after subagents": statistics.median(ttft[k] for k in after_subagents)}
print(f"{len(agentic)} simulations in {time.perf_counter() - t0:.0f} s of wall time\n")
cols = list(agentic["basic"])
print(f"{'':>20}" + "".join(f"{c:>19}" for c in cols))
for name, row in agentic.items():
    print(f"{name:>20}" + "".join(f"{row[c]:>19.2f}" for c in cols))

fig, ax = plt.subplots(figsize=(7, 3.6))
x = np.arange(3)
shades = {"basic": "#999", "basic + prefetch": "#caa", "dualpath": "#36c", "dualpath + prefetch": "#e94",
          "oracle": "#2a7"}
for k, (name, row) in enumerate(agentic.items()):
    ax.bar(x + (k - 2) * 0.16, [row[c] for c in cols[1:]], 0.16, label=name, color=shades[name])
ax.set_xticks(x, ["every turn", "after a tool call", "after subagents"])
ax.set_ylabel("TTFT p50 (s, simulated)")
ax.set_title(f"{len(trajs)} agent trajectories, DS 660B 2P4D, storage NICs / {SCALE}")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# With 32 sessions starting together, storage binds: under Basic only the two prefill nodes'
# storage NICs (here at 1/64 of the paper's bandwidth) read the sessions' 16-43K-token contexts,
# and the median turn waits about 7 s for its first token, 8 s after a tool call. DualPath reads
# through all six nodes and cuts that to about 2 s. The tool calls leave the storage NICs idle
# between turns, which tool-gap prefetch fills (`scheduler.prefetch`, docs/policies.md): the
# turn after a tool call then starts in about 1.6 s, and the turn after the subagents, whose
# remaining gap is known once they have returned, in about 1.0 s, close to Oracle (no storage
# reads at all, about 1 s). Basic's prefetch reads into the prefill nodes, the only ones Basic
# reads on; their NICs are rarely idle here, so most of its prefetches read little (unused:
# the turn is pinned to a prefetch's node only when that does not lengthen its read) and the
# turn after a tool call gains about 1 s (8.3 to 7.3 s) at a 3% longer JCT: prefetch spends
# idle storage bandwidth, and Basic leaves idle only the decode nodes', which it cannot read
# through. JCT moves far less (about 330, 341, 289, 278 and 276 s): a session's time is mostly
# its tool calls and the subagents its parent waits for, which no scheduler shortens. `python bench/agentic_traces.py --trace=SESSIONS` runs the same comparison on real
# sessions, with an unlimited and a limited store.
#
# ## From the command line
#
# The same simulator behind absl flags (writes `summary.json` and per-node link series to the
# workdir), e.g. for the small CPU layouts:
#
# ```bash
# python launch/simulate.py --config=configs/cpu_1p2d.py --policy=dualpath --agents=16 --workdir=/tmp/dp_sim
# python launch/simulate.py --config=configs/cpu_1p2d.py:tiny --advise --workdir=/tmp/dp_advise
# python bench/paper_figures.py --quick --out=bench_out/paper_quick   # every paper figure, reduced
# ```
#
# `docs/simulator.md` explains the calibrated GPU roofline, the paper's cluster presets and how
# `bench/paper_figures.py` compares each headline number with the paper's.
