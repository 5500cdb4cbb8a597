"""Block identity: model fingerprints and the hash chain over token ids (docs/architecture.md).

A Full Block's key is `key_i = H(key_{i-1}, tokens of block i)` with `key_{-1}` the model
fingerprint, so a key names the whole token prefix up to the end of its block under one model and
params version: this is the paper's prefix trie flattened into a chain. A prefix hit is the longest
run of leading keys that are stored. Partial trailing blocks never get a key (they are never
stored).

`H` is keyed BLAKE2b with a 16-byte digest: the previous key is the BLAKE2b key and the block's
token ids (little-endian uint32) are the message. Keys travel as 32-character lowercase hex
strings, which also makes them safe store paths (no separators, no `..`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

import numpy as np

from dualpath_jax.config import ModelConfig, to_dict

KEY_BYTES = 16
KEY_HEX_CHARS = 2 * KEY_BYTES
_KEY_RE = re.compile(f"[0-9a-f]{{{KEY_HEX_CHARS}}}")
_TOKEN_DTYPE = np.dtype("<u4")


class InvalidBlockKey(ValueError):
    """A block key is not a 32-character lowercase hex digest."""


# The version of scaled fp8 rows' layout (`kernels.kv_rows.RowLayout`): part of the fingerprint,
# so a store's blocks written in an earlier layout are never read as this one.
KV_SCALE_LAYOUT = 2


def model_fingerprint(cfg: ModelConfig, params_version: str = "") -> str:
    """Hex fingerprint of a model architecture plus a params version.

    Any change to the architecture (including `kv_dtype` and the sliding window, hence the KV
    layout's layer groups), to the layout of scaled KV rows or to `params_version` changes every
    block key derived from it, so KV computed by older params is never reused. The window fields
    count only when set: a model with no windowed layer (one layer group keeping all tokens)
    has the fingerprint it had before they existed, and its stored blocks stay valid. The
    attention backend (`attention_impl`, `attention_pages_per_step`) and the MoE implementation
    (`moe_impl`) are not part of it: every backend computes the same KV.
    """
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"dpjax-model")
    arch = to_dict(cfg)
    for compute_only in ("attention_impl", "attention_pages_per_step", "moe_impl"):
        del arch[compute_only]
    if not cfg.sliding_window:  # full attention everywhere: the fingerprint of before windows
        del arch["sliding_window"], arch["sliding_window_layers"]
    if cfg.kv_scales:  # the rows' format: each head's scales after its data (earlier: after all)
        arch["kv_scale_layout"] = KV_SCALE_LAYOUT
    h.update(json.dumps(arch, sort_keys=True).encode())
    h.update(b"\x00")
    h.update(params_version.encode())
    return h.hexdigest()


def check_key(key: str) -> str:
    """Returns `key` if it is a valid block key (or fingerprint), else raises InvalidBlockKey."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise InvalidBlockKey(f"block key must be {KEY_HEX_CHARS} lowercase hex chars, got {key!r}")
    return key


def is_key(key: object) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def key_path(key: str) -> str:
    """Store path of a block key, sharded by its first byte (`ab/abcd...`); validates the key."""
    check_key(key)
    return f"{key[:2]}/{key}"


def key_from_path(path: str) -> str | None:
    """Inverse of `key_path`; None for anything that is not a block path (lock files, strays)."""
    shard, _, key = path.rpartition("/")
    if is_key(key) and shard.endswith(key[:2]) and (len(shard) == 2 or shard[-3] == "/"):
        return key
    return None


def _tokens_u32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype(_TOKEN_DTYPE, copy=False)


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_tokens: int,
    fingerprint: str,
    parent: str | None = None,
) -> list[str]:
    """Keys of every full block of `tokens` (the partial tail is dropped).

    `tokens` starts at a block boundary; `parent` is the key of the block just before it (None:
    `tokens` starts the sequence and the chain is seeded by `fingerprint`). Extending a sequence
    by whole blocks therefore needs only the last key: `block_keys(new, bt, fp, parent=keys[-1])`.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    prev = bytes.fromhex(check_key(parent if parent is not None else fingerprint))
    data = _tokens_u32(tokens)
    n = data.size // block_tokens
    raw = data[: n * block_tokens].tobytes()
    step = block_tokens * _TOKEN_DTYPE.itemsize
    keys = []
    for i in range(n):
        prev = hashlib.blake2b(
            raw[i * step : (i + 1) * step], digest_size=KEY_BYTES, key=prev
        ).digest()
        keys.append(prev.hex())
    return keys
