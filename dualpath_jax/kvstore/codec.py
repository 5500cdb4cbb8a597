"""Full Block codec: the bytes of one stored block and their verification.

A stored Full Block is a fixed-size header, a table of per-layer checksums, then the payload::

    [header: HEADER_BYTES] [layer checksums: n_layers x u64] [payload: the Full Block's bytes]

- The header holds a magic, the format version, the layout `[n_layers, block_tokens,
  bytes_per_token_per_layer]`, the KV dtype tag, the model fingerprint, the token count, the
  block's own key, the *block checksum* (xxh3-64 of checksum table + payload) and an xxh3-64 of
  the header itself.
- Layer checksum `l` is `xxh3_64(layer l bytes, seed=layer_seed(key, l))`. Seeding with the key
  and layer index binds the bytes to their place: bytes moved to another key or layer fail.
- The payload is the Full Block `[n_layers, block_tokens, bytes]` uint8 as is, so a full read
  lands in a host buffer with no layout conversion and is verified by one hash pass.

Header and table sizes follow from the layout alone, so the byte range of layers `[l0, l1)`
(`layer_byte_range`) and of their checksums (`checksum_byte_range`) are known without reading
the header, and a layer-range read is verified by its own checksums.
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
# fingerprint, key, block checksum; zero padding up to the header checksum in the last 8 bytes.
_HEADER = struct.Struct(f"<8sHHIIII{_DTYPE_BYTES}s{KEY_BYTES}s{KEY_BYTES}sQ")
_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1
_BLOCK_SEED_SALT = 0x9E3779B97F4A7C15
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
        # The header holds one [layers, block_tokens, bytes] shape and the payload is that array.
        self.layout.require_uniform("the block store (kvstore/codec.py: its header and payload)")
        check_key(self.fingerprint)
        if len(self.dtype.encode()) > _DTYPE_BYTES:
            raise ValueError(f"dtype tag {self.dtype!r} longer than {_DTYPE_BYTES} bytes")
        if min(self.layout.shape) <= 0:
            raise ValueError(f"block layout {self.layout.shape} must be positive")

    @property
    def payload_offset(self) -> int:
        """Byte offset of the payload (the Full Block's bytes) in a stored block."""
        return HEADER_BYTES + CHECKSUM_BYTES * self.layout.num_layers

    @property
    def encoded_bytes(self) -> int:
        """Size of a stored Full Block."""
        return self.payload_offset + self.layout.nbytes

    def _check_range(self, start: int, stop: int) -> None:
        n = self.layout.num_layers
        if not 0 <= start < stop <= n:
            raise IndexError(f"layer range [{start}, {stop}) outside [0, {n})")

    def layer_byte_range(self, start: int, stop: int) -> tuple[int, int]:
        """Half-open byte range `[lo, hi)` of the Layer Blocks `[start, stop)` in a stored block."""
        self._check_range(start, stop)
        nb = self.layout.layer_nbytes
        return self.payload_offset + start * nb, self.payload_offset + stop * nb

    def checksum_byte_range(self, start: int, stop: int) -> tuple[int, int]:
        """Half-open byte range of the checksums of layers `[start, stop)` in a stored block."""
        self._check_range(start, stop)
        return HEADER_BYTES + CHECKSUM_BYTES * start, HEADER_BYTES + CHECKSUM_BYTES * stop


def layer_seed(key: str, layer: int) -> int:
    """xxh3 seed of a layer checksum: the key's first 8 bytes (little-endian) plus the layer."""
    return (int.from_bytes(bytes.fromhex(key[:16]), "little") + layer) & _MASK64


def _block_seed(key: str) -> int:
    return layer_seed(key, 0) ^ _BLOCK_SEED_SALT


def _bytes(buf: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    """A flat byte view of a buffer (no copy)."""
    mv = memoryview(buf)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def block_checksum(
    key: str, table: bytes | memoryview, payload: bytes | memoryview | np.ndarray
) -> int:
    """The block checksum over the checksum table and the payload (a Full Block's bytes)."""
    h = xxhash.xxh3_64(seed=_block_seed(key))
    h.update(table)
    h.update(_bytes(payload))
    return h.intdigest()


def layer_checksums(key: str, block: np.ndarray, start: int = 0) -> bytes:
    """The checksum table entries of Layer Blocks `block[i]` at layers `start + i`."""
    base = layer_seed(key, 0)
    return b"".join(
        _U64.pack(xxhash.xxh3_64_intdigest(_bytes(block[i]), seed=(base + start + i) & _MASK64))
        for i in range(block.shape[0])
    )


def encode_header(
    fmt: BlockFormat, key: str, checksum: int, token_count: int | None = None
) -> bytes:
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
        checksum,
    ).ljust(HEADER_BYTES - CHECKSUM_BYTES, b"\x00")
    return body + _U64.pack(xxhash.xxh3_64_intdigest(body))


def encode_block(fmt: BlockFormat, key: str, block: np.ndarray) -> bytes:
    """Serializes one Full Block `[n_layers, block_tokens, bytes]` uint8 stored under `key`."""
    if block.dtype != np.uint8 or block.shape != fmt.layout.shape:
        raise ValueError(
            f"Full Block must be uint8 {fmt.layout.shape}, got {block.dtype} {block.shape}"
        )
    block = np.ascontiguousarray(block)
    table = layer_checksums(key, block)
    header = encode_header(fmt, key, block_checksum(key, table, block))
    return b"".join([header, table, _bytes(block)])


def check_header(fmt: BlockFormat, key: str, header: bytes | memoryview) -> int:
    """Verifies a stored header against the expected format and key; returns the block checksum
    it records. Raises BlockDecodeError."""
    header = bytes(header)
    if len(header) < HEADER_BYTES:
        raise BlockCorrupt(f"block {key}: header truncated ({len(header)} of {HEADER_BYTES} bytes)")
    header = header[:HEADER_BYTES]
    if header[:8] != MAGIC:
        raise BlockCorrupt(f"block {key}: bad magic {header[:8]!r}")
    body, (stored,) = header[:-CHECKSUM_BYTES], _U64.unpack(header[-CHECKSUM_BYTES:])
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise BlockCorrupt(f"block {key}: header checksum mismatch")
    _, version, hsize, n_layers, bt, bpt, ntok, dtype, fp, stored_key, checksum = _HEADER.unpack(
        body[: _HEADER.size]
    )
    if version != FORMAT_VERSION or hsize != HEADER_BYTES:
        raise BlockMismatch(
            f"block {key}: format version {version} (header {hsize} B), expected {FORMAT_VERSION}"
        )
    lay = fmt.layout
    if (n_layers, bt, bpt) != lay.shape:
        raise BlockMismatch(f"block {key}: layout {(n_layers, bt, bpt)}, expected {lay.shape}")
    if ntok != lay.block_tokens:
        raise BlockMismatch(
            f"block {key}: holds {ntok} tokens, a Full Block holds {lay.block_tokens}"
        )
    if dtype.rstrip(b"\x00").decode(errors="replace") != fmt.dtype:
        raise BlockMismatch(
            f"block {key}: dtype {dtype.rstrip(bytes(1))!r}, expected {fmt.dtype!r}"
        )
    if fp.hex() != fmt.fingerprint:
        raise BlockMismatch(
            f"block {key}: model fingerprint {fp.hex()}, expected {fmt.fingerprint}"
        )
    if stored_key.hex() != key:
        raise BlockMismatch(f"block {key}: header names block {stored_key.hex()}")
    return checksum


def check_layer_checksums(
    fmt: BlockFormat,
    key: str,
    layers: np.ndarray,
    checksums: bytes | bytearray | memoryview,
    start: int,
) -> None:
    """Verifies Layer Blocks `layers` `[n, block_tokens, bytes]` against their stored checksums
    (`n` little-endian u64) as layers `[start, start + n)` of `key`."""
    if len(checksums) != CHECKSUM_BYTES * layers.shape[0]:
        raise BlockCorrupt(f"block {key}: checksum table truncated")
    if layer_checksums(key, layers, start) != bytes(checksums):
        for i in range(layers.shape[0]):
            got = layer_checksums(key, layers[i : i + 1], start + i)
            if got != bytes(checksums[CHECKSUM_BYTES * i : CHECKSUM_BYTES * (i + 1)]):
                raise BlockCorrupt(f"block {key}: layer {start + i} checksum mismatch")


def _shaped(fmt: BlockFormat, payload: bytes | memoryview, n: int) -> np.ndarray:
    lay = fmt.layout
    return np.frombuffer(payload, np.uint8).reshape(
        n, lay.block_tokens, lay.bytes_per_token_per_layer
    )


def _deliver(view: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return view
    if out.shape != view.shape or out.dtype != np.uint8:
        raise ValueError(f"out must be uint8 {view.shape}, got {out.dtype} {out.shape}")
    np.copyto(out, view)
    return out


def decode_layers(
    fmt: BlockFormat,
    key: str,
    checksums: bytes | memoryview,
    payload: bytes | memoryview,
    start: int,
    stop: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Verifies Layer Blocks `[start, stop)` read by byte range (`checksums` from
    `checksum_byte_range`, `payload` from `layer_byte_range`) and returns them as
    `[stop - start, block_tokens, bytes]` uint8.

    Without `out` the result is a read-only view into `payload` (no copy); with `out` (writable,
    that shape) the bytes are copied there and `out` is returned.
    """
    lo, hi = fmt.layer_byte_range(start, stop)
    if len(payload) != hi - lo:
        raise BlockCorrupt(
            f"block {key}: layers [{start}, {stop}) need {hi - lo} bytes, got {len(payload)}"
        )
    view = _shaped(fmt, payload, stop - start)
    check_layer_checksums(fmt, key, view, checksums, start)
    return _deliver(view, out)


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
    mv = _bytes(data)
    stored = check_header(fmt, key, mv[:HEADER_BYTES])
    table, payload = mv[HEADER_BYTES : fmt.payload_offset], mv[fmt.payload_offset :]
    if block_checksum(key, table, payload) != stored:
        raise BlockCorrupt(f"block {key}: block checksum mismatch")
    return _deliver(_shaped(fmt, payload, fmt.layout.num_layers), out)
