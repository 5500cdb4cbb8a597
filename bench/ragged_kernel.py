"""A ragged prefill batch through the paged kernel: what telling it each request's real new
tokens (`new_lens`) saves when a batch pads its requests to the longest.

Run: python bench/ragged_kernel.py [--scale=16] [--repeats=3] [--json]

The batch is `bench/accel_memory.py`'s `RAGGED`: 8 requests of 128..2,048 new tokens over
0..32,768 cached, padded (as `PrefillBatch.build` pads them) to 2,048 new tokens each, over a
Qwen2.5-7B layer's heads (28 query / 4 KV heads of 128, bf16 KV, pages of 64 tokens). Two
figures, side by side for the padded call and the ragged one:

- `key_rows`: the key rows the kernel's programs attend, counted from its GPU plan (row blocks of
  64 query rows, 64 new keys per causal step, 128 cached keys per step) at the full shapes: a
  padding query's block reads all of its request's cached pages unless the kernel knows it is
  padding. The hardware-independent figure.
- `interpret_ms`: the kernel's wall time in interpret mode on this host (XLA's loops over the
  kernel's blocks) at shapes divided by `--scale` (lengths; the heads stay), the median of
  `--repeats`. The real rows of both calls are checked to be equal.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from accel_memory import PAGE, RAGGED  # bench/ is the script's directory
from layerwise import median_seconds

from dualpath_jax.kernels import paged_attention as pa
from dualpath_jax.kernels.kv_rows import RowLayout

FLAGS = flags.FLAGS
HQ, HK, D = 28, 4, 128  # Qwen2.5-7B's attention heads
ROWS, NEW_BLOCK, KEYS = 64, 64, 128  # the GPU plan: query rows, causal keys, cached keys per step


def key_rows(requests, n_pad: int, ragged: bool) -> int:
    """Key rows the GPU plan's programs attend over one KV head: per row block of `ROWS` query
    rows (8 queries of a 7-query group padded to 8), its request's cached pages in steps of
    `KEYS` keys, then the causal new keys up to its last query in steps of `NEW_BLOCK`."""
    group = 8
    total = 0
    for new, cached in requests:
        for start in range(0, n_pad * group, ROWS):
            first_query, last_query = start // group, (start + ROWS - 1) // group
            if ragged:
                if first_query >= new:
                    continue  # padding only: the block attends nothing
                last_query = min(last_query, new - 1)
            cached_steps = -(-cached // KEYS)
            total += cached_steps * KEYS + (last_query // NEW_BLOCK + 1) * NEW_BLOCK
    return total


def _case(requests, rng):
    layout = RowLayout.gqa(HK, D)
    n_pad = max(n for n, _ in requests)
    b = len(requests)
    counts = [max(1, -(-c // PAGE)) for _, c in requests]
    q = jnp.asarray(rng.normal(size=(b, n_pad, HQ, D)), jnp.bfloat16)
    pages = jnp.asarray(rng.normal(size=(sum(counts) + 1, 1, PAGE, layout.row_width)), jnp.bfloat16)
    table = np.zeros((b, max(counts)), np.int32)
    nxt = 1
    for i, k in enumerate(counts):
        table[i, :k] = np.arange(nxt, nxt + k)
        nxt += k
    new = jnp.asarray(rng.normal(size=(b, n_pad, layout.row_width)), jnp.bfloat16)
    lens = jnp.asarray([c for _, c in requests], jnp.int32)
    new_lens = jnp.asarray([n for n, _ in requests], jnp.int32)
    return layout, (q, pages, jnp.asarray(table), lens, new), new_lens


def run(scale: int, repeats: int) -> dict:
    n_pad = max(n for n, _ in RAGGED)
    full = {"padded": key_rows(RAGGED, n_pad, False), "ragged": key_rows(RAGGED, n_pad, True)}
    small = [(max(1, n // scale), c // scale) for n, c in RAGGED]
    layout, args, new_lens = _case(small, np.random.default_rng(0))
    scale_ = D**-0.5

    def call(ragged: bool):
        return jax.jit(
            lambda q, p, t, ln, nw, nl: pa.paged_attention(
                q, p, t, ln, nw, layout, scale_, new_lens=nl if ragged else None, interpret=True
            )
        )

    padded, ragged = call(False), call(True)

    t_pad, t_rag = (
        median_seconds(lambda f=f: f(*args, new_lens), repeats) for f in (padded, ragged)
    )
    out_pad, out_rag = (np.asarray(f(*args, new_lens), np.float32) for f in (padded, ragged))
    real = np.arange(out_pad.shape[1])[None, :] < np.asarray(new_lens)[:, None]
    same = bool(np.array_equal(out_pad[real], out_rag[real])) and not out_rag[~real].any()
    return {
        "requests": [list(r) for r in RAGGED],
        "key_rows": {**full, "saved": 1 - full["ragged"] / full["padded"]},
        "interpret": {
            "scale": scale,
            "padded_ms": 1e3 * t_pad,
            "ragged_ms": 1e3 * t_rag,
            "speedup": t_pad / t_rag,
            "same_real_rows": same,
        },
        "jax": jax.__version__,
    }


def main(argv):
    del argv
    res = run(FLAGS.scale, FLAGS.repeats)
    if FLAGS.json:
        print(json.dumps(res))
        return
    k, t = res["key_rows"], res["interpret"]
    print(f"ragged prefill batch of {len(RAGGED)} requests, padded to {max(n for n, _ in RAGGED)}")
    print(
        f"key rows attended (GPU plan, one KV head): padded {k['padded']:,}, ragged"
        f" {k['ragged']:,} ({100 * k['saved']:.0f}% fewer)"
    )
    print(
        f"interpret mode at 1/{t['scale']} lengths: padded {t['padded_ms']:.0f} ms, ragged"
        f" {t['ragged_ms']:.0f} ms ({t['speedup']:.2f}x), real rows equal: {t['same_real_rows']}"
    )


if __name__ == "__main__":
    flags.DEFINE_integer("scale", 16, "divide the lengths by this for the timed run")
    flags.DEFINE_integer("repeats", 3, "timed runs per call (the median is reported)")
    flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
