"""A peer engine for the KVChannel conformance tests: a JaxTransferChannel driven over stdin.

  python tests/transfer/channel_peer.py

Prints `ADDR <address>` once serving, then for each stdin line
`offer <uuid> <seed>:<dtype>:<d0>x<d1>... [...]` offers `make_array(seed, shape, dtype)` for each
item and prints `OK` (or `ERR <message>`); `exit` (or EOF) ends the process.
"""

from __future__ import annotations

import math
import sys

import numpy as np


def make_array(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Deterministic random bytes of `shape`/`dtype`: both processes compute the same array."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, math.prod(shape) * dt.itemsize, np.uint8)
    return raw.view(dt).reshape(shape)


def encode_item(seed: int, shape: tuple[int, ...], dtype: str) -> str:
    return f"{seed}:{dtype}:{'x'.join(str(d) for d in shape)}"


def decode_item(item: str) -> tuple[int, tuple[int, ...], str]:
    seed, dtype, dims = item.split(":")
    return int(seed), tuple(int(d) for d in dims.split("x")), dtype


def main() -> None:
    from dualpath_jax.transfer.jax_channel import JaxTransferChannel

    with JaxTransferChannel(offer_ttl_s=300.0) as ch:
        print(f"ADDR {ch.address}", flush=True)
        for line in sys.stdin:
            parts = line.split()
            if not parts or parts[0] == "exit":
                break
            try:
                arrays = [make_array(*decode_item(item)) for item in parts[2:]]
                ch.offer(int(parts[1]), arrays)
                print("OK", flush=True)
            except Exception as e:  # report, keep serving
                print(f"ERR {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
