"""Host time of one decode step's dispatch, for a 28-layer tiny model.

Run: python bench/decode_dispatch.py [--layers=28] [--steps=200] [--json]

A `Decoder` over 8 active slots is warmed (`warmup()`), then `advance()` is called `--steps`
times back to back; the figure is the median host time of the call, i.e. what the host spends
to hand one step to the device (the device runs steps asynchronously; the host reads each
step's tokens later). The step wall time (dispatch until the tokens are ready) is printed too,
and the dispatch split into the compiled step's launch (the jitted call alone, timed the same
way) and the decoder's own Python (the rest: `_prepare`, bookkeeping). On XLA:CPU the launch
competes for the host's cores with the device threads that start running the step, so there
it grows with the step's compute.
Side by side, in the same run: the same step with every layer in a run of its own (one scan
per layer, 28 times as many parameter leaves), which is what the dispatch cost of an unrolled
layer loop grows like.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from dualpath_jax.model import decode_programs
from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2


def _per_layer(runner: ModelRunner):
    """The runner with one run per layer (so the step's pytree holds every layer separately)."""
    runs = tuple((gd, i, 1) for i, gd in enumerate(runner.layer_gds))
    stacked = tuple(jax.tree.map(lambda x: x[None], s) for s in runner.layer_states)
    leaves, treedef = jax.tree.flatten((runner.embed_state, stacked, runner.head_state))
    fn = jax.jit(
        functools.partial(
            decode_programs.decode_leaves, runner.embed_gd, runs, runner.head_gd, treedef
        ),
        donate_argnums=(1,),
    )
    return fn, leaves


def measure(layers: int, steps: int, slots: int = 8) -> dict[str, float]:
    cfg = dataclasses.replace(TINY_QWEN2, num_layers=layers)
    runner = ModelRunner(init_model(cfg, 0))
    dec = Decoder(runner, slots, 4 * steps + 64)
    dec.warmup()
    kv = np.zeros((layers, 16, cfg.kv_width), np.float32)
    for s in range(slots):
        dec.insert(s, kv, 16, 1, 16 + 3 * steps + 8)  # three timed loops of `steps`
    jax.block_until_ready(dec.advance())

    def timed(call):
        host, wall = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = call()
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            host.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
        return statistics.median(host) * 1e3, statistics.median(wall) * 1e3

    scan_ms, scan_wall = timed(dec.advance)
    d = dec._dev  # the decoder's device state, as its own step passes it

    def calling(fn, params):
        """A call of a compiled step `fn` on the decoder's state, as `advance` calls its own."""

        def call():
            logits, dec._pending, dec.logprobs, dec.pages, lengths = fn(
                params, dec.pages, d["table"], d["lengths"], dec._pending, d["active"],
                d["seeds"], d["temps"], d["top_ps"], d["stop_ids"], d["held_until"], d["wants_logprobs"],
            )  # fmt: skip
            d["lengths"] = lengths
            return dec._pending

        return call

    launch_ms, _ = timed(calling(decode_programs.step_fn(runner), runner.stacked_leaves[1]))
    per_layer = calling(*_per_layer(runner))
    jax.block_until_ready(per_layer())
    layer_ms, layer_wall = timed(per_layer)
    return {
        "layers": layers,
        "slots": slots,
        "dispatch_ms": scan_ms,
        "launch_ms": launch_ms,
        "host_ms": scan_ms - launch_ms,
        "step_ms": scan_wall,
        "per_layer_dispatch_ms": layer_ms,
        "per_layer_step_ms": layer_wall,
    }


def main(argv):
    del argv
    r = measure(_LAYERS.value, _STEPS.value)
    if _JSON.value:
        print(json.dumps(r))
        return
    print(f"device: {jax.devices()[0]}  {r['layers']} layers, {r['slots']} slots")
    print(f"scan over layers : dispatch {r['dispatch_ms']:.3f} ms, step {r['step_ms']:.2f} ms")
    print(
        f"  of which the compiled step's launch {r['launch_ms']:.3f} ms,"
        f" the decoder's own Python {r['host_ms']:.3f} ms"
    )
    print(
        f"one run per layer: dispatch {r['per_layer_dispatch_ms']:.3f} ms,"
        f" step {r['per_layer_step_ms']:.2f} ms"
    )


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    _LAYERS = flags.DEFINE_integer("layers", 28, "decoder layers of the tiny Qwen2 model")
    _STEPS = flags.DEFINE_integer("steps", 200, "steps measured")
    _JSON = flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
