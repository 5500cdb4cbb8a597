"""A decode step's wall time by active slots and steps per dispatch, on this host's device.

Run: python bench/decode_rows.py [--checkpoint=DIR] [--context=1800] [--json]

A `Decoder` of `--slots` slots of `--max_len` tokens (16-token pages) holds `--active` requests
of `--context` cached tokens each in its lowest slots; after two unmeasured dispatches (their
compiles), `--dispatches` dispatches run back to back and the figure is the wall time per
generated step (dispatch to tokens on the host). The context stays within one table-width
bucket (1,800 + 56 tokens < 2,048), so nothing compiles while it is timed. Side by side in one run, for each active count:
the step over every slot (what a decoder did before it ran over the first power-of-two slots
that hold the active ones: `Decoder._rows_for` forced to all slots), over those slots with the
whole gather of their pages (`paged_decode_reference`, what the step's attention did before
`paged_decode_chunked`; a runner of its own), over those slots, and `advance_many(--steps)`
(multi-step decode) over them. The model is `--checkpoint`'s (a Hugging
Face directory, as bench/peer_vllm.py writes one) or the tiny Qwen2 preset.
"""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np
from absl import app, flags

from dualpath_jax.kernels import paged_decode
from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.runner import ModelRunner

_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "A Hugging Face checkpoint (default: tiny).")
_SLOTS = flags.DEFINE_integer("slots", 8, "Decode slots.")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "Tokens per slot.")
_CONTEXT = flags.DEFINE_integer("context", 1800, "Cached tokens of each active request.")
_ACTIVE = flags.DEFINE_list("active", ["1", "4", "8"], "Active requests, one figure each.")
_STEPS = flags.DEFINE_integer("steps", 4, "Steps per dispatch of the multi-step figure.")
_DISPATCHES = flags.DEFINE_integer("dispatches", 12, "Dispatches measured per figure.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.")


def _runner() -> ModelRunner:
    if _CHECKPOINT.value:
        from dualpath_jax.model.checkpoint import from_pretrained

        return ModelRunner(from_pretrained(_CHECKPOINT.value))
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import TINY_QWEN2

    return ModelRunner(init_model(TINY_QWEN2, seed=0))


def step_ms(runner: ModelRunner, active: int, steps: int, every_slot: bool) -> float:
    cfg = runner.cfg
    dec = Decoder(runner, slots=_SLOTS.value, max_len=_MAX_LEN.value, page_size=16)
    if every_slot:
        dec._rows_for = lambda: dec.slots  # the decoder before row buckets
    n = _CONTEXT.value
    kv = np.zeros((cfg.num_layers, n, cfg.kv_width), np.float32)
    reserve = n + (_DISPATCHES.value + 2) * steps + 1
    for slot in range(active):
        dec.insert(slot, kv, n, 5, reserve)
    for _ in range(2):
        tokens, _ = dec.advance_many(steps)
        np.asarray(tokens)
    t0, done = time.perf_counter(), 0
    for _ in range(_DISPATCHES.value):
        tokens, k = dec.advance_many(steps)
        np.asarray(tokens)  # the host reads each dispatch's tokens, as the decode engine does
        done += k
    return (time.perf_counter() - t0) / done * 1e3


@contextlib.contextmanager
def whole_gather():
    """Traced within it, a decode step's attention gathers every page of its rows at once."""
    chunked = paged_decode.paged_decode_chunked

    def gather(*args, chunk_pages=None, **kw):  # noqa: ARG001
        return paged_decode.paged_decode_reference(*args, **kw)

    paged_decode.paged_decode_chunked = gather
    try:
        yield
    finally:
        paged_decode.paged_decode_chunked = chunked


def main(argv) -> None:
    del argv
    runner, gather_runner = _runner(), _runner()
    rows = []
    for a in map(int, _ACTIVE.value):
        with whole_gather():
            gather_ms = step_ms(gather_runner, a, 1, False)
        rows.append(
            {
                "active": a,
                "every_slot_ms": step_ms(runner, a, 1, True),
                "whole_gather_ms": gather_ms,
                "active_rows_ms": step_ms(runner, a, 1, False),
                f"multi_{_STEPS.value}_ms": step_ms(runner, a, _STEPS.value, False),
            }
        )
    if _JSON.value:
        print(json.dumps({"slots": _SLOTS.value, "context": _CONTEXT.value, "rows": rows}))
        return
    print(f"{_SLOTS.value} slots of {_MAX_LEN.value}, {_CONTEXT.value} cached tokens per request")
    heads = ["every slot", "whole gather", "active rows", f"{_STEPS.value} per dispatch"]
    print(f"{'active':>6} " + " ".join(f"{h:>15}" for h in heads))
    for r in rows:
        vals = list(r.values())[1:]
        print(f"{r['active']:>6} " + " ".join(f"{v:>12.2f} ms" for v in vals))


if __name__ == "__main__":
    app.run(main)
