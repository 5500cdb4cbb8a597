"""`JaxTransferChannel`: the KVChannel (channel.py) of engine processes, on
`jax.experimental.transfer`: one transfer server per process, pulls over cached connections."""

from __future__ import annotations

import datetime
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from dualpath_jax import copies
from dualpath_jax.transfer.channel import (
    ArrayLike,
    KVChannel,
    Pull,
    TransferError,
    spec_devices,
)


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
        use_raw_buffers: bool | None = None,
        offer_ttl_s: float | None = 120.0,
        probe_every_s: float = 1.0,
        pull_workers: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ):
        """device: where offers are served from and pulls land (default: the first local device).
        bind / transport_addresses: control and bulk-data listen addresses (loopback by default);
          several bulk-data sockets and raw buffers gave ~20% more throughput for 64 MiB blocks on
          CPU (bench/transfer.py). Peers may use different settings.
        use_raw_buffers: None (default) uses them on CPU only: the CUDA PJRT plugin of jax
          0.11.2 refuses an offer from device memory with raw buffers ("UNIMPLEMENTED: RawBuffer
          extension not implemented in this PJRT plugin", seen on an H200).
        probe_every_s: while a pull waits, check this often that the peer still listens, so a
          closed peer fails the pull early instead of at its deadline.
        """
        super().__init__(pull_workers)
        from jax.experimental import transfer as jax_transfer

        self._device = device if device is not None else jax.local_devices()[0]
        self._sharding = SingleDeviceSharding(self._device)
        if use_raw_buffers is None:
            use_raw_buffers = self._device.platform == "cpu"
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

    def _pull(self, pull: Pull) -> list[jax.Array]:
        peer = pull.peer
        deadline = self._clock() + pull.timeout_s
        devices = spec_devices(pull.specs, self._device)
        structs = [
            jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(dev))
            for (s, d), dev in zip(pull.norm, devices)
        ]
        try:
            conn = self._connection(peer)
            out = list(conn.pull(pull.uuid, structs))
        except TransferError:
            self._counters.add(errors=1)
            raise
        except Exception as e:  # the library raises JaxRuntimeError / RuntimeError
            self._counters.add(errors=1)
            self._drop_connection(peer)
            raise TransferError(f"{pull.where}: {e}") from e
        ready = self._wait_ready(out, deadline, peer, pull.abort)
        self._check_aborted(pull)
        if self._closing.is_set():
            raise TransferError(f"{pull.where}: channel {self._address} closed")
        if ready is None or (not ready and not _port_accepts(peer)):
            self._counters.add(errors=1)
            self._drop_connection(peer)
            raise TransferError(f"{pull.where}: peer is gone")
        if not ready:
            raise self._timed_out(pull)
        try:
            for a in out:
                a.block_until_ready()  # ready already; raises the transfer's error if any
        except Exception as e:
            self._counters.add(errors=1)
            self._drop_connection(peer)
            raise TransferError(f"{pull.where}: {e}") from e
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
