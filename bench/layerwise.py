"""Layerwise prefill against the monolithic forward over resident KV, at compute-heavy shapes.

Run: python bench/layerwise.py [--layers=8 --hidden=1024 --cached=4096 --new=512 --repeats=3]
     [--json]

One model and one batch (`--batch` requests of `--cached` cached and `--new` new tokens), timed
side by side in one process (median of `--repeats` after a warm-up run):
- resident: `ModelRunner.prefill_program` with every layer's cached pages already in device
  memory: the monolithic forward, the baseline (no copy on the critical path).
- program: the same program with the pages in `pinned_host` memory; each scan iteration copies
  its layer's pages to the device inside the program, so XLA can overlap layer i+1's copy with
  layer i's compute (what Basic mode runs).
- loop: `ModelRunner.prefill_layerwise` with each layer's pages handed over from host numpy just
  before the layer runs (`device_put` from pageable memory, one jitted layer per call: what the
  PE's layerwise mode runs when KV streams in per layer).
- copy: the host-to-device copy of every layer's pages alone (pinned host -> device and
  pageable numpy -> device), what an overlap hides.
Reported: each variant / resident, and the overlap fraction of program and loop: the share of
the copy time hidden under compute, `1 - max(0, t_variant - t_resident) / t_copy` in [0, 1].
On a CPU the device is host memory: `pinned_host` and device memory are the same DRAM, XLA
lowers the in-program copy to nothing, and only the loop's numpy copies are real copies; the
figures that measure the mechanism come from an accelerator.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from dualpath_jax.config import ModelConfig
from dualpath_jax.model.cached_kv import CachedPages, LayerPages
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2

PAGE = 64


@dataclasses.dataclass(frozen=True)
class Shapes:
    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816
    batch: int = 1
    cached: int = 4096
    new: int = 512

    def model(self) -> ModelConfig:
        return dataclasses.replace(
            TINY_QWEN2,
            name="bench-layerwise",
            vocab_size=1024,
            hidden_size=self.hidden,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.hidden // self.heads,
            intermediate_size=self.intermediate,
            max_seq_len=max(8192, self.cached + self.new),
        )


TINY = Shapes(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=96, cached=80, new=16)


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` (blocked until ready) over `repeats` runs after a warm-up."""
    jax.block_until_ready(fn())  # warm-up: compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _overlap(t: float, resident: float, copy: float) -> float:
    if copy <= 0:
        return 1.0
    return min(1.0, max(0.0, 1.0 - max(0.0, t - resident) / copy))


def measure(shapes: Shapes, repeats: int = 3) -> dict:
    cfg = shapes.model()
    runner = ModelRunner(init_model(cfg, 0))
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, cfg.vocab_size, shapes.new).tolist() for _ in range(shapes.batch)]
    batch = PrefillBatch.build(cfg, prompts, [shapes.cached] * shapes.batch)
    rows = rs.randn(cfg.num_layers, shapes.batch, shapes.cached, cfg.kv_width)
    rows = rows.astype(cfg.kv_dtype)
    layers = [
        LayerPages.from_rows(list(rows[i]), PAGE, cfg.kv_width, cfg.kv_dtype)
        for i in range(cfg.num_layers)
    ]
    host = CachedPages.from_layers(layers)
    on_device, pinned = host.to_device(), host.to_host()

    def program(kv):
        res, new = runner.prefill_program(batch, kv)
        return res.last_logits, new

    def loop():
        out = []
        res = runner.prefill_layerwise(batch, layers.__getitem__, lambda i, r: out.append(r))
        return res.last_logits, out

    dev = jax.devices()[0]
    to_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    t = {
        "resident": median_seconds(lambda: program(on_device), repeats),
        "program": median_seconds(lambda: program(pinned), repeats),
        "loop": median_seconds(loop, repeats),
        "copy_pinned": median_seconds(lambda: jax.device_put(pinned.pages, to_dev), repeats),
        "copy_pageable": median_seconds(lambda: jax.device_put(host.pages, to_dev), repeats),
    }
    kv_bytes = int(host.pages.nbytes)
    return {
        "device": str(dev),
        "shapes": dataclasses.asdict(shapes),
        "kv_bytes": kv_bytes,
        "seconds": t,
        "program_vs_resident": t["program"] / t["resident"],
        "loop_vs_resident": t["loop"] / t["resident"],
        "program_overlap": _overlap(t["program"], t["resident"], t["copy_pinned"]),
        "loop_overlap": _overlap(t["loop"], t["resident"], t["copy_pageable"]),
    }


def main(argv):
    del argv
    shapes = Shapes(
        layers=_LAYERS.value,
        hidden=_HIDDEN.value,
        heads=_HEADS.value,
        kv_heads=_KV_HEADS.value,
        intermediate=_INTERMEDIATE.value,
        batch=_BATCH.value,
        cached=_CACHED.value,
        new=_NEW.value,
    )
    r = measure(TINY if _TINY.value else shapes, _REPEATS.value)
    if _JSON.value:
        print(json.dumps(r))
        return
    s, t = r["shapes"], r["seconds"]
    print(
        f"device: {r['device']}  {s['layers']} layers, hidden {s['hidden']}, batch {s['batch']}"
        f" x ({s['cached']} cached + {s['new']} new), cached KV {r['kv_bytes'] / 2**20:.1f} MiB"
    )
    print(f"resident (monolithic) : {t['resident'] * 1e3:9.1f} ms")
    print(
        f"program (pinned host) : {t['program'] * 1e3:9.1f} ms  {r['program_vs_resident']:.3f}x"
        f"  overlap {r['program_overlap']:.2f}"
    )
    print(
        f"loop (pageable numpy) : {t['loop'] * 1e3:9.1f} ms  {r['loop_vs_resident']:.3f}x"
        f"  overlap {r['loop_overlap']:.2f}"
    )
    print(
        f"copy alone            : pinned {t['copy_pinned'] * 1e3:.2f} ms,"
        f" pageable {t['copy_pageable'] * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    d = Shapes()
    _LAYERS = flags.DEFINE_integer("layers", d.layers, "decoder layers")
    _HIDDEN = flags.DEFINE_integer("hidden", d.hidden, "hidden size")
    _HEADS = flags.DEFINE_integer("heads", d.heads, "query heads")
    _KV_HEADS = flags.DEFINE_integer("kv_heads", d.kv_heads, "KV heads")
    _INTERMEDIATE = flags.DEFINE_integer("intermediate", d.intermediate, "MLP width")
    _BATCH = flags.DEFINE_integer("batch", d.batch, "requests in the batch")
    _CACHED = flags.DEFINE_integer("cached", d.cached, "cached tokens per request")
    _NEW = flags.DEFINE_integer("new", d.new, "new tokens per request")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "timed repetitions (median reported)")
    _TINY = flags.DEFINE_bool("tiny", False, "tiny shapes (a smoke run)")
    _JSON = flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
