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
  - `JaxTransferChannel` on `jax.experimental.transfer`: one transfer server per engine process.
  - `InProcessChannel` on an `InProcessFabric`: channels in one process (tests, the simulator).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import datetime
import hashlib
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from dualpath_jax import copies

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


def _aborted(abort: threading.Event | None, peer: str, uuid: int) -> None:
    if abort is not None and abort.is_set():
        raise TransferCancelled(f"pull {uuid} from {peer}: abandoned (its load was cancelled)")


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

    @abc.abstractmethod
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
        """

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

    @staticmethod
    def _check_offer_args(uuid: int, arrays: Sequence[ArrayLike]) -> None:
        if not 0 < uuid <= _UUID_MASK:
            raise ValueError(f"uuid must be in [1, 2**{UUID_BITS}), got {uuid}")
        if not arrays:
            raise ValueError("offer: no arrays")


# --- jax.experimental.transfer ----------------------------------------------------------------


class JaxTransferChannel(KVChannel):
    """KVChannel on `jax.experimental.transfer`: a transfer server plus cached peer connections.

    Create one per engine process (each owns a transfer server on `bind`). A pull issues the
    transfer (non-blocking in JAX) and polls the result arrays' readiness until its deadline, so no
    thread is ever left blocked. While it waits (every `probe_every_s`) and at its deadline the
    peer's port is probed: a refused connection means the peer is gone (TransferError), otherwise
    the deadline gives TransferTimeout. A peer process that dies breaks the connection and fails
    its pending pulls at once. A connection that failed is
    dropped and the next pull to that peer reconnects (e.g. to a restarted engine on the same
    address); pulls to a new address open a new connection.

    Leaks and limits (of the underlying library, measured with jax 0.10):
      - A pull that timed out stays registered in the connection, holding its destination buffers
        until the peer offers that uuid or the connection closes. No thread is leaked.
      - Unpulled offers hold their device arrays until `offer_ttl_s` passes (then the server drops
        them; a later pull times out) or forever when `offer_ttl_s` is None. The sender cannot see
        when an offer is pulled, so `outstanding_offers()` counts offers younger than the TTL.
      - Only the byte size of `specs` is checked by the library: a size mismatch raises
        TransferError, while same-size specs of another dtype/shape reinterpret the bytes.
      - Offering a uuid twice leaves the second offer unpullable; this channel rejects a uuid that
        is still outstanding.
      - `close()` drops the server; peers' waiting pulls see the port refuse within
        `probe_every_s` and fail with TransferError.
    """

    def __init__(
        self,
        device: jax.Device | None = None,
        *,
        bind: str = "127.0.0.1:0",
        transport_addresses: Sequence[str] = ("127.0.0.1:0",) * 4,
        use_raw_buffers: bool = True,
        offer_ttl_s: float | None = 120.0,
        probe_every_s: float = 1.0,
        pull_workers: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ):
        """device: where offers are served from and pulls land (default: the first local device).
        bind / transport_addresses: control and bulk-data listen addresses (loopback by default);
          several bulk-data sockets and raw buffers gave ~20% more throughput for 64 MiB blocks on
          CPU (bench/transfer.py). Peers may use different settings.
        probe_every_s: while a pull waits, check this often that the peer still listens, so a
          closed peer fails the pull early instead of at its deadline.
        """
        super().__init__(pull_workers)
        from jax.experimental import transfer as jax_transfer

        self._device = device if device is not None else jax.local_devices()[0]
        self._sharding = SingleDeviceSharding(self._device)
        if not transport_addresses:
            raise ValueError("transport_addresses must not be empty")
        self._server = jax_transfer.start_transfer_server(
            self._device.client, bind, list(transport_addresses), use_raw_buffers=use_raw_buffers
        )
        self._address = self._server.address()
        self._offer_ttl_s = offer_ttl_s
        self._probe_every_s = probe_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._connections: dict[str, Any] = {}
        self._offers: dict[int, float] = {}  # uuid -> expiry (clock), inf without a TTL

    @property
    def address(self) -> str:
        return self._address

    @property
    def device(self) -> jax.Device:
        return self._device

    def offer(self, uuid: int, arrays: Sequence[ArrayLike]) -> None:
        self._check_open()
        self._check_offer_args(uuid, arrays)
        on_device = [self._to_device(a) for a in arrays]
        now = self._clock()
        with self._lock:
            self._prune_offers(now)
            if uuid in self._offers:
                raise ValueError(f"uuid {uuid} is still offered by {self._address}")
            self._offers[uuid] = now + self._offer_ttl_s if self._offer_ttl_s else math.inf
        if self._offer_ttl_s is None:
            self._server.await_pull(uuid, on_device)
        else:
            # The library wants an absolute wall-clock deadline.
            expiry = datetime.datetime.now() + datetime.timedelta(seconds=self._offer_ttl_s)
            self._server.await_pull(uuid, on_device, timeout=expiry)
        self._counters.add(offers=1, bytes_offered=sum(int(a.nbytes) for a in on_device))

    def pull(
        self,
        peer: str,
        uuid: int,
        specs: Sequence[Any],
        timeout_s: float,
        *,
        abort: threading.Event | None = None,
    ) -> list[jax.Array]:
        self._check_open()
        norm = normalize_specs(specs)
        if not norm:
            raise ValueError("pull: no specs")
        deadline = self._clock() + timeout_s
        devices = spec_devices(specs, self._device)
        structs = [
            jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(dev))
            for (s, d), dev in zip(norm, devices)
        ]
        try:
            conn = self._connection(peer)
            out = list(conn.pull(uuid, structs))
        except TransferError:
            self._counters.add(errors=1)
            raise
        except Exception as e:  # the library raises JaxRuntimeError / RuntimeError
            self._counters.add(errors=1)
            self._drop_connection(peer)
            raise TransferError(f"pull {uuid} from {peer}: {e}") from e
        ready = self._wait_ready(out, deadline, peer, abort)
        _aborted(abort, peer, uuid)
        if self._closing.is_set():
            raise TransferError(f"pull {uuid} from {peer}: channel {self._address} closed")
        if ready is None or (not ready and not _port_accepts(peer)):
            self._counters.add(errors=1)
            self._drop_connection(peer)
            raise TransferError(f"pull {uuid} from {peer}: peer is gone")
        if not ready:
            self._counters.add(timeouts=1)
            raise TransferTimeout(f"pull {uuid} from {peer}: nothing within {timeout_s:.3g}s")
        try:
            for a in out:
                a.block_until_ready()  # ready already; raises the transfer's error if any
        except Exception as e:
            self._counters.add(errors=1)
            self._drop_connection(peer)
            raise TransferError(f"pull {uuid} from {peer}: {e}") from e
        self._counters.add(pulls=1, bytes_pulled=spec_nbytes(norm))
        return out

    def outstanding_offers(self) -> int:
        with self._lock:
            self._prune_offers(self._clock())
            return len(self._offers)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        with self._lock:
            self._connections.clear()
            self._offers.clear()
        # Dropping the last reference stops the server (and frees unpulled offers).
        self._server = None

    # -- internals

    def _to_device(self, a: ArrayLike) -> jax.Array:
        # An array on one device of this process is served from there (the transfer server
        # reaches every local device: the column pieces of a mesh's rows go out from the
        # devices that hold them); one split over several devices is gathered onto ours.
        if isinstance(a, jax.Array) and len(a.sharding.device_set) == 1:
            return a
        return copies.to_device(a, "channel_offer", self._sharding)

    def _prune_offers(self, now: float) -> None:
        for u in [u for u, t in self._offers.items() if t <= now]:
            del self._offers[u]

    def _connection(self, peer: str) -> Any:
        with self._lock:
            conn = self._connections.get(peer)
        if conn is not None:
            return conn
        # Connecting to a dead address "succeeds" and its pulls hang; fail fast instead.
        if not _port_accepts(peer):
            raise TransferError(f"peer {peer} is not listening")
        conn = self._server.connect(peer)
        with self._lock:
            return self._connections.setdefault(peer, conn)

    def _drop_connection(self, peer: str) -> None:
        with self._lock:
            self._connections.pop(peer, None)

    def _wait_ready(
        self,
        arrays: list[jax.Array],
        deadline: float,
        peer: str,
        abort: threading.Event | None = None,
    ) -> bool | None:
        """True when all arrays are ready (or failed), False at the deadline (or once `abort`
        is set), None if the peer stopped listening meanwhile."""
        pending = arrays
        nap = 20e-6
        next_probe = self._clock() + self._probe_every_s
        while True:
            pending = [a for a in pending if not a.is_ready()]
            if not pending:
                return True
            now = self._clock()
            if now >= deadline or self._closing.is_set() or (abort is not None and abort.is_set()):
                return False
            if now >= next_probe:
                if not _port_accepts(peer):
                    return None
                next_probe = self._clock() + self._probe_every_s
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, 1e-3)


def _port_accepts(address: str, timeout_s: float = 0.5) -> bool:
    """Whether something listens at "host:port" (a TCP connect; "[v6]:port" works too)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


# --- in-process -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Slot:
    arrays: list[jax.Array]
    expiry: float


class InProcessFabric:
    """The shared registry of in-process channels: offers keyed by (address, uuid).

    `kill(address)` emulates a dead engine: its offers vanish, pulls waiting on it and later pulls
    from it raise TransferError, and the killed channel itself can no longer offer or pull.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._cond = threading.Condition()
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._live: set[str] = set()
        self._dead: set[str] = set()
        self._next = 0

    def register(self, name: str | None = None) -> str:
        with self._cond:
            self._next += 1
            address = f"inproc://{name or 'ch'}-{self._next}"
            self._live.add(address)
            return address

    def kill(self, address: str) -> None:
        with self._cond:
            self._live.discard(address)
            self._dead.add(address)
            for key in [k for k in self._slots if k[0] == address]:
                del self._slots[key]
            self._cond.notify_all()

    def is_alive(self, address: str) -> bool:
        with self._cond:
            return address in self._live

    def put(self, address: str, uuid: int, arrays: list[jax.Array], expiry: float) -> None:
        with self._cond:
            if address not in self._live:
                raise TransferError(f"{address} is dead")
            slot = self._slots.get((address, uuid))
            if slot is not None and slot.expiry > self.clock():
                raise ValueError(f"uuid {uuid} is still offered by {address}")
            self._slots[(address, uuid)] = _Slot(arrays, expiry)
            self._cond.notify_all()

    def take(
        self,
        peer: str,
        uuid: int,
        deadline: float,
        *stops: threading.Event | None,
    ) -> list[jax.Array] | None:
        """Remove and return the offer, None at the deadline (or once one of `stops` is set);
        TransferError if `peer` dies."""
        key = (peer, uuid)
        stops = tuple(e for e in stops if e is not None)
        with self._cond:
            while True:
                if any(e.is_set() for e in stops):
                    return None
                if peer not in self._live:
                    raise TransferError(
                        f"peer {peer} is {'gone' if peer in self._dead else 'unknown'}"
                    )
                now = self.clock()
                slot = self._slots.get(key)
                if slot is not None and slot.expiry > now:
                    del self._slots[key]
                    return slot.arrays
                if now >= deadline:
                    return None
                self._cond.wait(min(0.05, deadline - now) if stops else deadline - now)

    def outstanding(self, address: str) -> int:
        with self._cond:
            now = self.clock()
            return sum(1 for (a, _), s in self._slots.items() if a == address and s.expiry > now)


class InProcessChannel(KVChannel):
    """KVChannel between threads of one process, over an `InProcessFabric`.

    Same contract as `JaxTransferChannel`, stricter checks: specs must match the offered shapes and
    dtypes exactly (else TransferError). Offers are device arrays (numpy is copied at offer time);
    pulls return jax arrays on this channel's device. `outstanding_offers()` is exact here: offers
    neither pulled nor past `offer_ttl_s`. `close()` is `fabric.kill(address)`.
    """

    def __init__(
        self,
        fabric: InProcessFabric,
        name: str | None = None,
        *,
        device: jax.Device | None = None,
        offer_ttl_s: float | None = 120.0,
        pull_workers: int = 4,
    ):
        super().__init__(pull_workers)
        self._fabric = fabric
        self._address = fabric.register(name)
        self._device = device if device is not None else jax.local_devices()[0]
        self._offer_ttl_s = offer_ttl_s

    @property
    def address(self) -> str:
        return self._address

    def offer(self, uuid: int, arrays: Sequence[ArrayLike]) -> None:
        self._check_open()
        self._check_offer_args(uuid, arrays)
        on_device = [copies.to_device(a, "channel_offer", self._device) for a in arrays]
        ttl = math.inf if self._offer_ttl_s is None else self._offer_ttl_s
        self._fabric.put(self._address, uuid, on_device, self._fabric.clock() + ttl)
        self._counters.add(offers=1, bytes_offered=sum(int(a.nbytes) for a in on_device))

    def pull(
        self,
        peer: str,
        uuid: int,
        specs: Sequence[Any],
        timeout_s: float,
        *,
        abort: threading.Event | None = None,
    ) -> list[jax.Array]:
        self._check_open()
        norm = normalize_specs(specs)
        if not norm:
            raise ValueError("pull: no specs")
        devices = spec_devices(specs, self._device)
        if not self._fabric.is_alive(self._address):
            raise TransferError(f"channel {self._address} was killed")
        try:
            arrays = self._fabric.take(
                peer, uuid, self._fabric.clock() + timeout_s, abort, self._closing
            )
        except TransferError:
            self._counters.add(errors=1)
            raise
        _aborted(abort, peer, uuid)
        if arrays is None:
            self._counters.add(timeouts=1)
            raise TransferTimeout(f"pull {uuid} from {peer}: nothing within {timeout_s:.3g}s")
        got = [(tuple(a.shape), np.dtype(a.dtype)) for a in arrays]
        if got != norm:
            self._counters.add(errors=1)
            raise TransferError(f"pull {uuid} from {peer}: offered {got}, specs {norm}")
        out = [jax.device_put(a, dev) for a, dev in zip(arrays, devices)]
        self._counters.add(pulls=1, bytes_pulled=spec_nbytes(norm))
        return out

    def outstanding_offers(self) -> int:
        return self._fabric.outstanding(self._address)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._fabric.kill(self._address)
