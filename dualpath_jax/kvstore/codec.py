"""Full Block codec: the bytes of one stored block and their verification.

A stored Full Block is a fixed-size header followed by one *layer record* per layer::

    [header: HEADER_BYTES] [layer 0 bytes | u64 checksum] [layer 1 bytes | u64 checksum] ...

- The header holds a magic, the format version, the layout `[n_layers, block_tokens,
  bytes_per_token_per_layer]`, the KV dtype tag, the model fingerprint, the token count, the
  block's own key and an xxh3-64 checksum of the header itself.
- A layer record is the Layer Block's `block_tokens * bytes_per_token_per_layer` bytes followed
  by `xxh3_64(bytes, seed=layer_seed(key, layer))` (little-endian). Seeding with the key and layer
  index binds the bytes to their place: a record moved to another key or layer does not verify.

Because the header has a fixed size, the byte range of layers `[l0, l1)` is
`HEADER_BYTES + l * record_bytes` for `l in (l0, l1)`, known from the layout alone, and a
layer-range read is verified by the checksums it carries (no header read). Concatenating the
decoded layer records gives the Full Block `[n_layers, block_tokens, bytes]` uint8.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import xxhash

from dualpath_jax.kvstore.identity import KEY_BYTES, check_key
from dualpath_jax.model.layout import BlockLayout

MAGIC = b"DPKVBLK\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 128
CHECKSUM_BYTES = 8
_DTYPE_BYTES = 16
# magic, version, header size, n_layers, block_tokens, bytes/token/layer, token count, dtype,
# fingerprint, key; zero padding up to the header checksum in the last 8 bytes.
_HEADER = struct.Struct(f"<8sHHIIII{_DTYPE_BYTES}s{KEY_BYTES}s{KEY_BYTES}s")
_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1
assert _HEADER.size <= HEADER_BYTES - CHECKSUM_BYTES


class BlockDecodeError(ValueError):
    """Stored bytes are not a valid block for this format; the caller treats it as a miss."""


class BlockCorrupt(BlockDecodeError):
    """Checksum mismatch, truncation, bad magic: the bytes were damaged."""


class BlockMismatch(BlockDecodeError):
    """Intact bytes of a different block: another format version, layout, dtype, model or key."""


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """What every block of one store instance must match: layout, KV dtype tag, model fingerprint.

    `dtype` is the model's `kv_dtype` (or a KV format name such as `fp8_flashmla`); it is a tag
    only, the payload is always uint8.
    """

    layout: BlockLayout
    dtype: str
    fingerprint: str

    def __post_init__(self) -> None:
        check_key(self.fingerprint)
        if len(self.dtype.encode()) > _DTYPE_BYTES:
            raise ValueError(f"dtype tag {self.dtype!r} longer than {_DTYPE_BYTES} bytes")
        if min(self.layout.shape) <= 0:
            raise ValueError(f"block layout {self.layout.shape} must be positive")

    @property
    def record_bytes(self) -> int:
        """Bytes of one layer record (Layer Block + its checksum)."""
        return self.layout.layer_nbytes + CHECKSUM_BYTES

    @property
    def encoded_bytes(self) -> int:
        """Size of a stored Full Block."""
        return HEADER_BYTES + self.layout.num_layers * self.record_bytes

    def layer_byte_range(self, start: int, stop: int) -> tuple[int, int]:
        """Half-open byte range `[lo, hi)` of layer records `[start, stop)` in a stored block."""
        n = self.layout.num_layers
        if not 0 <= start < stop <= n:
            raise IndexError(f"layer range [{start}, {stop}) outside [0, {n})")
        return HEADER_BYTES + start * self.record_bytes, HEADER_BYTES + stop * self.record_bytes


def layer_seed(key: str, layer: int) -> int:
    """xxh3 seed of a layer record's checksum: the key's first 8 bytes plus the layer index."""
    return (int.from_bytes(bytes.fromhex(key[:16]), "little") + layer) & _MASK64


def encode_header(fmt: BlockFormat, key: str, token_count: int | None = None) -> bytes:
    lay = fmt.layout
    body = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        lay.num_layers,
        lay.block_tokens,
        lay.bytes_per_token_per_layer,
        lay.block_tokens if token_count is None else token_count,
        fmt.dtype.encode(),
        bytes.fromhex(fmt.fingerprint),
        bytes.fromhex(check_key(key)),
    ).ljust(HEADER_BYTES - CHECKSUM_BYTES, b"\x00")
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body))


def encode_block(fmt: BlockFormat, key: str, block: np.ndarray) -> bytes:
    """Serializes one Full Block `[n_layers, block_tokens, bytes]` uint8 stored under `key`."""
    if block.dtype != np.uint8 or block.shape != fmt.layout.shape:
        raise ValueError(
            f"Full Block must be uint8 {fmt.layout.shape}, got {block.dtype} {block.shape}"
        )
    block = np.ascontiguousarray(block)
    parts: list[bytes | memoryview] = [encode_header(fmt, key)]
    for layer in range(fmt.layout.num_layers):
        data = memoryview(block[layer]).cast("B")
        parts.append(data)
        parts.append(_U64.pack(xxhash.xxh3_64_intdigest(data, seed=layer_seed(key, layer))))
    return b"".join(parts)


def check_header(fmt: BlockFormat, key: str, header: bytes) -> None:
    """Verifies a stored header against the expected format and key; raises BlockDecodeError."""
    if len(header) < HEADER_BYTES:
        raise BlockCorrupt(f"block {key}: header truncated ({len(header)} of {HEADER_BYTES} bytes)")
    header = header[:HEADER_BYTES]
    if header[:8] != MAGIC:
        raise BlockCorrupt(f"block {key}: bad magic {header[:8]!r}")
    body, (stored,) = header[:-CHECKSUM_BYTES], _U64.unpack(header[-CHECKSUM_BYTES:])
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise BlockCorrupt(f"block {key}: header checksum mismatch")
    _, version, hsize, n_layers, bt, bpt, ntok, dtype, fp, stored_key = _HEADER.unpack(
        body[: _HEADER.size]
    )
    if version != FORMAT_VERSION or hsize != HEADER_BYTES:
        raise BlockMismatch(f"block {key}: format version {version} (header {hsize} B), expected {FORMAT_VERSION}")
    lay = fmt.layout
    if (n_layers, bt, bpt) != lay.shape:
        raise BlockMismatch(f"block {key}: layout {(n_layers, bt, bpt)}, expected {lay.shape}")
    if ntok != lay.block_tokens:
        raise BlockMismatch(f"block {key}: holds {ntok} tokens, a Full Block holds {lay.block_tokens}")
    if dtype.rstrip(b"\x00").decode(errors="replace") != fmt.dtype:
        raise BlockMismatch(f"block {key}: dtype {dtype.rstrip(bytes(1))!r}, expected {fmt.dtype!r}")
    if fp.hex() != fmt.fingerprint:
        raise BlockMismatch(f"block {key}: model fingerprint {fp.hex()}, expected {fmt.fingerprint}")
    if stored_key.hex() != key:
        raise BlockMismatch(f"block {key}: header names block {stored_key.hex()}")


def decode_layers(
    fmt: BlockFormat,
    key: str,
    data: bytes | memoryview,
    start: int,
    stop: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Verifies layer records `[start, stop)` (exactly the bytes of `layer_byte_range`) and
    returns them as `[stop - start, block_tokens, bytes]` uint8.

    Without `out` the result is a read-only view into `data` (no copy); with `out` (writable, that
    shape) the bytes are copied there and `out` is returned.
    """
    lo, hi = fmt.layer_byte_range(start, stop)
    if len(data) != hi - lo:
        raise BlockCorrupt(f"block {key}: layers [{start}, {stop}) need {hi - lo} bytes, got {len(data)}")
    n = stop - start
    lay = fmt.layout
    records = np.frombuffer(data, np.uint8).reshape(n, fmt.record_bytes)
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    nb = lay.layer_nbytes
    for i in range(n):
        off = i * fmt.record_bytes
        (stored,) = _U64.unpack_from(mv, off + nb)
        if xxhash.xxh3_64_intdigest(mv[off : off + nb], seed=layer_seed(key, start + i)) != stored:
            raise BlockCorrupt(f"block {key}: layer {start + i} checksum mismatch")
    view = records[:, :nb].reshape(n, lay.block_tokens, lay.bytes_per_token_per_layer)
    if out is None:
        return view
    if out.shape != view.shape or out.dtype != np.uint8:
        raise ValueError(f"out must be uint8 {view.shape}, got {out.dtype} {out.shape}")
    np.copyto(out, view)
    return out


def decode_block(
    fmt: BlockFormat, key: str, data: bytes | memoryview, out: np.ndarray | None = None
) -> np.ndarray:
    """Verifies a whole stored block and returns its Full Block `[n_layers, block_tokens, bytes]`.

    Raises BlockCorrupt / BlockMismatch on any difference. Without `out` the result is a read-only
    view into `data`; with `out` the bytes are copied there.
    """
    if len(data) != fmt.encoded_bytes:
        raise BlockCorrupt(
            f"block {key}: {len(data)} bytes, a stored block of this format has {fmt.encoded_bytes}"
        )
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    check_header(fmt, key, bytes(mv[:HEADER_BYTES]))
    return decode_layers(fmt, key, mv[HEADER_BYTES:], 0, fmt.layout.num_layers, out)
