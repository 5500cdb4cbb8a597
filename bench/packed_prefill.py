"""Packed prefill against the padded layout, for batches that mix long and short requests.

Run: python bench/packed_prefill.py [--layers=4 --hidden=1024 --repeats=3] [--json]

A prefill engine batches whichever requests are queued: in an agentic trace one new prompt of a
thousand tokens shares a forward with short tool-result appends over long cached contexts.
Padded, every request takes the longest one's rows through the norms, projections and MLP;
packed (model/packing.py), those run over the real tokens only and attention alone sees the
padded layout. Each batch below runs through `ModelRunner.prefill_layerwise` over its cached
pages (the prefill engine's path) both ways, side by side in one process (median of
`--repeats` after a warm-up run); the logits of the two agree (largest difference reported).
Also reported: XLA's cost analysis of one layer's compiled program each way (floating-point
operations and bytes accessed, attention included). On this CPU attention is the dense
`reference` backend, which computes every padded query over its request's keys either way, so
the time saved is the token-wise share; on an accelerator the paged kernel skips the padding
queries too (`new_lens`, "Ragged batches in the kernel" in docs/results.md).
Batches ((new, cached) per request):
- agentic: one 1,024-token prompt with seven appends of 16 to 200 tokens over 512 to 2,048
  cached tokens (1,608 real tokens in 2,048 rows instead of 8 x 1,024);
- pair: requests of 300 and 100 new tokens (400 real tokens in 512 rows instead of 2 x 512);
- even: four requests of 256 (nothing to gain: it stays padded).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from absl import app, flags
from layerwise import Shapes, median_seconds

from dualpath_jax.model.cached_kv import LayerPages
from dualpath_jax.model.runner import ModelRunner, PrefillBatch, _layer_paged
from dualpath_jax.model.transformer import init_model

PAGE = 64
BATCHES = {
    "agentic": [
        (1024, 0),
        (64, 2048),
        (96, 1024),
        (32, 512),
        (128, 1536),
        (48, 768),
        (200, 1024),
        (16, 2048),
    ],  # fmt: skip
    "pair": [(300, 0), (100, 512)],
    "even": [(256, 512)] * 4,
}
TINY_BATCHES = {"agentic": [(40, 0), (3, 32), (5, 16), (2, 48)], "even": [(16, 16)] * 2}


def layer_cost(runner: ModelRunner, batch: PrefillBatch, pages: LayerPages) -> dict:
    """XLA's cost analysis of layer 0's compiled program for `batch` as `runner` lays it out:
    its floating-point operations and bytes accessed (the program, compiled, not run)."""
    put = runner.commit
    tokens, positions, packing = runner.inputs(batch, put)
    pages = pages.to_device()
    h = runner.embed(tokens)
    args = (runner.layer_gds[0], runner.layer_states[0], h, positions, put(pages.pages),
            put(pages.table), put(batch.cached_lens), put(batch.new_lens), packing)  # fmt: skip
    cost = _layer_paged.lower(*args).compile().cost_analysis()
    return {"flops": cost["flops"], "bytes": cost["bytes accessed"]}


def measure(shapes: Shapes, batches: dict, repeats: int = 3) -> dict:
    cfg = shapes.model()
    runner = ModelRunner(init_model(cfg, 0))
    rs = np.random.RandomState(0)
    out = {}
    for name, reqs in batches.items():
        prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n, _ in reqs]
        batch = PrefillBatch.build(cfg, prompts, [c for _, c in reqs])
        layers = [
            LayerPages.from_rows(
                [rs.randn(c, cfg.kv_width).astype(cfg.kv_dtype) for _, c in reqs],
                PAGE,
                cfg.kv_width,
                cfg.kv_dtype,
            )
            for _ in range(cfg.num_layers)
        ]
        packed = batch.packed(runner.min_bucket)

        def run(pack: bool):
            runner.pack = pack
            return runner.prefill_layerwise(batch, layers.__getitem__).last_logits

        t_padded = median_seconds(lambda: run(False), repeats)
        t_packed = median_seconds(lambda: run(True), repeats)
        cost = {}
        for pack in (False, True):
            runner.pack = pack
            cost["packed" if pack else "padded"] = layer_cost(runner, batch, layers[0])
        diff = float(np.abs(np.asarray(run(True)) - np.asarray(run(False))).max())
        out[name] = {
            "requests": reqs,
            "real_tokens": int(batch.new_lens.sum()),
            "padded_rows": batch.batch_size * batch.n_pad,
            "packed_rows": packed.length if packed is not None else None,
            "seconds": {"padded": t_padded, "packed": t_packed},
            "speedup": t_padded / t_packed,
            "layer_cost": cost,
            "max_logit_diff": diff,
        }
    runner.pack = True
    return {"shapes": dataclasses.asdict(shapes), "batches": out}


def main(argv):
    del argv
    shapes = Shapes(
        layers=_LAYERS.value,
        hidden=_HIDDEN.value,
        heads=_HEADS.value,
        kv_heads=_KV_HEADS.value,
        intermediate=_INTERMEDIATE.value,
    )
    r = measure(shapes, BATCHES, _REPEATS.value)
    if _JSON.value:
        print(json.dumps(r))
        return
    s = r["shapes"]
    print(f"{s['layers']} layers, hidden {s['hidden']}, MLP {s['intermediate']}")
    for name, b in r["batches"].items():
        t = b["seconds"]
        rows = b["packed_rows"] or "(stays padded)"
        print(
            f"{name:8s} {b['real_tokens']:5d} tokens: rows {b['padded_rows']} -> {rows};"
            f" padded {t['padded'] * 1e3:8.1f} ms, packed {t['packed'] * 1e3:8.1f} ms,"
            f" {b['speedup']:.2f}x; max |logit diff| {b['max_logit_diff']:.1e}"
        )
        c = b["layer_cost"]
        print(
            f"{'':8s} one layer's program: GFLOP {c['padded']['flops'] / 1e9:.1f} ->"
            f" {c['packed']['flops'] / 1e9:.1f}, GB accessed {c['padded']['bytes'] / 1e9:.2f} ->"
            f" {c['packed']['bytes'] / 1e9:.2f}"
        )


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    d = Shapes(layers=4)
    _LAYERS = flags.DEFINE_integer("layers", d.layers, "decoder layers")
    _HIDDEN = flags.DEFINE_integer("hidden", d.hidden, "hidden size")
    _HEADS = flags.DEFINE_integer("heads", d.heads, "query heads")
    _KV_HEADS = flags.DEFINE_integer("kv_heads", d.kv_heads, "KV heads")
    _INTERMEDIATE = flags.DEFINE_integer("intermediate", d.intermediate, "MLP width")
    _REPEATS = flags.DEFINE_integer("repeats", 3, "timed repetitions (median reported)")
    _JSON = flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
