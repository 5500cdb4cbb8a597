"""Hash-chain block identity and model fingerprints."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dualpath_jax.kvstore.identity import (
    InvalidBlockKey,
    block_keys,
    check_key,
    key_from_path,
    key_path,
    model_fingerprint,
)
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2

FP = model_fingerprint(TINY_QWEN2)


def test_fingerprint_depends_on_config_and_params_version():
    assert model_fingerprint(TINY_QWEN2) == FP
    assert len(FP) == 32 and int(FP, 16) >= 0
    others = {
        model_fingerprint(TINY_DEEPSEEK),
        model_fingerprint(TINY_QWEN2, "step-100"),
        model_fingerprint(dataclasses.replace(TINY_QWEN2, kv_dtype="bfloat16")),
        model_fingerprint(dataclasses.replace(TINY_QWEN2, rope_theta=1e6)),
    }
    assert FP not in others and len(others) == 4


def test_chain_shape_and_partial_tail():
    toks = np.arange(10)
    keys = block_keys(toks, 4, FP)
    assert len(keys) == 2  # 2 full blocks, the 2-token tail has no key
    assert keys == block_keys(toks[:8], 4, FP) == block_keys(list(range(9)), 4, FP)
    assert block_keys(toks[:3], 4, FP) == []
    assert all(check_key(k) == k for k in keys)


def test_key_names_the_whole_prefix():
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])
    b = a.copy()
    b[5] = 0  # differs in block 1
    ka, kb = block_keys(a, 4, FP), block_keys(b, 4, FP)
    assert ka[0] == kb[0]
    assert all(x != y for x, y in zip(ka[1:], kb[1:]))  # block 2 has equal tokens, not equal keys
    # Same tokens at another position give another key.
    assert block_keys(a[4:8], 4, FP)[0] != ka[1]


def test_chain_extends_from_a_parent():
    toks = np.random.default_rng(0).integers(0, 1000, 64)
    full = block_keys(toks, 8, FP)
    assert block_keys(toks[:24], 8, FP) + block_keys(toks[24:], 8, FP, parent=full[2]) == full


def test_seeded_by_fingerprint_and_independent_of_int_dtype():
    toks = [5, 6, 7, 8]
    assert block_keys(toks, 4, FP) != block_keys(toks, 4, model_fingerprint(TINY_DEEPSEEK))
    ref = block_keys(np.array(toks, np.int64), 4, FP)
    assert (
        ref
        == block_keys(np.array(toks, np.int32), 4, FP)
        == block_keys(np.array(toks, np.uint16), 4, FP)
    )


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], np.zeros(4, np.float32)])
def test_bad_token_ids(bad):
    with pytest.raises(ValueError):
        block_keys(bad, 4, FP)


@pytest.mark.parametrize(
    "bad", ["", "../" + "a" * 29, "A" * 32, "a" * 31, "a" * 33, "ab/" + "c" * 29, "g" * 32, None]
)
def test_invalid_keys_rejected(bad):
    with pytest.raises(InvalidBlockKey):
        check_key(bad)
    with pytest.raises(InvalidBlockKey):
        key_path(bad)


def test_key_paths_stay_one_shard_deep():
    key = block_keys(range(4), 4, FP)[0]
    path = key_path(key)
    assert path == f"{key[:2]}/{key}" and ".." not in path
    assert key_from_path(path) == key
    assert key_from_path(path + ".__lock") is None
    assert key_from_path(f"zz/{key}") is None
    assert key_from_path(key) is None
