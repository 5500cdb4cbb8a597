"""Full Block codec: round trip, layer byte ranges, and every kind of damage detected."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import xxhash

from dualpath_jax.kvstore import codec
from dualpath_jax.kvstore.codec import (
    HEADER_BYTES,
    BlockCorrupt,
    BlockFormat,
    BlockMismatch,
    decode_block,
    decode_layers,
    encode_block,
)
from dualpath_jax.kvstore.identity import block_keys
from dualpath_jax.model.layout import BlockLayout, kv_to_full_blocks, layer_blocks_to_full

KEY = "00112233445566778899aabbccddeeff"
OTHER_KEY = "ffeeddccbbaa99887766554433221100"


@pytest.fixture
def block(random_blocks):
    return random_blocks(1, seed=3)[0]


def test_round_trip(fmt, block):
    data = encode_block(fmt, KEY, block)
    assert len(data) == fmt.encoded_bytes
    out = decode_block(fmt, KEY, data)
    np.testing.assert_array_equal(out, block)
    assert out.shape == fmt.layout.shape and out.dtype == np.uint8
    dest = np.zeros_like(block)
    assert decode_block(fmt, KEY, data, out=dest) is dest
    np.testing.assert_array_equal(dest, block)


def test_round_trip_of_model_kv_rows(fmt):
    # KV rows [L, T, W] float32 -> Full Blocks -> stored bytes -> back, bit exact.
    layout = BlockLayout(3, 4, 12)
    rows = np.random.default_rng(0).standard_normal((3, 8, 3)).astype(np.float32)
    blocks = kv_to_full_blocks(rows, layout.block_tokens)
    keys = block_keys(np.arange(8), 4, fmt.fingerprint)
    back = [decode_block(fmt, k, encode_block(fmt, k, b)) for k, b in zip(keys, blocks)]
    np.testing.assert_array_equal(np.stack(back), blocks)


def read_layers(fmt, data: bytes, start: int, stop: int, key: str = KEY) -> np.ndarray:
    """What a byte-range reader does: two ranges of the stored bytes, then verify."""
    checksums = data[slice(*fmt.checksum_byte_range(start, stop))]
    payload = data[slice(*fmt.layer_byte_range(start, stop))]
    return decode_layers(fmt, key, checksums, payload, start, stop)


def test_layer_ranges_are_slices_of_the_full_block(fmt, block):
    data = encode_block(fmt, KEY, block)
    n, nb = fmt.layout.num_layers, fmt.layout.layer_nbytes
    payload0 = HEADER_BYTES + 8 * n
    # The payload is the Full Block's bytes as is.
    assert data[payload0:] == block.tobytes()
    for start in range(n):
        for stop in range(start + 1, n + 1):
            assert fmt.layer_byte_range(start, stop) == (
                payload0 + start * nb,
                payload0 + stop * nb,
            )
            assert fmt.checksum_byte_range(start, stop) == (
                HEADER_BYTES + 8 * start,
                HEADER_BYTES + 8 * stop,
            )
            np.testing.assert_array_equal(read_layers(fmt, data, start, stop), block[start:stop])
    per_layer = [read_layers(fmt, data, i, i + 1) for i in range(n)]
    np.testing.assert_array_equal(layer_blocks_to_full(per_layer), block)


@pytest.mark.parametrize("bad", [(-1, 1), (0, 0), (2, 1), (0, 4)])
def test_layer_range_outside_the_block(fmt, bad):
    with pytest.raises(IndexError):
        fmt.layer_byte_range(*bad)


def test_every_flipped_byte_is_detected(fmt, block):
    data = bytearray(encode_block(fmt, KEY, block))
    # Every header and checksum-table byte and a stride of payload bytes across all layers.
    positions = list(range(fmt.payload_offset)) + list(range(fmt.payload_offset, len(data), 7))
    positions.append(len(data) - 1)
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 0x40
        with pytest.raises(BlockCorrupt):
            decode_block(fmt, KEY, bytes(bad))


def test_flipped_layer_byte_fails_its_layer_range_only(fmt, block):
    data = bytearray(encode_block(fmt, KEY, block))
    lo, _ = fmt.layer_byte_range(1, 2)
    data[lo + 5] ^= 1
    with pytest.raises(BlockCorrupt, match="layer 1"):
        read_layers(fmt, bytes(data), 0, 2)
    np.testing.assert_array_equal(read_layers(fmt, bytes(data), 2, 3), block[2:3])
    np.testing.assert_array_equal(read_layers(fmt, bytes(data), 0, 1), block[0:1])
    # A damaged checksum fails its layer too.
    data = bytearray(encode_block(fmt, KEY, block))
    data[fmt.checksum_byte_range(2, 3)[0]] ^= 1
    with pytest.raises(BlockCorrupt, match="layer 2"):
        read_layers(fmt, bytes(data), 1, 3)


@pytest.mark.parametrize("cut", [0, 1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 1, -8, -1])
def test_truncated_block(fmt, block, cut):
    data = encode_block(fmt, KEY, block)
    with pytest.raises(BlockCorrupt):
        decode_block(fmt, KEY, data[:cut])


def test_extended_block(fmt, block):
    with pytest.raises(BlockCorrupt):
        decode_block(fmt, KEY, encode_block(fmt, KEY, block) + b"\x00")


def test_wrong_model_fingerprint(fmt, block):
    other = dataclasses.replace(fmt, fingerprint=OTHER_KEY)
    with pytest.raises(BlockMismatch, match="fingerprint"):
        decode_block(fmt, KEY, encode_block(other, KEY, block))


def test_wrong_dtype_tag(fmt, block):
    other = dataclasses.replace(fmt, dtype="bfloat16")
    with pytest.raises(BlockMismatch, match="dtype"):
        decode_block(fmt, KEY, encode_block(other, KEY, block))


def test_wrong_key(fmt, block):
    data = encode_block(fmt, OTHER_KEY, block)
    with pytest.raises(BlockMismatch, match="names block"):
        decode_block(fmt, KEY, data)
    # Layer checksums are bound to their key by the seed, so a layer read also fails.
    with pytest.raises(BlockCorrupt):
        read_layers(fmt, data, 0, 1)


@pytest.mark.parametrize("shape", [(2, 4, 12), (3, 8, 6), (3, 4, 24), (4, 4, 12)])
def test_wrong_layout(fmt, shape):
    other = BlockFormat(BlockLayout(*shape), fmt.dtype, fmt.fingerprint)
    blk = np.zeros(shape, np.uint8)
    data = encode_block(other, KEY, blk)
    with pytest.raises((BlockMismatch, BlockCorrupt)):
        decode_block(fmt, KEY, data)
    # The header alone names the layout.
    with pytest.raises(BlockMismatch, match="layout"):
        codec.check_header(fmt, KEY, data[:HEADER_BYTES])


def test_layer_moved_to_another_layer(fmt, block):
    data = encode_block(fmt, KEY, block)
    checksum0 = data[slice(*fmt.checksum_byte_range(0, 1))]
    layer0 = data[slice(*fmt.layer_byte_range(0, 1))]
    with pytest.raises(BlockCorrupt):
        decode_layers(fmt, KEY, checksum0, layer0, 1, 2)
    with pytest.raises(BlockCorrupt):
        decode_layers(fmt, KEY, checksum0[:4], layer0, 0, 1)  # truncated checksum


def _rewrite_header_field(fmt, data: bytes, offset: int, fmt_char: str, value: int) -> bytes:
    """Sets one header field and recomputes the header checksum (a well-formed other header)."""
    head = bytearray(data[:HEADER_BYTES])
    struct.pack_into(fmt_char, head, offset, value)
    body = bytes(head[:-8])
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + data[HEADER_BYTES:]


def test_future_format_version(fmt, block):
    data = _rewrite_header_field(fmt, encode_block(fmt, KEY, block), 8, "<H", 99)
    with pytest.raises(BlockMismatch, match="version"):
        decode_block(fmt, KEY, data)


def test_partial_token_count(fmt, block):
    data = _rewrite_header_field(fmt, encode_block(fmt, KEY, block), 24, "<I", 3)
    with pytest.raises(BlockMismatch, match="tokens"):
        decode_block(fmt, KEY, data)


def test_encode_rejects_wrong_shape_or_dtype(fmt, block):
    with pytest.raises(ValueError):
        encode_block(fmt, KEY, block[:2])
    with pytest.raises(ValueError):
        encode_block(fmt, KEY, block.astype(np.int16))


def test_decoded_view_is_read_only_without_out(fmt, block):
    out = decode_block(fmt, KEY, encode_block(fmt, KEY, block))
    assert not out.flags.writeable
