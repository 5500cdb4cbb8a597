"""Generation without a cluster: `generate` (monolithic prefill, then batched decode on a
`Decoder`) and the test oracles `reference_generate` / `reference_rounds` (no KV cache at all)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dualpath_jax.model.batch import PrefillBatch, bucket_len, validate_context
from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.sampler import sample
from dualpath_jax.model.sampling_params import GREEDY, SamplingParams

Array = jax.Array


# One ModelRunner per model passed to `generate` (its compiled functions are reused).
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def as_runner(model) -> ModelRunner:
    """`model` itself if it is a ModelRunner, else the (cached) ModelRunner of a Transformer."""
    if isinstance(model, ModelRunner):
        return model
    runner = _RUNNERS.get(model)
    if runner is None:
        runner = _RUNNERS[model] = ModelRunner(model)
    return runner


def generate(
    model,
    prompts: Sequence[Sequence[int]] | Sequence[int],
    max_new_tokens: int,
    *,
    sampling: SamplingParams = GREEDY,
    key: Array | None = None,
    eos_id: int | None = None,
) -> list[list[int]] | list[int]:
    """Monolithic prefill then batched decode. Generates exactly `max_new_tokens` tokens per
    prompt unless `eos_id` is given (then a sequence stops after emitting it).

    `model`: a `Transformer` (or its `ModelRunner`). `prompts`: a batch of token-id lists, or a
    single prompt as a flat list, which returns a flat list."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    single = len(prompts) > 0 and isinstance(prompts[0], int | np.integer)
    if single:
        return generate(
            model, [prompts], max_new_tokens, sampling=sampling, key=key, eos_id=eos_id
        )[0]
    runner = as_runner(model)
    cfg = runner.cfg
    for p in prompts:
        validate_context(cfg, len(p) + max_new_tokens)
    batch = PrefillBatch.build(cfg, prompts, [0] * len(prompts), runner.min_bucket)
    result, new_kv = runner.prefill_monolithic(batch)
    keys = iter(jax.random.split(key, max_new_tokens)) if key is not None else None
    first = np.asarray(sample(result.last_logits, sampling, next(keys) if keys else None))
    max_len = bucket_len(max(len(p) for p in prompts) + max_new_tokens, 64)
    dec = Decoder(runner, len(prompts), min(max_len, cfg.max_seq_len))
    new_kv = np.asarray(new_kv)  # [L, B, N_pad, W]
    for b, p in enumerate(prompts):
        dec.insert(b, new_kv[:, b], len(p), int(first[b]))
    out = [[int(first[b])] for b in range(len(prompts))]
    done = np.array([eos_id is not None and o[-1] == eos_id for o in out])
    for _ in range(max_new_tokens - 1):
        if done.all():
            break
        logits = dec.step()
        nxt = np.asarray(sample(logits, sampling, next(keys) if keys else None))
        for b in range(len(prompts)):
            if not done[b]:
                out[b].append(int(nxt[b]))
                done[b] = eos_id is not None and nxt[b] == eos_id
        dec.set_next(nxt)
    return out


def reference_generate(
    runner: ModelRunner, prompt: Sequence[int], max_new_tokens: int
) -> list[int]:
    """Greedy generation with no KV cache at all: a full monolithic forward over the whole
    sequence for every token. Slow; the oracle the cached paths are tested against."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        batch = PrefillBatch.build(runner.cfg, [seq], [0], runner.min_bucket)
        result, _ = runner.prefill_monolithic(batch)
        seq.append(int(jnp.argmax(result.last_logits[0])))
    return seq[len(prompt) :]


def reference_rounds(model, rounds: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
    """The reference greedy tokens of every round of one trajectory `[(append, gen), ...]`:
    round i generates on the full context (every earlier append and generated token), as the
    cluster's sessions do. The oracle of the cluster tests and benchmarks."""
    runner = as_runner(model)
    ctx: list[int] = []
    out = []
    for append, gen in rounds:
        ctx += list(append)
        out.append(reference_generate(runner, ctx, gen))
        ctx += out[-1]
    return out
