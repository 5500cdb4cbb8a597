"""Dense attention: grouped-query attention over materialized keys and values.

The `reference` and `xla` attention backends (`model.layers.ATTENTION_IMPLS`) run this over a
layer's gathered pages (`paged_attention.paged_attention_reference`), and it is the oracle the
paged kernel is tested against. `attend_blocks` is the same per query, a block of queries at a
time, skipping the blocks of a ragged batch's padding queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def prefill_mask(cached_lens: Array, new_lens: Array, c_pad: int, n_pad: int) -> Array:
    """Attention mask `[B, N, C + N]`: new token j of request b sees its `cached_lens[b]` cached
    tokens and new tokens `0..j`. Padded query rows still see themselves (no NaN rows)."""
    del new_lens  # padded queries are discarded by the caller; causality bounds real ones
    s = jnp.arange(c_pad + n_pad)[None, None, :]
    j = jnp.arange(n_pad)[None, :, None]
    cached_ok = (s < c_pad) & (s < cached_lens[:, None, None])
    new_ok = (s >= c_pad) & (s - c_pad <= j)
    return cached_ok | new_ok


def attend(
    q: Array, k: Array, v: Array, mask: Array, scale: float, impl: str = "reference"
) -> Array:
    """Grouped-query attention over materialized keys and values (the dense backends).

    q `[B, N, Hq, dk]`, k `[B, S, Hk, dk]`, v `[B, S, Hk, dv]`, mask `[B, N, S]` -> `[B, N, Hq, dv]`.
    `impl`: `reference` (float32 scores and softmax under the boolean mask) or `xla`
    (`jax.nn.dot_product_attention`, which picks cuDNN's fused kernel where it can; `dv` may
    differ from `dk`: the values are zero-padded to `dk` and the output sliced).
    """
    if impl == "xla":
        dv = v.shape[-1]
        if dv != k.shape[-1]:
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, k.shape[-1] - dv)))
        out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale)
        return out[..., :dv].astype(q.dtype)
    b, n, hq, dk = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, n, hk, hq // hk, dk)
    scores = jnp.einsum("bnkgd,bskd->bkgns", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgns,bskd->bnkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, n, hq, v.shape[-1]).astype(q.dtype)


QUERY_BLOCK = 128  # queries per step of `attend_blocks`


def attend_blocks(
    q: Array,
    k: Array,
    v: Array,
    cached_lens: Array,
    c_pad: int,
    new_lens: Array,
    scale: float,
    block: int = QUERY_BLOCK,
) -> Array:
    """`attend` (`reference`) with `prefill_mask(cached_lens, c_pad)`, `block` queries at a
    time: one step per (request, block of its queries) that holds a real one (before
    `new_lens`), the others left zero. Each query's scores and softmax are `attend`'s; what
    it saves is the padding queries' work and the `[N, S]` scores of a whole request at once
    (one block's at a time). `N` must be a multiple of `block`."""
    b, n, hq, _ = q.shape
    nb = n // block
    dv = v.shape[-1]

    def step(x):
        r, i = x // nb, x % nb
        start = i * block

        def run():
            qb = jax.lax.dynamic_slice_in_dim(q[r], start, block)[None]
            s = jnp.arange(c_pad + n)[None, :]
            j = start + jnp.arange(block)[:, None]
            mask = ((s < c_pad) & (s < cached_lens[r])) | ((s >= c_pad) & (s - c_pad <= j))
            return attend(qb, k[r][None], v[r][None], mask[None], scale)[0]

        return jax.lax.cond(start < new_lens[r], run, lambda: jnp.zeros((block, hq, dv), q.dtype))

    out = jax.lax.map(step, jnp.arange(b * nb))
    return out.reshape(b, n, hq, dv)
