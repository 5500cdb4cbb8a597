"""A prefill batch: requests' new tokens padded to one length (`PrefillBatch`), the length and
batch-size buckets every compiled shape is padded to, and the checks a batch's tokens pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from dualpath_jax.config import ModelConfig
from dualpath_jax.model.cached_kv import pow2
from dualpath_jax.model.packing import PackedTokens, plan

Array = jax.Array


def bucket_len(n: int, minimum: int = 16, step: int = 1024) -> int:
    """Padded length for `n` tokens: powers of two from `minimum` up to `step`, then multiples of
    `step`. Every distinct shape compiles once, so lengths are padded to these buckets."""
    if n <= 0:
        return 0
    b = minimum
    while b < n and b < step:
        b *= 2
    if b >= n:
        return b
    return -(-n // step) * step


def batch_bucket(n: int, max_batch: int) -> int:
    """Requests a prefill batch of `n` is padded to: a power of two, at most `max_batch`."""
    return min(pow2(n), max(max_batch, n))


def batch_buckets(max_batch: int) -> list[int]:
    return sorted({batch_bucket(n, max_batch) for n in range(1, max_batch + 1)})


def packed_length(new_tokens: int, batch: int, n_pad: int, min_bucket: int = 16) -> int:
    """The length a batch of `batch` requests padded to `n_pad`, `new_tokens` of them real, is
    packed into (their bucket), or 0 where packing would not at least halve its rows."""
    length = bucket_len(new_tokens, min_bucket)
    return length if batch > 1 and 2 * length <= batch * n_pad else 0


def validate_tokens(cfg: ModelConfig, tokens: np.ndarray, what: str = "tokens") -> None:
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)][0]
        raise ValueError(f"{what}: token id {int(bad)} is out of range [0, {cfg.vocab_size})")


def validate_context(cfg: ModelConfig, total: int) -> None:
    if total > cfg.max_seq_len:
        raise ValueError(
            f"context of {total} tokens exceeds the model's max_seq_len {cfg.max_seq_len}"
        )


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """A padded prefill batch.

    tokens `[B, N_pad]` int32 (the new tokens of each request, zero padded), new_lens `[B]`,
    cached_lens `[B]`; `c_pad` is the padded cached length of the KV rows each layer receives.
    """

    tokens: np.ndarray
    new_lens: np.ndarray
    cached_lens: np.ndarray
    c_pad: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_pad(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        new_tokens: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        min_bucket: int = 16,
    ) -> PrefillBatch:
        """Pads requests (new token ids, cached length) into one batch, validating them."""
        if len(new_tokens) != len(cached_lens) or not new_tokens:
            raise ValueError("a prefill batch needs one cached length per request and >= 1 request")
        new_lens = np.array([len(t) for t in new_tokens], np.int32)
        cached = np.array(cached_lens, np.int32)
        if (new_lens < 1).any():
            raise ValueError("every request in a prefill batch needs at least one new token")
        if (cached < 0).any():
            raise ValueError("cached lengths must be >= 0")
        for t, c in zip(new_tokens, cached):
            validate_tokens(cfg, np.asarray(t))
            validate_context(cfg, int(c) + len(t))
        n_pad = bucket_len(int(new_lens.max()), min_bucket)
        tokens = np.zeros((len(new_tokens), n_pad), np.int32)
        for b, t in enumerate(new_tokens):
            tokens[b, : len(t)] = t
        c_max = int(cached.max())
        c_pad = bucket_len(c_max, min_bucket) if c_max else 0
        return cls(tokens, new_lens, cached, c_pad)

    def positions(self) -> np.ndarray:
        return self.cached_lens[:, None] + np.arange(self.n_pad, dtype=np.int32)[None, :]

    def packed(self, min_bucket: int = 16) -> PackedTokens | None:
        """The batch packed (model/packing.py) into `packed_length`, or None."""
        total = int(self.new_lens.sum())
        length = packed_length(total, self.batch_size, self.n_pad, min_bucket)
        return plan(self.tokens, self.new_lens, self.cached_lens, length) if length else None


@dataclasses.dataclass
class PrefillResult:
    """last_logits `[B, V]` (each request's last new token); logits `[B, N_pad, V]` if asked."""

    last_logits: Array
    logits: Array | None = None
