"""Packed prefill: a batch's new tokens side by side, without the padding between them.

A `PrefillBatch` pads each request's new tokens to the longest, `[B, N_pad]`; a layer's
token-wise work (norms, projections, the MLP or the routed experts) then runs over `B * N_pad`
rows, most of them padding when one long request shares a batch with short ones. Packed, the
real tokens lie in one row of `T` (their sum, bucketed) for all of that, and only attention
sees the padded layout: each layer places its queries and new KV rows in `[B, N_pad, ...]`
(`Packing.pad`, zeros at the padding), attends, and takes the output back (`Packing.pack`). The
new KV rows a layer returns stay padded, as every consumer of them (the page writes, the rows a
prefill engine sends its decode engine) takes them.

A batch is packed when that at least halves the rows (`plan`): one request alone never is, and
each packed length is one more compiled shape per batch shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where a padded batch's tokens lie packed: `index` `[B, N_pad]` the packed position of
    request b's new token n (`T` for padding), `flat` `[T]` the padded position `b * N_pad + n`
    of packed token t (0 for the packed row's own padding at its end), `last` `[B]` the packed
    position of each request's last new token."""

    index: Array
    flat: Array
    last: Array

    def pad(self, x: Array) -> Array:
        """Packed `[1, T, ...]` -> padded `[B, N_pad, ...]`, zeros at the padding."""
        return jnp.take(x[0], self.index, axis=0, mode="fill", fill_value=0)

    def pack(self, y: Array) -> Array:
        """Padded `[B, N_pad, ...]` -> packed `[1, T, ...]`."""
        b, n = y.shape[:2]
        return y.reshape(b * n, *y.shape[2:])[self.flat][None]


jax.tree_util.register_dataclass(Packing, data_fields=["index", "flat", "last"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class PackedTokens:
    """A batch packed (host arrays): `tokens` and `positions` `[1, T]`, and its `Packing`'s
    `index`, `flat` and `last`."""

    tokens: np.ndarray
    positions: np.ndarray
    index: np.ndarray
    flat: np.ndarray
    last: np.ndarray

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


def plan(
    tokens: np.ndarray, new_lens: np.ndarray, cached_lens: np.ndarray, packed_len: int
) -> PackedTokens:
    """Padded `tokens` `[B, N_pad]` with `new_lens` real ones after `cached_lens` cached, packed
    into `packed_len` (>= their sum)."""
    b, n_pad = tokens.shape
    total = int(new_lens.sum())
    if packed_len < total:
        raise ValueError(f"{total} new tokens do not fit a packed row of {packed_len}")
    starts = np.concatenate([[0], np.cumsum(new_lens)[:-1]]).astype(np.int32)
    cols = np.arange(n_pad, dtype=np.int32)[None, :]
    real = cols < new_lens[:, None]
    index = np.where(real, starts[:, None] + cols, packed_len).astype(np.int32)
    flat = np.zeros(packed_len, np.int32)
    rows, ns = np.nonzero(real)
    flat[index[rows, ns]] = rows * n_pad + ns
    packed = np.zeros((1, packed_len), np.int32)
    packed[0, index[rows, ns]] = tokens[rows, ns]
    positions = np.zeros((1, packed_len), np.int32)
    positions[0, index[rows, ns]] = cached_lens[rows] + ns
    last = (starts + new_lens - 1).astype(np.int32)
    return PackedTokens(packed, positions, index, flat, last)
