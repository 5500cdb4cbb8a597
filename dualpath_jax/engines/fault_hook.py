"""The engines' one entry to test fault injection: `cluster.fault_file`.

Without a fault plan (`fault_file` "", every deployment) a process uses the store and the channel
it opens as they are and never imports the testing wing; with one, both are wrapped so they obey
the plan, as is each bucket of a streamed params update it pulls (`params_bucket`) (`dualpath_jax.testing`: `FaultyStore`, `FaultyChannel`, one `FaultPlan` per process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dualpath_jax.kvstore.api import BlockStore
    from dualpath_jax.transfer.channel import KVChannel


class Faults(Protocol):
    """What a process passes its store and its channel through."""

    def store(self, store: BlockStore) -> BlockStore: ...

    def channel(self, channel: KVChannel) -> KVChannel: ...

    params_bucket: Callable[[list[Any]], list[Any]] | None


class NoFaults:
    """No fault plan: the store and the channel as they are."""

    def store(self, store: BlockStore) -> BlockStore:
        return store

    def channel(self, channel: KVChannel) -> KVChannel:
        return channel

    params_bucket = None  # each pulled bucket of a streamed params update as it is


def fault_injection(fault_file: str, who: str) -> Faults:
    """`NoFaults()` without a plan; else the testing wing's `Injector` of the plan at
    `fault_file` for engine `who` ("router", "pe0", "de1", ...). A plan that fails validation
    raises ValueError; a missing file is a plan without faults (it may appear later)."""
    if not fault_file:
        return NoFaults()
    from dualpath_jax.testing.fault_plan import FaultPlan
    from dualpath_jax.testing.faulty import Injector

    return Injector(FaultPlan(fault_file), who)
