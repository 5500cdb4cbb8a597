"""`make demo` (foundation stage): multi-turn agent trajectories on the tiny models, served twice.

1. Monolithic: every turn recomputes its whole prompt (no stored KV) and decodes.
2. Layerwise: every turn's cached prefix KV comes from host memory (as if read from the store),
   one layer at a time just before that layer runs, and only the new tokens are computed.

Prints the generated tokens of both, whether they agree, and timings.
"""

from __future__ import annotations

import time

import numpy as np

from dualpath_jax.model.decode import Decoder, generate, sample
from dualpath_jax.model.presets import TINY_DEEPSEEK, TINY_QWEN2
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.model.transformer import init_model


def replay_monolithic(runner: ModelRunner, rounds: list[tuple[list[int], int]]) -> list[list[int]]:
    context: list[int] = []
    outputs = []
    for append, gen in rounds:
        context += append
        out = generate(runner, [context], gen)[0]
        outputs.append(out)
        context += out
    return outputs


def replay_layerwise(runner: ModelRunner, rounds: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each round: layerwise prefill of the tokens without KV yet, from host-fed cached KV."""
    cfg = runner.cfg
    host_kv = np.zeros((cfg.num_layers, 0, cfg.kv_width), np.dtype(cfg.kv_dtype))  # [L, T, W]
    context: list[int] = []
    outputs = []
    for append, gen in rounds:
        context += append
        cached = host_kv.shape[1]
        new_tokens = context[cached:]
        batch = PrefillBatch.build(cfg, [new_tokens], [cached])
        padded = np.zeros((cfg.num_layers, 1, batch.c_pad, cfg.kv_width), host_kv.dtype)
        padded[:, 0, :cached] = host_kv
        new: dict[int, np.ndarray] = {}
        res = runner.prefill_layerwise(
            batch, lambda i: padded[i], lambda i, rows: new.__setitem__(i, np.asarray(rows[0]))
        )
        prompt_kv = np.concatenate(
            [host_kv, np.stack([new[i][: len(new_tokens)] for i in range(cfg.num_layers)])], axis=1
        )
        dec = Decoder(runner, slots=1, max_len=len(context) + gen + 1)
        tok = int(np.asarray(sample(res.last_logits))[0])
        dec.insert(0, prompt_kv, len(context), tok)
        out = [tok]
        for _ in range(gen - 1):
            tok = int(np.asarray(sample(dec.step()))[0])
            out.append(tok)
            dec.set_next(np.array([tok]))
        # Every token but the last generated one has been fed, so its KV exists.
        host_kv = np.asarray(dec.kv[:, 0, : len(context) + gen - 1])
        context += out
        outputs.append(out)
    return outputs


def main() -> None:
    rs = np.random.RandomState(0)
    ok = True
    for cfg in (TINY_QWEN2, TINY_DEEPSEEK):
        runner = ModelRunner(init_model(cfg, seed=0))
        rounds = [(rs.randint(0, cfg.vocab_size, a).tolist(), g) for a, g in ((300, 8), (40, 6), (90, 12))]
        timings = {}
        outs = {}
        for name, fn in (("monolithic", replay_monolithic), ("layerwise", replay_layerwise)):
            fn(runner, rounds)  # compile
            t = time.perf_counter()
            outs[name] = fn(runner, rounds)
            timings[name] = time.perf_counter() - t
        same = outs["monolithic"] == outs["layerwise"]
        ok &= same
        print(f"\n{cfg.name}: {len(rounds)} rounds, appends {[len(a) for a, _ in rounds]}, gens {[g for _, g in rounds]}")
        for name in outs:
            print(f"  {name:<10} {timings[name] * 1e3:8.1f} ms  tokens {outs[name]}")
        print(f"  tokens agree: {same}")
    print("\nall tokens agree" if ok else "\nMISMATCH between monolithic and layerwise tokens")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
