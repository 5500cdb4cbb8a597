"""Block store fixtures: a tiny Full Block format and one store per backend kind."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dualpath_jax.config import StoreConfig
from dualpath_jax.kvstore import BlockFormat, TensorStoreBlockStore, model_fingerprint
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets import TINY_QWEN2

# Small prime-ish dimensions: 3 layers, 4-token blocks, 12 bytes per token per layer.
LAYOUT = BlockLayout(3, 4, 12)
FINGERPRINT = model_fingerprint(TINY_QWEN2)


@pytest.fixture
def fmt() -> BlockFormat:
    return BlockFormat(LAYOUT, "float32", FINGERPRINT)


@pytest.fixture
def random_blocks():
    """`random_blocks(n, seed)` -> `[n, L, bt, bytes]` uint8 Full Blocks."""

    def make(n: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, (n, *LAYOUT.shape), dtype=np.uint8)

    return make


def store_config(kind: str, tmp_path, **kw) -> StoreConfig:
    if kind == "file":
        return StoreConfig(kind="file", root=str(tmp_path / "store"), block_tokens=4, **kw)
    if kind == "memory":
        return StoreConfig(kind="memory", block_tokens=4, **kw)
    if kind == "spec":  # a file kvstore given as a raw spec, passed through unchanged
        spec = {"driver": "file", "path": str(tmp_path / "spec_store") + "/"}
        return StoreConfig(kind="spec", spec_json=json.dumps(spec), block_tokens=4, **kw)
    raise ValueError(kind)


@pytest.fixture(params=["file", "memory", "spec"])
def make_store(request, tmp_path, fmt):
    """Factory `make_store(on_events=None, **StoreConfig overrides)` for the parametrized
    backend; closes all."""
    stores = []

    def make(on_events=None, **kw) -> TensorStoreBlockStore:
        st = TensorStoreBlockStore(store_config(request.param, tmp_path, **kw), fmt, on_events)
        stores.append(st)
        return st

    make.kind = request.param
    yield make
    for st in stores:
        st.close()


@pytest.fixture
def store(make_store) -> TensorStoreBlockStore:
    return make_store()
