"""Drawing tokens from logits: `sample` (a batch with one key), `sample_at` (each row keyed by its
sampling params and position: what the engines use) and `greedy_tokens`; `sample_rows` is
`sample_at` inside a traced program (the decode step's), `mask_held` its `min_tokens` masking.

Log-probabilities (`SamplingParams.logprobs`): `draw_rows` returns the drawn tokens with the
logits they were drawn from, `chosen_logprobs` the drawn tokens' log-probabilities under those and
under the model, `top_logprobs` the model's most likely tokens; `sample_at(..., logprobs=True)`
is all of it on the host's side (the prefill engine's first token, the in-process engine), from
the same functions as the decode step's, so every engine reports the same numbers.

How a round samples is a `SamplingParams` (sampling.py, which imports no JAX).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dualpath_jax.model.sampling_params import GREEDY, MAX_TOP_LOGPROBS, SamplingParams
from dualpath_jax.results import Logprobs

Array = jax.Array


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
    """logits `[B, V]` -> token ids `[B]`, every row drawn with `params` from one explicit PRNG
    `key` (needed unless greedy; `params.seed` is what `sample_at` keys by instead)."""
    if params.temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    if key is None:
        key = jax.random.key(0)
    return _sample(logits, key, float(params.temperature), float(params.top_p))


@jax.jit
def _sample_at(
    logits: Array, seeds: Array, positions: Array, temperatures: Array, top_ps: Array
) -> Array:
    return sample_rows(logits, seeds, positions, temperatures, top_ps)


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
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    held: Sequence[Sequence[int]] | None = None,
    *,
    logprobs: bool = False,
):
    """Per-row sampling keyed by position: logits `[B, V]` -> token ids `[B]` (numpy int32).

    Row b is greedy when `params[b].temperature == 0`, else drawn from softmax(logits / t) with
    the key `fold_in(key(params[b].seed), positions[b])`, where `positions[b]` is the absolute
    position of the token being drawn. The same (params, position, logits) gives the same token
    wherever it is computed (prefill or decode engine, in any batch, after any retry), which
    keeps sampled rollouts reproducible. `params[b].top_p < 1` draws from the smallest set of
    most likely tokens whose probability reaches it (nucleus sampling). All-greedy batches take
    `greedy_tokens`. `held[b]`: tokens row b may not draw (`sampling.held_back`: a round's stop
    tokens before its `min_tokens`), masked before anything else; rows with none are untouched.

    `logprobs=True` returns `(tokens, entries)`: `entries[b]` is row b's token's `Logprobs` (one
    entry) when `params[b].logprobs` asks for them, else None.
    """
    raw = logits
    if held is not None and any(len(h) for h in held):
        logits = np.array(logits)  # a copy in its dtype: the caller's logits stay
        for b, ids in enumerate(held):
            logits[b, np.asarray(ids, np.int64)] = -np.inf
    if logprobs and any(p.logprobs is not None for p in params):
        return _sample_logprobs(raw, logits, params, positions)
    if logprobs:
        return sample_at(logits, params, positions), [None] * len(params)
    if all(p.greedy for p in params):
        return greedy_tokens(logits)
    out = _sample_at(
        jnp.asarray(logits),
        jnp.asarray(np.array([p.seed for p in params], np.uint32)),
        jnp.asarray(np.asarray(positions, np.int32)),
        jnp.asarray(np.array([p.temperature for p in params], np.float32)),
        jnp.asarray(np.array([p.top_p for p in params], np.float32)),
    )
    return np.asarray(out)


@jax.jit
def _draw_logprobs(raw, drawable, seeds, positions, temperatures, top_ps):
    tokens, processed = draw_rows(drawable, seeds, positions, temperatures, top_ps)
    return tokens, chosen_logprobs(raw, processed, tokens)


def _sample_logprobs(raw, drawable, params, positions):
    """`sample_at(..., logprobs=True)` for a batch where some row asks for logprobs."""
    tokens, chosen = _draw_logprobs(
        jnp.asarray(raw),
        jnp.asarray(drawable),
        jnp.asarray(np.array([p.seed for p in params], np.uint32)),
        jnp.asarray(np.asarray(positions, np.int32)),
        jnp.asarray(np.array([p.temperature for p in params], np.float32)),
        jnp.asarray(np.array([p.top_p for p in params], np.float32)),
    )
    top = None
    if any(p.top_logprobs for p in params):
        top = tuple(np.asarray(a) for a in top_logprobs(jnp.asarray(raw)))
    chosen = np.asarray(chosen)
    return np.asarray(tokens), [
        row_logprobs(p, chosen, top, b) if p.logprobs is not None else None
        for b, p in enumerate(params)
    ]


def row_logprobs(
    params: SamplingParams,
    chosen: np.ndarray,
    top: tuple[np.ndarray, np.ndarray] | None,
    row: int,
) -> Logprobs:
    """Row `row`'s token's entry from `chosen_logprobs` `[B, 2]` and `top_logprobs` (ids, values)
    `[B, MAX_TOP_LOGPROBS]` read on the host, keeping the alternatives `params` asks for."""
    out = Logprobs()
    k = params.top_logprobs
    if k and top is not None:
        out.append(chosen[row, 0], chosen[row, 1], top[0][row, :k], top[1][row, :k])
    else:
        out.append(chosen[row, 0], chosen[row, 1])
    return out


def chosen_logprobs(logits: Array, processed: Array, tokens: Array) -> Array:
    """`[S, 2]` f32: each row's `tokens` log-probability under `processed` (the logits it was
    drawn from, `draw_rows`) and under `logits` (the model's)."""
    idx = tokens[:, None].astype(jnp.int32)
    drawn = jnp.take_along_axis(jax.nn.log_softmax(processed.astype(jnp.float32)), idx, axis=-1)
    model = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), idx, axis=-1)
    return jnp.concatenate([drawn, model], axis=-1)


@jax.jit
def top_logprobs(logits: Array) -> tuple[Array, Array]:
    """The `MAX_TOP_LOGPROBS` most likely tokens of each row under the model: (ids `[S, K]`
    int32, their log-probabilities `[S, K]` f32), most likely first (ties: the lower id)."""
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), k)
    return ids.astype(jnp.int32), values


# The top-p nucleus is looked for among each row's most likely tokens first (`lax.top_k`): a
# full sort of a 152K vocabulary costs some 30 ms per row on a CPU, the top 1,024 under 1 ms.
NUCLEUS_TOP_K = 1024


def _nucleus(scaled: Array, top_ps: Array) -> Array:
    """Logits `[B, V]` with every token outside each row's top-p nucleus at -inf: the smallest
    set of most likely tokens whose probability reaches `top_ps[b]` (rows at 1 are unchanged).
    Exact: the nucleus is cut from each row's `NUCLEUS_TOP_K` most likely tokens when every
    row's lies among them (the mass ranked above the last of them reaches its `top_p`), and
    from the whole sorted row otherwise."""
    if scaled.shape[-1] <= NUCLEUS_TOP_K:
        return _sorted_nucleus(scaled, top_ps)
    top = jax.lax.top_k(scaled, NUCLEUS_TOP_K)[0]  # most likely first
    # (the row's own max, not `top`'s first: reading `top` twice makes XLA:CPU sort the row)
    m = jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    probs = jnp.exp(top - m) / jnp.sum(jnp.exp(scaled - m), axis=-1, keepdims=True)
    before = jnp.cumsum(probs, axis=-1) - probs
    fits = jnp.all((before[:, -1] >= top_ps) | (top_ps >= 1.0))
    return jax.lax.cond(
        fits,
        lambda: _cut(scaled, top, before, top_ps),
        lambda: _sorted_nucleus(scaled, top_ps),
    )


def _sorted_nucleus(scaled: Array, top_ps: Array) -> Array:
    ordered = -jnp.sort(-scaled, axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    return _cut(scaled, ordered, jnp.cumsum(probs, axis=-1) - probs, top_ps)


def _cut(scaled: Array, ordered: Array, before: Array, top_ps: Array) -> Array:
    """`scaled` cut below each row's nucleus, given its most likely logits in order `ordered`
    and `before`, the probability mass ranked above each of them."""
    last = jnp.sum(before < top_ps[:, None], axis=-1) - 1
    cutoff = jnp.take_along_axis(ordered, last[:, None], axis=-1)
    keep = (scaled >= cutoff) | (top_ps[:, None] >= 1.0)
    return jnp.where(keep, scaled, -jnp.inf)


def draw_step(logits, stop_ids, held_until, positions, seeds, temps, top_ps, wants):
    """A decode step's draw over the model's logits `[S, V]`: each row's token at `positions`
    (its stop tokens held back, `mask_held`; `draw_rows`) and the token's log-probabilities
    `[S, 2]` (`chosen_logprobs`: two f32 log-softmaxes over the vocabulary) when some row
    `wants` them, zeros otherwise."""
    drawable = mask_held(logits, stop_ids, held_until, positions)
    tokens, processed = draw_rows(drawable, seeds, positions, temps, top_ps)
    chosen = jax.lax.cond(
        jnp.any(wants),
        lambda: chosen_logprobs(logits, processed, tokens),
        lambda: jnp.zeros((tokens.shape[0], 2), jnp.float32),
    )
    return tokens, chosen


def mask_held(logits: Array, stop_ids: Array, held_until: Array, positions: Array) -> Array:
    """`sample_at`'s `held` in a traced program: logits `[S, V]` with each row's stop tokens
    (`stop_ids` `[S, K]`, -1 pads) at -inf where the token drawn at `positions` lies before
    `held_until` (the round's prompt length plus its `min_tokens`). The scatter runs only when
    some row holds; otherwise the logits pass unchanged."""
    hold = positions < held_until

    def mask(logits: Array) -> Array:
        rows, vocab = logits.shape
        ids = jnp.where((stop_ids >= 0) & hold[:, None], stop_ids, vocab)  # vocab: dropped
        banned = (
            jnp.zeros((rows, vocab), bool).at[jnp.arange(rows)[:, None], ids].set(True, mode="drop")
        )
        return jnp.where(banned, -jnp.inf, logits)

    return jax.lax.cond(jnp.any(hold), mask, lambda x: x, logits)


def sample_rows(logits, seeds, positions, temperatures, top_ps):
    """`sample_at` in a traced program: greedy rows where the temperature is 0. The nucleus
    sort runs only when some row has top-p below 1."""
    return draw_rows(logits, seeds, positions, temperatures, top_ps)[0]


def draw_rows(logits, seeds, positions, temperatures, top_ps):
    """`sample_rows`, returning (tokens `[S]`, the logits each row was drawn from `[S, V]`: scaled
    by its temperature and cut to its top-p nucleus; a greedy row's are its logits)."""
    sampled = temperatures > 0
    scaled = logits / jnp.where(sampled, temperatures, 1.0)[:, None]
    cut = (top_ps < 1.0) & sampled
    scaled = jax.lax.cond(
        jnp.any(cut), _nucleus, lambda s, p: s, scaled, jnp.where(cut, top_ps, 1.0)
    )

    def one(row, seed, pos):
        key = jax.random.fold_in(jax.random.key(seed), pos)
        return jax.random.categorical(key, row)

    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # A batch of greedy rows draws no random numbers (a row's draw costs one per vocabulary entry)
    drawn = jax.lax.cond(
        jnp.any(sampled),
        lambda: jax.vmap(one)(scaled, seeds, positions).astype(jnp.int32),
        lambda: greedy,
    )
    return jnp.where(sampled, drawn, greedy), scaled
