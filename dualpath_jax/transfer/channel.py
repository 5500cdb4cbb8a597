"""KVChannel: pull-based movement of KV Layer Blocks between engine processes.

A PE (or a DE on the DE read path) *offers* the arrays of a transfer under a 63-bit uuid; the
receiving engine *pulls* them by (peer address, uuid, specs) into its own device memory. Both sides
derive the uuid from names they already share (`make_uuid(request_id, layer, part)`), so a transfer
needs no round trip beyond the control message that names the request.

Arrays are Layer Blocks `[1, block_tokens, bytes]` uint8 or batched `[n_layers, block_tokens,
bytes]` uint8, but any shapes and dtypes work. Batching, as measured by `bench/transfer.py` on
CPU: one offer/pull of a *list* of N blocks beats N pulls (about 2.7x for 64 KiB blocks, 1.7x for
1 MiB); `batch_layer_blocks` groups a request's blocks into bounded lists. Blocks that already
sit in one contiguous array (a Full Block `[n_layers, T, B]`) move fastest as that one array while
it is small (about 1.6x faster than the list at 4 MiB, 3x slower at 64 MiB); concatenating blocks
just to send them (`pack_layer_blocks` / `unpack_layer_blocks`) costs more than it saves.

Lifecycle of a transfer:
  sender:   offer(uuid, arrays)  -> pullable once, until pulled or `offer_ttl_s` passes
  receiver: pull(peer, uuid, specs, timeout_s) -> list[jax.Array], or
            TransferTimeout (nothing arrived in time; the channel stays usable), or
            TransferError (peer gone, connection lost, size mismatch)
  both:     close() (or leave the `with` block)

Two implementations, one contract (tests/transfer/test_channel.py runs the same suite on both):
  - `jax_channel.JaxTransferChannel` on `jax.experimental.transfer`: one transfer server per
    engine process.
  - `inprocess_channel.InProcessChannel` on an `InProcessFabric`: channels in one process (tests,
    the in-process cluster).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import hashlib
import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

ArrayLike = jax.Array | np.ndarray
Spec = tuple[tuple[int, ...], Any]  # (shape, dtype)

UUID_BITS = 63
_UUID_MASK = (1 << UUID_BITS) - 1


class TransferError(RuntimeError):
    """A pull failed: the peer is gone, the connection broke, or the specs do not fit the offer."""


class TransferTimeout(TransferError):
    """Nothing arrived within the pull's timeout (unknown uuid, or a peer that never offers)."""


class TransferCancelled(TransferError):
    """The pull's `abort` event was set while it waited (its load was cancelled)."""


@dataclasses.dataclass(frozen=True)
class ChannelStats:
    """A snapshot of one channel's counters (bytes are payload bytes, not wire bytes)."""

    offers: int = 0
    bytes_offered: int = 0
    pulls: int = 0  # successful pulls
    bytes_pulled: int = 0
    timeouts: int = 0
    errors: int = 0  # failed pulls other than timeouts
    outstanding_offers: int = 0


@dataclasses.dataclass(frozen=True)
class Pull:
    """One `KVChannel.pull` as an implementation's `_pull` serves it: the arrays `peer` offered
    under `uuid`, one spec each (`specs` as the caller gave them, `norm` as `(shape, dtype)`
    pairs, at least one), within `timeout_s`, abandoned once `abort` is set."""

    peer: str
    uuid: int
    specs: Sequence[Any]
    norm: list[Spec]
    timeout_s: float
    abort: threading.Event | None = None

    @property
    def where(self) -> str:
        """How errors name the pull: "pull UUID from PEER"."""
        return f"pull {self.uuid} from {self.peer}"

    @property
    def aborted(self) -> bool:
        return self.abort is not None and self.abort.is_set()


def make_uuid(request_id: str, layer: int, part: int = 0, *, epoch: int = 0) -> int:
    """The transfer uuid of (request, layer, part): deterministic, nonzero, 63 bits.

    Both engines compute it from what the control plane already told them, so no uuid is ever
    exchanged. `layer=-1` can name a whole-request transfer (e.g. packed layers); `part` splits a
    layer into several offers; bump `epoch` when a request is retried so a stale offer of the
    previous attempt is never pulled by the new one.
    """
    key = f"{request_id}\x1f{layer}\x1f{part}\x1f{epoch}".encode()
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _UUID_MASK
    return value or 1


def spec_devices(specs: Sequence[Any], default: jax.Device) -> list[jax.Device]:
    """Where each pulled array lands: a spec's one-device `sharding` (a `ShapeDtypeStruct` made
    with one), else `default`. A sharding over several devices is a ValueError."""
    out = []
    for s in specs:
        sharding = getattr(s, "sharding", None)
        if sharding is None:
            out.append(default)
            continue
        devices = sharding.device_set
        if len(devices) != 1:
            raise ValueError(f"pull: a spec's sharding must be one device, got {sharding}")
        out.append(next(iter(devices)))
    return out


def normalize_specs(specs: Sequence[Any]) -> list[tuple[tuple[int, ...], np.dtype]]:
    """`(shape, dtype)` pairs (or anything with `.shape` and `.dtype`) -> canonical tuples."""
    out = []
    for s in specs:
        shape, dtype = (s.shape, s.dtype) if hasattr(s, "shape") else s
        out.append((tuple(int(d) for d in shape), np.dtype(dtype)))
    return out


def spec_nbytes(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)


# --- batching -------------------------------------------------------------------------------


def pack_layer_blocks(blocks: Sequence[ArrayLike]) -> ArrayLike:
    """Concatenate Layer Blocks along axis 0 into one array to offer in a single transfer.

    blocks: n arrays `[k_i, block_tokens, bytes]` (usually k_i = 1) of one dtype and trailing shape.
    Returns `[sum k_i, block_tokens, bytes]`: for the layer blocks of one Full Block this *is* the
    Full Block (no layout conversion). numpy in -> numpy out (a host copy), jax in -> jax out.
    Worth it for transfer only when the result is wanted packed anyway: on CPU the concatenation
    and the receiver's split cost more than one pull of the list saves (see the module docstring).
    """
    if not blocks:
        raise ValueError("pack_layer_blocks: no blocks")
    first = blocks[0]
    for b in blocks:
        if b.shape[1:] != first.shape[1:] or b.dtype != first.dtype:
            raise ValueError(
                f"pack_layer_blocks: block {b.shape}/{b.dtype} does not match "
                f"{first.shape}/{first.dtype}"
            )
    if all(isinstance(b, np.ndarray) for b in blocks):
        return np.concatenate(blocks, axis=0)
    return jax.numpy.concatenate([jax.numpy.asarray(b) for b in blocks], axis=0)


def batch_layer_blocks(nbytes: Sequence[int], max_batch_bytes: int = 64 << 20) -> list[range]:
    """Split blocks (sizes in bytes, in stream order) into consecutive batches for one offer/pull
    each: as few as possible, each at most `max_batch_bytes` (or a single larger block).

    Bounded batches keep layerwise streaming granular: batch i can be used while batch i+1 moves.
    Sender and receiver compute the same ranges from the same sizes (e.g. one uuid per batch via
    `make_uuid(request_id, layer=batch.start)`).
    """
    out, start, acc = [], 0, 0
    for i, n in enumerate(nbytes):
        if i > start and acc + n > max_batch_bytes:
            out.append(range(start, i))
            start, acc = i, 0
        acc += n
    if len(nbytes) > start:
        out.append(range(start, len(nbytes)))
    return out


def packed_spec(specs: Sequence[Any]) -> tuple[tuple[int, ...], np.dtype]:
    """The (shape, dtype) that `pack_layer_blocks` produces from arrays of these specs."""
    norm = normalize_specs(specs)
    if not norm:
        raise ValueError("packed_spec: no specs")
    shape0, dtype0 = norm[0]
    for shape, dtype in norm:
        if shape[1:] != shape0[1:] or dtype != dtype0:
            raise ValueError(f"packed_spec: {shape}/{dtype} does not match {shape0}/{dtype0}")
    return (sum(shape[0] for shape, _ in norm), *shape0[1:]), dtype0


def unpack_layer_blocks(packed: ArrayLike, sizes: int | Sequence[int]) -> list[ArrayLike]:
    """Split a packed array `[sum k_i, T, B]` back into blocks `[k_i, T, B]`.

    sizes: the k_i, or an int n for n equal blocks. Slices of a jax array are new device arrays;
    slices of a numpy array are views.
    """
    total = packed.shape[0]
    if isinstance(sizes, int):
        if sizes <= 0 or total % sizes:
            raise ValueError(f"unpack_layer_blocks: {total} rows do not split into {sizes}")
        sizes = [total // sizes] * sizes
    if sum(sizes) != total:
        raise ValueError(f"unpack_layer_blocks: sizes sum to {sum(sizes)}, array has {total}")
    out, start = [], 0
    for k in sizes:
        out.append(packed[start : start + k])
        start += k
    return out


# --- the interface --------------------------------------------------------------------------


class _Counters:
    """Thread-safe counters behind `ChannelStats` (shared by the implementations)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dataclasses.asdict(ChannelStats())

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v

    def snapshot(self, outstanding: int) -> ChannelStats:
        with self._lock:
            return ChannelStats(**{**self._values, "outstanding_offers": outstanding})


class KVChannel(abc.ABC):
    """One engine's endpoint for KV transfers: offers its arrays and pulls its peers' arrays.

    Thread-safe. `pull` never hangs: it returns, or raises `TransferTimeout` / `TransferError`,
    within about `timeout_s`. `pull_async` runs `pull` on the channel's small thread pool.
    """

    def __init__(self, pull_workers: int = 4):
        self._counters = _Counters()
        self._pull_workers = pull_workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # set by close(): pulls still waiting end at once

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this channel (pass it to their `pull`)."""

    @abc.abstractmethod
    def offer(self, uuid: int, arrays: Sequence[ArrayLike]) -> None:
        """Make `arrays` pullable once under `uuid`; returns at once.

        numpy arrays are copied to the device first; jax arrays are referenced (do not donate or
        delete them until the transfer is done): `JaxTransferChannel` serves an array on one
        local device from that device, and gathers one split over several onto its own. Raises
        ValueError for an empty list, a bad uuid, or a uuid this channel still has outstanding.
        """

    def pull(
        self,
        peer: str,
        uuid: int,
        specs: Sequence[Any],
        timeout_s: float,
        *,
        abort: threading.Event | None = None,
    ) -> list[jax.Array]:
        """Fetch the arrays `peer` offered under `uuid`, as device arrays of this engine.

        specs: one `(shape, dtype)` (or ShapeDtypeStruct) per offered array, in offer order. A
        ShapeDtypeStruct with a one-device sharding lands on that local device (the column
        pieces of a layer go straight to the devices of a mesh); others on the channel's.
        Raises TransferTimeout when nothing arrived within `timeout_s` and TransferError when the
        peer is gone or the transfer failed; the channel stays usable after either. Setting
        `abort` ends the wait early with TransferCancelled (a cancelled load frees its thread).
        A closed channel raises TransferError and an empty `specs` ValueError before anything
        moves.
        """
        self._check_open()
        norm = normalize_specs(specs)
        if not norm:
            raise ValueError("pull: no specs")
        out = self._pull(Pull(peer, uuid, specs, norm, timeout_s, abort))
        self._counters.add(pulls=1, bytes_pulled=spec_nbytes(norm))
        return out

    @abc.abstractmethod
    def _pull(self, pull: Pull) -> list[Any]:
        """The transfer behind `pull`, on an open channel. Counts its own errors and timeouts
        (`_timed_out`); `pull` counts the pull that returns."""

    @abc.abstractmethod
    def outstanding_offers(self) -> int:
        """Offers of this channel that may still be pulled (see each implementation)."""

    def pull_async(
        self,
        peer: str,
        uuid: int,
        specs: Sequence[Any],
        timeout_s: float,
        *,
        abort: threading.Event | None = None,
    ) -> concurrent.futures.Future[list[jax.Array]]:
        """`pull` on the channel's thread pool; the future carries the arrays or the error."""
        self._check_open()
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._pull_workers, thread_name_prefix="kvchannel-pull"
                )
            return self._pool.submit(self.pull, peer, uuid, specs, timeout_s, abort=abort)

    @property
    def stats(self) -> ChannelStats:
        return self._counters.snapshot(self.outstanding_offers())

    def close(self) -> None:
        """Stop serving offers and pulling; idempotent. Queued async pulls are cancelled; running
        ones end by their own deadline."""
        self._closed = True
        self._closing.set()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def __enter__(self) -> KVChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"channel {self.address} is closed")

    def _timed_out(self, pull: Pull, where: str = "") -> TransferTimeout:
        """The `TransferTimeout` of `pull`, which got nothing within its timeout (named by
        `where`, default `pull.where`): counted, for the caller to raise."""
        self._counters.add(timeouts=1)
        return TransferTimeout(f"{where or pull.where}: nothing within {pull.timeout_s:.3g}s")

    @staticmethod
    def _check_aborted(pull: Pull) -> None:
        if pull.aborted:
            raise TransferCancelled(f"{pull.where}: abandoned (its load was cancelled)")

    @staticmethod
    def _check_offer_args(uuid: int, arrays: Sequence[ArrayLike]) -> None:
        if not 0 < uuid <= _UUID_MASK:
            raise ValueError(f"uuid must be in [1, 2**{UUID_BITS}), got {uuid}")
        if not arrays:
            raise ValueError("offer: no arrays")
