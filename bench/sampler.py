"""The decode step's sampling tail at a real vocabulary: drawing the tokens and their
log-probabilities over `[slots, vocab]` logits, as `decode_programs.decode_step` runs it.

Run: python bench/sampler.py [--slots=64] [--vocab=151936] [--repeats=7] [--json]

Four batches: greedy, and temperature 0.8 with top-p 0.95, each over peaked logits (normal x 6:
the nucleus within the top 1,024 tokens, as a language model's usually is) and flat ones
(normal x 1: the nucleus is most of the vocabulary). Side by side, in the same run: the sampler
as it was before it skipped the random draw of all-greedy batches and looked for the nucleus
among the top tokens first (every batch draws one random number per vocabulary entry, the
nucleus is cut from the fully sorted row). The figure is the median wall time of the jitted
tail; both forms draw the same tokens (checked). `now_no_logprobs_ms`: the draw alone, what a
decode step runs when no slot asks for log-probabilities (it skips `chosen_logprobs`).
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dualpath_jax.model import sampler

FLAGS = flags.FLAGS


def _before(logits, seeds, positions, temperatures, top_ps):
    """The earlier `draw_rows`: a draw for every row, the nucleus from the sorted row."""
    sampled = temperatures > 0
    scaled = logits / jnp.where(sampled, temperatures, 1.0)[:, None]
    cut = (top_ps < 1.0) & sampled
    scaled = jax.lax.cond(
        jnp.any(cut), sampler._sorted_nucleus, lambda s, p: s, scaled, jnp.where(cut, top_ps, 1.0)
    )

    def one(row, seed, pos):
        return jax.random.categorical(jax.random.fold_in(jax.random.key(seed), pos), row)

    drawn = jax.vmap(one)(scaled, seeds, positions)
    tokens = jnp.where(sampled, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    return tokens, scaled


def _tail(draw, logprobs: bool = True):
    @jax.jit
    def run(logits, seeds, positions, temperatures, top_ps):
        tokens, processed = draw(logits, seeds, positions, temperatures, top_ps)
        if not logprobs:
            return (tokens,)
        return tokens, sampler.chosen_logprobs(logits, processed, tokens)

    return run


def _time(fn, args, repeats: int) -> tuple[float, np.ndarray]:
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.asarray(out[0])


def run(slots: int, vocab: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    base = rng.normal(size=(slots, vocab)).astype(np.float32)
    seeds = jnp.arange(slots, dtype=jnp.uint32)
    positions = jnp.arange(slots, dtype=jnp.int32) + 100
    modes = {
        "greedy": (jnp.zeros(slots, jnp.float32), jnp.ones(slots, jnp.float32)),
        "t0.8 top-p 0.95": (jnp.full(slots, 0.8, jnp.float32), jnp.full(slots, 0.95, jnp.float32)),
    }
    now, before = _tail(sampler.draw_rows), _tail(_before)
    bare = _tail(sampler.draw_rows, logprobs=False)
    rows = []
    for spread, name in ((6.0, "peaked"), (1.0, "flat")):
        logits = jnp.asarray(base * spread)
        for mode, (temps, top_ps) in modes.items():
            args = (logits, seeds, positions, temps, top_ps)
            t_before, tok_before = _time(before, args, repeats)
            t_now, tok_now = _time(now, args, repeats)
            t_bare, tok_bare = _time(bare, args, repeats)
            rows.append({
                "logits": name, "batch": mode, "before_ms": 1e3 * t_before,
                "now_ms": 1e3 * t_now, "speedup": t_before / t_now,
                "now_no_logprobs_ms": 1e3 * t_bare,
                "same_tokens": bool(np.array_equal(tok_before, tok_now))
                and bool(np.array_equal(tok_now, tok_bare)),
            })  # fmt: skip
    return rows


def main(argv):
    del argv
    rows = run(FLAGS.slots, FLAGS.vocab, FLAGS.repeats)
    if FLAGS.json:
        print(json.dumps({"slots": FLAGS.slots, "vocab": FLAGS.vocab, "rows": rows}))
        return
    print(f"sampling tail, {FLAGS.slots} slots x {FLAGS.vocab} vocabulary ({jax.devices()[0]})")
    print(
        f"{'logits':<8} {'batch':<16} {'before ms':>10} {'now ms':>8} {'speedup':>8}"
        f" {'no logprobs ms':>15} same"
    )
    for r in rows:
        print(
            f"{r['logits']:<8} {r['batch']:<16} {r['before_ms']:>10.1f} {r['now_ms']:>8.1f}"
            f" {r['speedup']:>7.2f}x {r['now_no_logprobs_ms']:>15.1f} {r['same_tokens']}"
        )


if __name__ == "__main__":
    flags.DEFINE_integer("slots", 64, "rows (decode slots)")
    flags.DEFINE_integer("vocab", 151936, "vocabulary size (Qwen2.5's by default)")
    flags.DEFINE_integer("repeats", 7, "timed runs per case (the median is reported)")
    flags.DEFINE_bool("json", False, "print one JSON object")
    app.run(main)
