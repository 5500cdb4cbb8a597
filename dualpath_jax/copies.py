"""Host <-> device copies of the KV data path, counted.

Every copy the loaders and the prefill path make between host memory and a device goes through
`to_device` or `to_host`, which count it (per direction and purpose, in copies and bytes) in the
process-wide `COPIES`. Tests assert how many copies a path makes (for instance: no
device-to-host copy of blocks that arrive over the DE read path); benchmarks report the bytes.
Counting costs a lock and two additions per copy. It imports nothing else of the package: the
model, the host buffers and the loaders, each on a layer of its own, all count here.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import jax
import numpy as np


class CopyCounter:
    """Copies and bytes per `(direction, purpose)`; direction is "h2d" or "d2h"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: collections.Counter = collections.Counter()
        self._bytes: collections.Counter = collections.Counter()

    def add(self, direction: str, purpose: str, nbytes: int) -> None:
        with self._lock:
            self._copies[direction, purpose] += 1
            self._bytes[direction, purpose] += int(nbytes)

    def copies(self, direction: str, purpose: str | None = None) -> int:
        with self._lock:
            return sum(
                n for (d, p), n in self._copies.items() if d == direction and purpose in (None, p)
            )

    def nbytes(self, direction: str, purpose: str | None = None) -> int:
        with self._lock:
            return sum(
                n for (d, p), n in self._bytes.items() if d == direction and purpose in (None, p)
            )

    def snapshot(self) -> dict[str, dict[str, int]]:
        """`{"h2d/purpose": {"copies": n, "bytes": b}, ...}`."""
        with self._lock:
            return {
                f"{d}/{p}": {"copies": n, "bytes": self._bytes[d, p]}
                for (d, p), n in sorted(self._copies.items())
            }

    def reset(self) -> None:
        with self._lock:
            self._copies.clear()
            self._bytes.clear()


COPIES = CopyCounter()


def count(direction: str, purpose: str, nbytes: int) -> None:
    """Counts a copy made inside a compiled program (e.g. a pinned host buffer's pages moved to
    device memory): `direction` "h2d" or "d2h"."""
    COPIES.add(direction, purpose, nbytes)


def to_device(x: Any, purpose: str, device: Any = None) -> Any:
    """`jax.device_put(x, device)`, counted as a host-to-device copy of `purpose` (arrays
    already on a device are passed through uncounted)."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, device) if device is not None else x
    COPIES.add("h2d", purpose, np.asarray(x).nbytes)
    return jax.device_put(x, device)


def snapshot(x: Any, device: Any = None) -> jax.Array:
    """A device array of `x`'s values as they are now, for host arrays the caller changes in place
    later (slot tables, flags). On CPU `jax.device_put` may alias a suitably aligned numpy buffer
    (zero copy), and a jitted call may read a numpy argument after it returns: a later in-place
    write would then show in the device array. This puts a private copy. Not counted: these are
    not KV data."""
    return jax.device_put(np.array(x, copy=True), device)


def to_host(x: Any, purpose: str) -> np.ndarray:
    """`np.asarray(x)`, counted as a device-to-host copy of `purpose` when `x` is a device
    array."""
    if isinstance(x, jax.Array):
        COPIES.add("d2h", purpose, x.nbytes)
    return np.asarray(x)
