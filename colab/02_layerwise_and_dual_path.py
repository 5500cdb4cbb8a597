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
# # 02: layerwise prefill and the two KV read paths, one request up close
#
# This notebook takes **one request** whose first 64 tokens were computed in an earlier turn
# and whose KV therefore sits in the block store, and follows its KV through the system, all in
# this process (no engine processes, a few seconds on a CPU):
#
# 1. **Layerwise prefill** computes exactly what the monolithic forward computes, while asking
#    for layer `i`'s cached KV only when layer `i` is about to run.
# 2. The KV of the cached prefix moves along the **PE read path** (store -> prefill node),
#    the **DE read path** (store -> decode node -> prefill engine over the compute network) or
#    the **split path** (some blocks each way): the prefill engine and the decode buffer end up
#    with byte-identical KV on all three.
# 3. Every byte is charged to a named link; we draw the per-link bytes of each path as a picture
#    and check them against the paper's data-path formulas (`paths.expected_link_bytes`).
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

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: the tiny model runs on CPU anywhere
if importlib.util.find_spec("dualpath_jax") is None:  # not installed: install this clone
    runpy.run_path("colab/setup/install.py")  # from the clone's root

# %%
from concurrent import futures

import matplotlib.pyplot as plt
import numpy as np

from dualpath_jax.config import HardwareConfig, StoreConfig
from dualpath_jax.kvstore import block_keys, model_fingerprint, open_block_store
from dualpath_jax.kvstore.buffers import HostBufferPool
from dualpath_jax.model.layout import BlockLayout, kv_to_full_blocks
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.transfer import paths
from dualpath_jax.transfer.decode_load import DecodeLoad
from dualpath_jax.transfer.inprocess_channel import InProcessChannel, InProcessFabric
from dualpath_jax.transfer.loader import LoaderContext, LoadJob
from dualpath_jax.transfer.prefill_load import PrefillLoad
from dualpath_jax.transfer.traffic import TrafficManager

CFG = TINY_QWEN2  # 3 layers, GQA, vocab 257: random weights, but every equivalence is exact
BT = 16  # tokens per block (the paper uses 64; small blocks keep this example small)
runner = ModelRunner(init_model(CFG, seed=0))
prompt = np.random.default_rng(0).integers(0, CFG.vocab_size, 100).tolist()
CACHED = 64  # the first 64 tokens (4 full blocks) came from an earlier turn
print(f"model {CFG.name}: {CFG.num_layers} layers, KV row width {CFG.kv_width}; prompt of {len(prompt)} tokens, "
      f"{CACHED} cached + {len(prompt) - CACHED} new")

# %% [markdown]
# ## 1. Layerwise prefill == monolithic forward
#
# The monolithic forward runs the whole prompt through all layers in one compiled call. The
# layerwise prefill computes only the 36 new tokens, and takes the cached tokens' KV through a
# callback `load_layer(i)` that it calls just before layer `i` runs (one layer ahead, so the next
# layer's copy overlaps this layer's compute); `emit_layer(i, rows)`
# hands out layer `i`'s new KV as soon as that layer is done. That is what lets the engines
# stream KV one **Layer Block** at a time instead of holding the whole prompt's KV on the
# device.

# %%
whole, kv_ref = runner.prefill_monolithic(PrefillBatch.build(CFG, [prompt], [0]))
kv_ref = np.asarray(kv_ref[:, 0, : len(prompt)])  # [L, T, W]: every layer's KV rows of the prompt

order = []
new_rows = {}
batch = PrefillBatch.build(CFG, [prompt[CACHED:]], [CACHED])


def load_layer(i):
    order.append(f"load {i}")
    rows = np.zeros((1, batch.c_pad, CFG.kv_width), np.float32)  # [B, c_pad, W]
    rows[0, :CACHED] = kv_ref[i, :CACHED]
    return rows


def emit_layer(i, rows):
    order.append(f"emit {i}")
    new_rows[i] = np.asarray(rows[0, : len(prompt) - CACHED])


res = runner.prefill_layerwise(batch, load_layer, emit_layer)
print("call order:", ", ".join(order))
logit_err = float(np.max(np.abs(np.asarray(res.last_logits) - np.asarray(whole.last_logits))))
kv_err = max(float(np.max(np.abs(new_rows[i] - kv_ref[i, CACHED:]))) for i in range(CFG.num_layers))
print(f"max |logits difference| = {logit_err:.2e}, max |new KV difference| = {kv_err:.2e}")
assert logit_err < 1e-4 and kv_err < 1e-4
pos = {e: k for k, e in enumerate(order)}
for i in range(CFG.num_layers):  # layer i's KV is asked for before layer i runs, at most one layer ahead
    assert pos[f"load {i}"] < pos[f"emit {i}"]
    assert i < 2 or pos[f"load {i}"] > pos[f"emit {i - 2}"]

# %% [markdown]
# ## 2. The block store: Full Blocks and Layer Blocks
#
# The earlier turn persisted the prefix as **Full Blocks** `[layers, block_tokens, bytes per
# token per layer]` (uint8) under hash-chain keys: block `k`'s key hashes block `k-1`'s key and
# block `k`'s tokens, seeded by the model's fingerprint, so a prefix hit is the longest run of
# stored keys. One layer of a Full Block is a **Layer Block**, the unit of layerwise streaming.

# %%
layout = BlockLayout.for_model(CFG, BT)
store = open_block_store(StoreConfig(kind="memory", block_tokens=BT), CFG)
keys = block_keys(prompt, BT, model_fingerprint(CFG))[: CACHED // BT]
store.write_full(keys, kv_to_full_blocks(kv_ref[:, :CACHED], BT)).result()
print(f"{len(keys)} Full Blocks of shape {layout.shape} ({layout.nbytes:,} bytes each), "
      f"a Layer Block is {layout.layer_nbytes:,} bytes")
print("stored prefix hit for this prompt:", store.lookup(block_keys(prompt, BT, model_fingerprint(CFG))).result(), "blocks")

# %% [markdown]
# ## 3. One request on each read path
#
# Two halves of the loader meet on a KV channel, here the in-process fake of
# `jax.experimental.transfer` (`InProcessChannel`): the **prefill half** (`PrefillLoad`, engine
# `pe0` on node `node0`) and the **decode half** (`DecodeLoad`, engine `de1` on node `node1`).
# A `LoadJob` says how many hit blocks each side reads: `pe_blocks` on the PE node, `de_blocks`
# on the DE node. A fresh `TrafficManager` per run counts every byte per link; each half charges
# only the links it owns (its engine's and its node's), as the engine processes do.


# %%
def run_one_request(pe_blocks: int, de_blocks: int):
    """Moves the request's KV with `pe_blocks` read on the PE side and `de_blocks` on the DE
    side, prefilling the new tokens layer by layer; returns (hit KV the prefill engine saw
    per layer, the DE buffer's prompt KV [L, T, W], bytes per link)."""
    fabric, traffic = InProcessFabric(), TrafficManager(HardwareConfig())  # rate 0: unlimited
    pool = futures.ThreadPoolExecutor(8)

    def context(engine, node):
        return LoaderContext(CFG, layout, store, HostBufferPool(layout, 32, engine), InProcessChannel(fabric, engine),
                             traffic, pool, timeout_s=20.0, owners=frozenset({engine, node}))

    pe_ctx, de_ctx = context("pe0", "node0"), context("de1", "node1")
    job = LoadJob("req-1", tuple(keys), pe_blocks, de_blocks, len(prompt), "pe0", "node0", "de1", "node1",
                  pe_ctx.channel.address, de_ctx.channel.address)
    de = DecodeLoad(de_ctx, job).start()  # DE half: reserve the DE buffer, read its blocks
    pe = PrefillLoad(pe_ctx, job).start()  # PE half: read its blocks into the PE buffer
    hit = pe.hit_blocks() * BT  # verified hit tokens (a corrupt block would end the hit early)
    pe.stream()  # start streaming layer blocks towards the PE device
    b = PrefillBatch.build(CFG, [prompt[hit:]], [hit])
    pe.begin_chunk(hit, len(prompt), True)
    seen = {}

    def load(i):  # layer i's hit KV, from the PE buffer and/or from the DE buffer
        seen[i] = pe.readiness.wait(i, 20.0).to_numpy()  # [hit, W] (a HitLayer: host and device parts)
        pe.consumed()
        rows = np.zeros((1, b.c_pad, CFG.kv_width), np.float32)
        rows[0, :hit] = seen[i]
        return rows

    runner.prefill_layerwise(b, load, lambda i, rows: pe.send_layer(i, np.asarray(rows[0, : len(prompt) - hit])))
    pe.flush()
    de.wait(20.0)
    prompt_kv = de.prompt_kv()
    pe.close()
    de.close()
    link_bytes = {lid.name: traffic.bytes(lid) for lid in traffic.links() if traffic.bytes(lid)}
    traffic.close()
    pool.shutdown()
    return seen, prompt_kv, link_bytes


PATHS = {"pe": (4, 0), "de": (0, 4), "split": (2, 2)}
runs = {name: run_one_request(*split) for name, split in PATHS.items()}

per_token = layout.bytes_per_token_per_layer * CFG.num_layers
for name, (seen, prompt_kv, link_bytes) in runs.items():
    exact_hit = all(seen[i].tobytes() == kv_ref[i, :CACHED].tobytes() for i in range(CFG.num_layers))
    tail_err = float(np.max(np.abs(prompt_kv - kv_ref)))
    want = paths.expected_link_bytes(
        name, CACHED * per_token, (len(prompt) - CACHED) * per_token, pe="pe0", de="de1",
        pe_node="node0", de_node="node1", de_hit_bytes=PATHS[name][1] * BT * per_token, decode=False,
    )
    print(f"{name:>5}: PE saw the stored KV bit for bit: {exact_hit}; DE buffer vs reference: "
          f"max diff {tail_err:.1e}; link bytes as the data-path formulas say: {link_bytes == want}")
    assert exact_hit and tail_err < 1e-4 and link_bytes == want

same = runs["pe"][1].tobytes() == runs["de"][1].tobytes() == runs["split"][1].tobytes()
print("DE buffer KV identical across the three paths:", same)
assert same

# %% [markdown]
# ## 4. Where the bytes went
#
# The picture shows the two nodes of each run: arrows carry the bytes charged to the storage
# NICs (`snic_rx`), the host->device copy of the PE (`h2d`) and the compute NICs (`cnic`),
# thicker for more bytes, dashed when unused. On the PE path the prefill node's storage NIC reads
# everything; on the DE path the decode node's storage NIC reads it and its compute NIC sends
# each layer to the PE device, so the prefill node's storage NIC stays idle. That idle storage
# bandwidth on the decode side is what DualPath pools. The PE device -> DE buffer arrow carries
# the hit + the 36 new tokens' KV on the PE path (the DE has nothing yet) but only the new
# tokens' KV on the DE path (the DE buffer already holds the hit).

# %%
ARROWS = [  # (link whose bytes the arrow carries, from, to, arrow route, label position)
    ("snic_rx:node0", (0.42, 0.90), (0.25, 0.64), "arc3,rad=0", (0.30, 0.78)),
    ("snic_rx:node1", (0.58, 0.90), (0.75, 0.64), "arc3,rad=0", (0.70, 0.78)),
    ("h2d:pe0", (0.22, 0.52), (0.22, 0.26), "arc3,rad=0", (0.12, 0.39)),
    ("cnic_tx:de1", (0.70, 0.53), (0.32, 0.25), "arc3,rad=0", (0.56, 0.44)),  # DE buffer -> PE device
    ("cnic_tx:pe0", (0.32, 0.17), (0.84, 0.53), "angle,angleA=0,angleB=90,rad=0", (0.62, 0.11)),  # PE device -> DE buffer
]


def draw_paths(ax, name, link_bytes, top):
    boxes = {"storage": (0.5, 0.94), "PE buffer\n(node0 DRAM)": (0.22, 0.58), "PE device\n(pe0)": (0.22, 0.2),
             "DE buffer\n(node1 DRAM)": (0.78, 0.58)}
    for text, (x, y) in boxes.items():
        ax.text(x, y, text, ha="center", va="center", fontsize=8, bbox=dict(boxstyle="round", fc="#eef", ec="#336"))
    for link, start, end, route, at in ARROWS:
        n = link_bytes.get(link, 0)
        color = "#c33" if n else "#aaa"
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(
            arrowstyle="-|>", lw=0.8 + 5 * n / top, color=color, ls="-" if n else "--",
            connectionstyle=route))
        ax.text(*at, f"{link}\n{n / 1e3:.0f} KB", fontsize=7, ha="center", va="center", color=color,
                bbox=dict(fc="white", ec="none", alpha=0.8))
    ax.set_title(f"{name} path: {PATHS[name][0]} blocks read by PE node, {PATHS[name][1]} by DE node", fontsize=9)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.axis("off")


top = max(v for _, _, lb in runs.values() for v in lb.values())
fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
for ax, (name, (_, _, link_bytes)) in zip(axes, runs.items()):
    draw_paths(ax, name, link_bytes, top)
fig.suptitle("Per-link bytes of one request (64 cached + 36 new tokens, tiny Qwen2)")
fig.tight_layout()
plt.show()

# %% [markdown]
# The same numbers as a table (bytes per link, every link any run touched; `dram:*` is the
# node's memory bandwidth, charged by every copy into or out of a host buffer):

# %%
names = sorted({n for _, _, lb in runs.values() for n in lb})
print(f"{'link':<16}" + "".join(f"{p:>10}" for p in runs))
for n in names:
    print(f"{n:<16}" + "".join(f"{runs[p][2].get(n, 0):>10,}" for p in runs))
store.close()
