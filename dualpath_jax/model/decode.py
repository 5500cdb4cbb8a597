"""Batched decode over a per-slot KV cache, sampling, and `generate` (the test oracle).

Lifecycle of a decode slot: `insert(slot, prompt_kv, next_token)` puts a prompt's KV rows
`[L, T, W]` into the slot; each `step()` feeds every active slot's pending token, appends its KV
row and returns logits; the caller samples the next pending token with `set_next`; `free(slot)`
releases the slot. KV is one device array `[L, S, T_max, W]` updated in place (donated).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dualpath_jax.model.layers import prefill_mask
from dualpath_jax.model.runner import (
    ModelRunner,
    PrefillBatch,
    bucket_len,
    validate_context,
    validate_tokens,
)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to top_p."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling params {self}")


GREEDY = SamplingParams()


@functools.partial(jax.jit, static_argnums=(2, 3))
def _sample(logits: Array, key: Array, temperature: float, top_p: float) -> Array:
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / temperature
    if top_p < 1.0:
        sorted_l = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_l, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # Smallest prefix whose mass reaches top_p; its last logit is the cut-off.
        cut_idx = jnp.sum(cum - probs < top_p, axis=-1) - 1
        cutoff = jnp.take_along_axis(sorted_l, cut_idx[:, None], axis=-1)
        scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def sample(logits: Array, params: SamplingParams = GREEDY, key: Array | None = None) -> Array:
    """logits `[B, V]` -> token ids `[B]`. Non-greedy sampling needs an explicit PRNG key."""
    if params.temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    if key is None:
        key = jax.random.key(0)
    return _sample(logits, key, float(params.temperature), float(params.top_p))


@jax.jit
def _sample_at(logits: Array, seeds: Array, positions: Array, temperatures: Array) -> Array:
    def one(row, seed, pos, t):
        key = jax.random.fold_in(jax.random.key(seed), pos)
        drawn = jax.random.categorical(key, row / jnp.where(t > 0, t, 1.0))
        return jnp.where(t > 0, drawn, jnp.argmax(row)).astype(jnp.int32)

    return jax.vmap(one)(logits, seeds, positions, temperatures)


@jax.jit
def _greedy(logits: Array) -> Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def greedy_tokens(logits: Array | np.ndarray) -> np.ndarray:
    """Greedy token ids `[B]` (numpy int32) of logits `[B, V]`: the argmax on the device that
    holds them, so an accelerator copies `B` ids to the host instead of `[B, V]` float32 logits;
    on the host (numpy logits, or arrays on a CPU device) in numpy, without a device call. Ties
    go to the lowest id either way."""
    if isinstance(logits, jax.Array) and any(d.platform != "cpu" for d in logits.devices()):
        return np.asarray(_greedy(logits))
    return np.asarray(logits).argmax(-1).astype(np.int32)


def sample_at(
    logits: Array | np.ndarray,
    seeds: Sequence[int],
    positions: Sequence[int],
    temperatures: Sequence[float],
) -> np.ndarray:
    """Per-row sampling keyed by position: logits `[B, V]` -> token ids `[B]` (numpy int32).

    Row b is greedy when `temperatures[b] == 0`, else drawn from softmax(logits / t) with the key
    `fold_in(key(seeds[b]), positions[b])`, where `positions[b]` is the absolute position of the
    token being drawn. The same (seed, position, logits) gives the same token wherever it is
    computed (prefill or decode engine, in any batch, after any retry), which keeps sampled
    rollouts reproducible. All-greedy batches take `greedy_tokens`.
    """
    temps = np.asarray(temperatures, np.float32)
    if not (temps > 0).any():
        return greedy_tokens(logits)
    out = _sample_at(
        jnp.asarray(logits),
        jnp.asarray(np.asarray(seeds, np.uint32)),
        jnp.asarray(np.asarray(positions, np.int32)),
        jnp.asarray(temps),
    )
    return np.asarray(out)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 8), donate_argnums=(4,))
def _decode_step(embed_gd, layer_gds, head_gd, params, kv, lengths, tokens, active, bucket):
    """One token for every slot. kv `[L, S, T_max, W]`, lengths/tokens/active `[S]`."""
    embed_state, layer_states, head_state = params
    embed = nnx.merge(embed_gd, embed_state)
    s = tokens.shape[0]
    h = embed(tokens[:, None])
    positions = lengths[:, None]
    mask = prefill_mask(lengths, None, bucket, 1)
    slots = jnp.arange(s)
    for i, gd in enumerate(layer_gds):
        cached = jax.lax.dynamic_slice_in_dim(kv[i], 0, bucket, axis=1)
        h, rows = nnx.merge(gd, layer_states[i])(h, positions, cached, mask)
        old = kv[i, slots, lengths]
        kv = kv.at[i, slots, lengths].set(jnp.where(active[:, None], rows[:, 0], old))
    logits = nnx.merge(head_gd, head_state)(h[:, 0], embed.embedding[...])
    return logits, kv, lengths + active.astype(lengths.dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def _insert(kv, slot, rows):
    """kv `[L, S, T_max, W]` <- rows `[L, T_b, W]` at slot, positions 0..T_b-1."""
    return jax.lax.dynamic_update_slice(kv, rows[:, None].astype(kv.dtype), (0, slot, 0, 0))


class Decoder:
    """Continuous batched decode over `slots` slots of up to `max_len` tokens each."""

    def __init__(self, runner: ModelRunner, slots: int, max_len: int, min_bucket: int = 64):
        cfg = runner.cfg
        if max_len > cfg.max_seq_len:
            raise ValueError(
                f"decode max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}"
            )
        self.runner, self.slots, self.max_len, self.min_bucket = runner, slots, max_len, min_bucket
        self.kv = jnp.zeros((cfg.num_layers, slots, max_len, cfg.kv_width), cfg.kv_dtype)
        self.lengths = np.zeros((slots,), np.int32)
        self.active = np.zeros((slots,), bool)
        self.pending = np.zeros((slots,), np.int32)

    def free_slots(self) -> list[int]:
        return [i for i in range(self.slots) if not self.active[i]]

    def insert(
        self, slot: int, prompt_kv: np.ndarray | Array, length: int, next_token: int
    ) -> None:
        """Loads a prompt's KV rows `[L, >= length, W]` into `slot`; `next_token` is fed next."""
        cfg = self.runner.cfg
        if self.active[slot]:
            raise ValueError(f"decode slot {slot} is in use")
        if length + 1 > self.max_len:
            raise ValueError(
                f"prompt of {length} tokens does not fit a decode slot of {self.max_len}"
            )
        if prompt_kv.shape[0] != cfg.num_layers or prompt_kv.shape[2] != cfg.kv_width:
            raise ValueError(
                f"prompt KV has shape {tuple(prompt_kv.shape)}, expected ({cfg.num_layers}, T, {cfg.kv_width})"
            )
        validate_tokens(cfg, np.array([next_token]), "next token")
        tb = min(bucket_len(length, self.min_bucket), self.max_len)
        rows = (
            np.zeros((cfg.num_layers, tb, cfg.kv_width), np.dtype(cfg.kv_dtype))
            if length < tb
            else None
        )
        src = np.asarray(prompt_kv[:, :length]) if rows is not None else prompt_kv[:, :tb]
        if rows is not None:
            rows[:, :length] = src
            src = rows
        self.kv = _insert(self.kv, jnp.int32(slot), jnp.asarray(src))
        self.lengths[slot] = length
        self.pending[slot] = next_token
        self.active[slot] = True

    def free(self, slot: int) -> None:
        self.active[slot] = False
        self.lengths[slot] = 0

    def set_next(self, tokens: np.ndarray) -> None:
        """Sets the pending token of every active slot (`tokens` `[S]`)."""
        self.pending = np.where(self.active, np.asarray(tokens, np.int32), self.pending)

    def step(self) -> Array:
        """Feeds each active slot's pending token; returns logits `[S, V]` (rows of idle slots are
        meaningless). Each active slot's length grows by one."""
        if not self.active.any():
            raise ValueError("decode step with no active slot")
        need = int(self.lengths[self.active].max())
        if need + 1 > self.max_len:
            raise ValueError(f"a decode slot reached its max_len {self.max_len}")
        bucket = min(bucket_len(max(need, 1), self.min_bucket), self.max_len)
        r = self.runner
        logits, self.kv, lengths = _decode_step(
            r.embed_gd,
            r.layer_gds,
            r.head_gd,
            r.params,
            self.kv,
            jnp.asarray(self.lengths),
            jnp.asarray(self.pending),
            jnp.asarray(self.active),
            bucket,
        )
        self.lengths = np.array(lengths)
        return logits


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
