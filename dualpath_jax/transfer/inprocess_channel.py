"""`InProcessChannel`: the KVChannel (channel.py) between threads of one process, its offers in a
shared `InProcessFabric` (the in-process cluster, tests). `fabric.kill(address)` emulates a dead
engine."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dualpath_jax import copies
from dualpath_jax.transfer.channel import (
    ArrayLike,
    KVChannel,
    Pull,
    TransferError,
    spec_devices,
)


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

    def _pull(self, pull: Pull) -> list[jax.Array]:
        devices = spec_devices(pull.specs, self._device)
        if not self._fabric.is_alive(self._address):
            raise TransferError(f"channel {self._address} was killed")
        deadline = self._fabric.clock() + pull.timeout_s
        try:
            arrays = self._fabric.take(pull.peer, pull.uuid, deadline, pull.abort, self._closing)
        except TransferError:
            self._counters.add(errors=1)
            raise
        self._check_aborted(pull)
        if arrays is None:
            raise self._timed_out(pull)
        got = [(tuple(a.shape), np.dtype(a.dtype)) for a in arrays]
        if got != pull.norm:
            self._counters.add(errors=1)
            raise TransferError(f"{pull.where}: offered {got}, specs {pull.norm}")
        return [jax.device_put(a, dev) for a, dev in zip(arrays, devices)]

    def outstanding_offers(self) -> int:
        return self._fabric.outstanding(self._address)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._fabric.kill(self._address)
