"""Block stores and KV channels that obey a fault plan (`testing.fault_plan`), for tests and
`bench/chaos.py`.

Not for production. `FaultyStore` and `FaultyChannel` wrap a real `BlockStore` / `KVChannel` and
make the operations a `FaultPlan` names fail, slow down or hang, surfacing each fault the way a
real failure of that operation surfaces, so the code under test takes its real error paths. The
engines build them through `engines.fault_hook.fault_injection(cluster.fault_file, who)`, which
imports this module only when a plan is configured (`Injector`: one plan, both wrappers).

How faults surface:
  store.*        the returned future raises StoreError naming the key and the fault, its
                 `__cause__` the OSError (the real store reports I/O errors on the future). A hang,
                 or a delay of at least the store's `timeout_s`, fails with StoreError "... timed
                 out" after `timeout_s`. Delays and hangs wait on a thread of their own: the call
                 returns its future at once, as the real store's calls do.
  channel.pull   TransferError (cause: the OSError). A hang sleeps the pull's `timeout_s` and
                 raises TransferTimeout; a delay eats into `timeout_s` (one of at least
                 `timeout_s` is a hang). Counted in `stats` as errors / timeouts.
  channel.offer  TransferError. A delay blocks the call (offers are synchronous); a hang drops
                 the offer silently, so the peer's pull waits out its timeout.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from dualpath_jax.kvstore.api import (
    BlockRead,
    BlockReadResult,
    BlockStore,
    StoreError,
    StoreStats,
    WriteReport,
)
from dualpath_jax.testing.fault_plan import FaultPlan
from dualpath_jax.transfer.channel import (
    ArrayLike,
    ChannelStats,
    KVChannel,
    Pull,
    TransferError,
)

# --- futures ---------------------------------------------------------------------------------


def _failed(exc: BaseException) -> futures.Future[Any]:
    fut: futures.Future[Any] = futures.Future()
    fut.set_exception(exc)
    return fut


def _chain(src: futures.Future[Any], dst: futures.Future[Any]) -> None:
    """Completes `dst` with the outcome of `src` once `src` is done."""

    def copy(f: futures.Future[Any]) -> None:
        if f.cancelled():
            dst.set_exception(futures.CancelledError())
        elif f.exception() is not None:
            dst.set_exception(f.exception())
        else:
            dst.set_result(f.result())

    src.add_done_callback(copy)


def _after(
    sleep: Callable[[float], None], seconds: float, fn: Callable[[], futures.Future[Any]]
) -> futures.Future[Any]:
    """A future of `fn()` (itself a future) run after `sleep(seconds)` on a daemon thread, so the
    caller is not blocked and a long hang does not hold up process exit."""
    outer: futures.Future[Any] = futures.Future()

    def run() -> None:
        sleep(seconds)
        if not outer.set_running_or_notify_cancel():
            return
        try:
            inner = fn()
        except Exception as e:
            outer.set_exception(e)
            return
        _chain(inner, outer)

    threading.Thread(target=run, name="fault-delay", daemon=True).start()
    return outer


# --- the block store wrapper -----------------------------------------------------------------


class FaultyStore(BlockStore):
    """A BlockStore that applies a FaultPlan's `store.*` rules to lookup, read_full, read_layers,
    write_full and delete of `inner`; everything else (and any other attribute) is `inner`'s,
    the destinations it reads into too.

    `who` names this engine for the rules' `engines`; `timeout_s` is the store's own I/O timeout
    (StoreConfig.timeout_s; default: `inner.cfg.timeout_s`, else 60), which hangs wait out.
    """

    def __init__(
        self, inner: BlockStore, plan: FaultPlan, who: str = "", timeout_s: float | None = None
    ):
        self.inner = inner
        self.plan = plan
        self.who = who
        self.fmt = inner.fmt
        self.read_destinations = inner.read_destinations
        if timeout_s is None:
            timeout_s = getattr(getattr(inner, "cfg", None), "timeout_s", 60.0)
        self.timeout_s = float(timeout_s)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _faulted(
        self,
        op: str,
        keys: list[str],
        call: Callable[[], futures.Future[Any]],
        owner: str | None = None,
    ) -> futures.Future[Any]:
        hit = self.plan.pick(op, self.who) if keys else None
        if hit is None:
            return call()
        i, rule = hit
        if owner is not None:  # the real store claims at the call, whatever the write's outcome
            self.inner.claim(owner, keys)
        where = f"block {keys[0]}: injected {rule.describe()} into {op} (rule {i})"
        if rule.hang or rule.delay_s >= self.timeout_s:
            err = StoreError(f"{where}: no answer within {self.timeout_s:g} s (timed out)")
            return _after(self.plan.sleep, self.timeout_s, lambda: _failed(err))
        if rule.error is not None:
            cause = rule.oserror()
            err = StoreError(f"{where}: {cause}")
            err.__cause__ = cause
            if not rule.delay_s:
                return _failed(err)
            return _after(self.plan.sleep, rule.delay_s, lambda: _failed(err))
        return _after(self.plan.sleep, rule.delay_s, call)

    def lookup(self, keys: Sequence[str]) -> futures.Future[int]:
        keys = list(keys)
        return self._faulted("store.lookup", keys, lambda: self.inner.lookup(keys))

    def _submit_read(self, read: BlockRead) -> futures.Future[BlockReadResult]:
        def call() -> futures.Future[BlockReadResult]:
            if read.layers is None:
                return self.inner.read_full(read.keys, read.dest)
            return self.inner.read_layers(read.keys, read.layers, read.dest)

        return self._faulted("store.read", read.keys, call)

    def _submit_write(
        self, keys: list[str], blocks: np.ndarray | Sequence[np.ndarray], owner: str | None
    ) -> futures.Future[WriteReport]:
        return self._faulted(
            "store.write", keys, lambda: self.inner.write_full(keys, blocks, owner), owner
        )

    def delete(self, keys: Sequence[str]) -> futures.Future[int]:
        keys = list(keys)
        return self._faulted("store.delete", keys, lambda: self.inner.delete(keys))

    def pin(self, keys: Sequence[str]) -> None:
        self.inner.pin(keys)

    def unpin(self, keys: Sequence[str]) -> futures.Future[int]:
        return self.inner.unpin(keys)

    def claim(self, owner: str, keys: Sequence[str]) -> None:
        self.inner.claim(owner, keys)

    def release(self, owner: str) -> futures.Future[int]:
        return self.inner.release(owner)

    def disown(self, owner: str) -> None:
        self.inner.disown(owner)

    def retain(self, owner: str, state: str, priority: int = 0, ttl_s: float = 0.0) -> None:
        self.inner.retain(owner, state, priority, ttl_s)

    def stats(self) -> StoreStats:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


# --- the channel wrapper ---------------------------------------------------------------------


class FaultyChannel(KVChannel):
    """A KVChannel that applies a FaultPlan's `channel.*` rules to offer and pull of `inner`;
    address, outstanding_offers, close and any other attribute are `inner`'s. `stats` adds the
    injected pull errors and timeouts to `inner`'s counters."""

    def __init__(self, inner: KVChannel, plan: FaultPlan, who: str = "", pull_workers: int = 4):
        super().__init__(pull_workers)
        self.inner = inner
        self.plan = plan
        self.who = who

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def address(self) -> str:
        return self.inner.address

    def offer(self, uuid: int, arrays: Sequence[ArrayLike]) -> None:
        self._check_open()
        hit = self.plan.pick("channel.offer", self.who)
        if hit is None:
            return self.inner.offer(uuid, arrays)
        i, rule = hit
        if rule.delay_s:
            self.plan.sleep(rule.delay_s)
        if rule.error is not None:
            cause = rule.oserror()
            raise TransferError(
                f"offer {uuid}: injected {rule.describe()} into channel.offer (rule {i}): {cause}"
            ) from cause
        if rule.hang:  # accepted, never pullable
            return None
        return self.inner.offer(uuid, arrays)

    def _pull(self, pull: Pull) -> list[Any]:
        hit = self.plan.pick("channel.pull", self.who)
        delay = 0.0
        if hit is not None:
            i, rule = hit
            where = f"{pull.where}: injected {rule.describe()} into channel.pull (rule {i})"
            if rule.hang or rule.delay_s >= pull.timeout_s:
                self._wait(pull.timeout_s, pull)
                raise self._timed_out(pull, where)
            delay = rule.delay_s
            if delay:
                self._wait(delay, pull)
            if rule.error is not None:
                self._counters.add(errors=1)
                cause = rule.oserror()
                raise TransferError(f"{where}: {cause}") from cause
        return self.inner.pull(
            pull.peer, pull.uuid, pull.specs, pull.timeout_s - delay, abort=pull.abort
        )

    def _wait(self, seconds: float, pull: Pull) -> None:
        """Sleeps like a hanging `pull`; a set `abort` ends it as it would end a real one."""
        abort = pull.abort
        if abort is None and self.plan.sleep is not time.sleep:
            self.plan.sleep(seconds)  # a test's clock
            return
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if abort is not None and abort.wait(min(left, 0.1)):
                self._check_aborted(pull)
            if abort is None:
                time.sleep(min(left, 0.1))
            if self._closing.is_set():
                raise TransferError(f"{pull.where}: channel closed")

    def outstanding_offers(self) -> int:
        return self.inner.outstanding_offers()

    @property
    def stats(self) -> ChannelStats:
        base = self.inner.stats
        mine = self._counters.snapshot(0)
        return dataclasses.replace(
            base, timeouts=base.timeouts + mine.timeouts, errors=base.errors + mine.errors
        )

    def close(self) -> None:
        super().close()
        self.inner.close()


def wrap_store(
    store: BlockStore, plan: FaultPlan | None, who: str, timeout_s: float | None = None
) -> BlockStore:
    """`store` itself without a plan, else a FaultyStore of it for engine `who`."""
    return store if plan is None else FaultyStore(store, plan, who, timeout_s)


def wrap_channel(channel: KVChannel, plan: FaultPlan | None, who: str) -> KVChannel:
    """`channel` itself without a plan, else a FaultyChannel of it for engine `who`."""
    return channel if plan is None else FaultyChannel(channel, plan, who)


@dataclasses.dataclass(frozen=True)
class Injector:
    """The plan of one process and the engine it is (`who`): wraps that process's store and
    channel so both obey the plan (what `engines.fault_hook.fault_injection` returns with a
    plan)."""

    plan: FaultPlan
    who: str

    def store(self, store: BlockStore) -> BlockStore:
        return FaultyStore(store, self.plan, self.who)

    def channel(self, channel: KVChannel) -> KVChannel:
        return FaultyChannel(channel, self.plan, self.who)

    def params_bucket(self, arrays: list[Any]) -> list[Any]:
        """A pulled bucket of a streamed params update, as the plan's `params.bucket` rules
        leave it: delayed, failed (OSError) or with its first bytes flipped (`corrupt`)."""
        hit = self.plan.pick("params.bucket", self.who)
        if hit is None:
            return arrays
        i, rule = hit
        if rule.delay_s:
            self.plan.sleep(rule.delay_s)
        if rule.error is not None:
            cause = rule.oserror()
            raise OSError(
                cause.errno, f"injected {rule.describe()} into params.bucket (rule {i})"
            ) from cause
        if rule.corrupt and arrays:
            arrays = [_flip_bytes(arrays[0]), *arrays[1:]]
        return arrays


def _flip_bytes(a: Any, n: int = 8) -> Any:
    """A copy of array `a` (on its device) with its first `n` bytes inverted."""
    import jax

    host = np.array(a)  # a copy
    raw = host.reshape(-1).view(np.uint8)
    raw[:n] ^= 0xFF
    return jax.device_put(host, a.sharding) if isinstance(a, jax.Array) else host
