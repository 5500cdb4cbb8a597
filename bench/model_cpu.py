"""Model speed on CPU: layerwise vs monolithic prefill, decode step time, compile counts.

Run: python bench/model_cpu.py [--cached=4096 --new=256 --repeats=5 --json=out.json]

Layerwise prefill takes each layer's cached KV from host memory just before that layer runs;
monolithic prefill runs every layer in one compiled call with all cached KV already on the device.
Both are timed side by side in one process (median of `repeats` after a warm-up run).
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.runner import ModelRunner, PrefillBatch, compile_count
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2

_CACHED = flags.DEFINE_integer("cached", 4096, "cached tokens per request")
_NEW = flags.DEFINE_integer("new", 256, "new tokens per request")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed repetitions (median reported)")
_JSON = flags.DEFINE_string("json", "", "optional path for the results as JSON")


def timed(fn, repeats):
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill_pair(runner, cached, new, repeats):
    cfg = runner.cfg
    rs = np.random.RandomState(0)
    batch = PrefillBatch.build(cfg, [rs.randint(0, cfg.vocab_size, new).tolist()], [cached])
    host_kv = rs.randn(cfg.num_layers, 1, batch.c_pad, cfg.kv_width).astype(cfg.kv_dtype)
    dev_kv = jax.device_put(host_kv)

    def mono():
        res, new_kv = runner.prefill_monolithic(batch, dev_kv)
        jax.block_until_ready((res.last_logits, new_kv))

    def layerwise():
        out = []
        res = runner.prefill_layerwise(batch, lambda i: host_kv[i], lambda i, r: out.append(r))
        jax.block_until_ready((res.last_logits, out))

    return timed(mono, repeats), timed(layerwise, repeats)


def decode_times(runner, batch_sizes, context, repeats):
    cfg = runner.cfg
    out = {}
    for b in batch_sizes:
        dec = Decoder(runner, slots=b, max_len=context + 64)
        kv = (
            np.random.RandomState(1)
            .randn(cfg.num_layers, context, cfg.kv_width)
            .astype(cfg.kv_dtype)
        )
        for s in range(b):
            dec.insert(s, kv, context, 1)

        def step(dec=dec):
            jax.block_until_ready(dec.step())
            dec.lengths[dec.active] = context  # keep the context fixed across repetitions

        out[b] = timed(step, repeats)
    return out


def ragged_compiles(runner, n=20):
    cfg = runner.cfg
    rs = np.random.RandomState(2)
    before = compile_count()
    buckets = set()
    for _ in range(n):
        c, m = int(rs.randint(0, 2000)), int(rs.randint(1, 300))
        batch = PrefillBatch.build(cfg, [rs.randint(0, cfg.vocab_size, m).tolist()], [c])
        buckets.add((batch.n_pad, batch.c_pad))
        rows = jnp.zeros((1, batch.c_pad, cfg.kv_width), cfg.kv_dtype)
        runner.prefill_layerwise(batch, lambda i, rows=rows: rows)
    kinds = len(set(runner.layer_gds))
    return compile_count() - before, len(buckets), kinds


def main(argv):
    del argv
    results = {
        "device": str(jax.devices()[0]),
        "cached": _CACHED.value,
        "new": _NEW.value,
        "models": {},
    }
    for cfg in (TINY_QWEN2, TINY_DEEPSEEK):
        runner = ModelRunner(init_model(cfg, 0))
        mono, lw = prefill_pair(runner, _CACHED.value, _NEW.value, _REPEATS.value)
        dec = decode_times(runner, [1, 4, 16, 64], 1024, _REPEATS.value)
        compiles, buckets, kinds = ragged_compiles(runner)
        results["models"][cfg.name] = {
            "monolithic_prefill_s": mono,
            "layerwise_prefill_s": lw,
            "layerwise_over_monolithic": lw / mono,
            "decode_step_s_at_1024_ctx": dec,
            "ragged_requests": 20,
            "compiles": compiles,
            "shape_buckets": buckets,
            "layer_kinds": kinds,
        }
    print(
        f"device: {results['device']}; prefill at {_CACHED.value} cached + {_NEW.value} new tokens"
    )
    print(
        f"{'model':<15}{'mono ms':>9}{'layerwise ms':>14}{'ratio':>7}   decode ms/step (B=1,4,16,64; ctx 1024)   compiles/buckets"
    )
    for name, r in results["models"].items():
        d = " ".join(f"{v * 1e3:6.2f}" for v in r["decode_step_s_at_1024_ctx"].values())
        print(
            f"{name:<15}{r['monolithic_prefill_s'] * 1e3:9.1f}{r['layerwise_prefill_s'] * 1e3:14.1f}"
            f"{r['layerwise_over_monolithic']:7.2f}   {d:<40} {r['compiles']}/{r['shape_buckets']}x{r['layer_kinds']}+head"
        )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
