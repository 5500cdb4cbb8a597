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
# 3. plots the storage NICs' read traffic, the paper's Figure 13 view.
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
import functools
import time

import matplotlib.pyplot as plt
import numpy as np

from dualpath_jax.analysis import format_pd_range, pd_range
from dualpath_jax.presets import paper_config
from dualpath_jax.sim import simulate
from dualpath_jax.sim.advisor import AdviseSpace, advise, format_report, pd_splits

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
# ## Coding-agent sessions and tool-gap prefetch (beyond the paper)
#
# Coding agents (Claude Code, Codex) send long, growing contexts with a short append per turn
# and a **tool call** between turns: the next turn's hit KV is known during the gap, yet it is
# read only when the turn arrives. With `scheduler.prefetch` the scheduler reads it into a
# decode engine's DRAM during the gap, at the storage links' low priority, so the turn starts
# with its hit in memory. `bench/agentic_traces.py` replays sessions in the Weka/AIPerf JSON
# format (hash-id blocks, think times, subagents) under Basic, DualPath, DualPath + prefetch and
# Oracle. Here it runs on a few sessions of that format built in the cell; point `WEKA_SESSIONS`
# at a directory of real ones (e.g. the public 28-session corpus) to replay those instead.

# %%
import json
import pathlib
import tempfile

import dualpath_jax

# The bench script's functions (its flags exist only as a script), from this clone.
agentic = runpy.run_path(str(pathlib.Path(dualpath_jax.__file__).parents[1] / "bench" / "agentic_traces.py"))


def build_sessions(n=4, turns=5, first=20_000, append=900, think=12.0):
    """`n` Weka-format sessions: growing contexts of 64-token blocks, one tool call per turn."""
    out = pathlib.Path(tempfile.mkdtemp()) / "weka"
    out.mkdir()
    for s in range(n):
        reqs, ids, ctx = [], [], first + 640 * s
        for i in range(turns):
            ids = ids + list(range(s * 10_000 + len(ids), s * 10_000 + ctx // 64))
            reqs.append({"t": 3.0 * s + 30.0 * i, "type": "n", "in": ctx, "out": 150, "hash_ids": ids,
                         "think_time": think if i else 0.0, "stop": "tool_use"})
            ctx += append
        (out / f"s{s}.json").write_text(json.dumps({"id": f"s{s}", "block_size": 64, "requests": reqs}))
    return out


trace = os.environ.get("WEKA_SESSIONS") or str(build_sessions())
rows = agentic["run_all"](trace, capacity_fraction=0.5, snic_gbps=16.0, stores=("unlimited",))
print(agentic["format_table"](rows))

fig, ax = plt.subplots(figsize=(7, 3))
ax.bar([r["run"] for r in rows], [r["ttft_after_tool_p50_s"] for r in rows], color=["#999", "#36c", "#e94", "#6a6"])
ax.set_ylabel("TTFT p50 after a tool call (s)")
ax.set_title("DS 660B 2P4D, 16 Gbps storage NICs (simulated)")
fig.tight_layout()
plt.show()
by = {r["run"]: r for r in rows}
assert by["dualpath+prefetch"]["ttft_after_tool_p50_s"] < by["dualpath"]["ttft_after_tool_p50_s"]

# %% [markdown]
# The turns after a tool call start sooner with prefetch: their hit was read during the gap,
# on links the rounds in flight did not need, so it is in a decode engine's memory when the
# turn arrives. The hit rate is the same in every run (prefetch moves reads earlier, it adds no
# hits), and JCT is no worse. docs/results.md has the 28 public sessions at the paper's 400 Gbps
# storage NIC and at 50 Gbps.

# %% [markdown]
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
