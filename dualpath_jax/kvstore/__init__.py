"""Full Block storage: codec, hash-chain identity, the BlockStore and host buffers.

- `codec`: the stored bytes of a Full Block (header, per-layer checksums) and their verification.
- `identity`: model fingerprints and block keys (`key_i = H(key_{i-1}, tokens_i)`).
- `api`: the `BlockStore` interface (asynchronous, batched), where its reads land
  (`HostDestination`, `PinnedDestination`, `DeviceDestination`; `buffer_destination`), and its
  results, stats and errors.
- `store`: `TensorStoreBlockStore` (file/memory/spec); `filereader`: its direct file reads;
  `tensorstore_io`: its kvstore specs (`kvstore_spec`) and windowed I/O.
- `index`: LRU, pins and trajectory ownership behind the store's capacity limit.
- `buffers`: `HostBufferPool`, the PE buffer and DE buffer in host memory.
"""

from __future__ import annotations

from dualpath_jax.kvstore.api import (
    BlockRead,
    BlockReadResult,
    BlockStore,
    DestinationKind,
    DeviceDestination,
    HostDestination,
    PinnedDestination,
    ReadDestination,
    StoreError,
    StoreStats,
    StoreUnavailable,
    UnsupportedDestination,
    WriteReport,
    buffer_destination,
)
from dualpath_jax.kvstore.buffers import BufferFull, BufferReservation, BufferStats, HostBufferPool
from dualpath_jax.kvstore.codec import (
    BlockCorrupt,
    BlockDecodeError,
    BlockFormat,
    BlockMismatch,
    decode_block,
    decode_layers,
    encode_block,
)
from dualpath_jax.kvstore.identity import InvalidBlockKey, block_keys, model_fingerprint
from dualpath_jax.kvstore.index import BlockIndex
from dualpath_jax.kvstore.store import TensorStoreBlockStore, open_block_store
from dualpath_jax.kvstore.tensorstore_io import kvstore_spec

__all__ = [
    "BlockCorrupt",
    "BlockDecodeError",
    "BlockFormat",
    "BlockIndex",
    "BlockMismatch",
    "BlockRead",
    "BlockReadResult",
    "BlockStore",
    "BufferFull",
    "BufferReservation",
    "BufferStats",
    "DestinationKind",
    "DeviceDestination",
    "HostBufferPool",
    "HostDestination",
    "InvalidBlockKey",
    "PinnedDestination",
    "ReadDestination",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "TensorStoreBlockStore",
    "UnsupportedDestination",
    "WriteReport",
    "block_keys",
    "buffer_destination",
    "kvstore_spec",
    "decode_block",
    "decode_layers",
    "encode_block",
    "model_fingerprint",
    "open_block_store",
]
