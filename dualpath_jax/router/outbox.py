"""What the router's parts send out: messages, events and counters, through one `Outbox`.

Every part of the router (router/router.py) is given the outbox instead of the router: it sends
a message to a connection (`send`), records an event in events.jsonl (`event`), counts what
`GetStats` reports (`count`), or refuses or ends what a reference names (`fail`: counted as an
error, recorded, answered with `Error`). The outbox holds no state of any part but the counters.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath_jax.metrics.events import EventLog
from dualpath_jax.wire import messages
from dualpath_jax.wire.rpc import RpcServer

# The counters of `Router.stats()["counters"]`, in the order they are reported.
COUNTERS = (
    "messages",  # every message the router handled (clients' and engines')
    "requests_done",
    "errors",
    "requeued",
    "engine_deaths",
    "recomputed_blocks",
    "path_pe",
    "path_de",
    "path_split",
    "path_none",
    "hit_blocks",
    "failed",
    "cancelled",
    "overloaded",
    "persist_errors",
    "refused_frames",
    "finished_early",
    "rejoin_orders",  # fetches of engines declared dead, told to register again
    "read_blocks_pe",  # hit blocks assigned to be read on each path
    "read_blocks_de",
    # rounds whose hit was recomputed, all or a leading part, not read (load or recompute); of
    # those, rounds that read the rest of it
    "recompute_hits",
    "recompute_lead_hits",
    "recompute_hit_blocks",
    "sessions_expired",  # closed for being idle cluster.session_idle_timeout_s
    "aborted",  # rounds ended by AbortRounds (a pause or params update with pause="abort")
    "pauses",
    "forks",  # group sampling: rounds started on a DE from their group's prompt pages
    # tool-gap prefetch (router/prefetch.py): started; blocks the DEs reported in memory; turns
    # assigned to the DE holding theirs (and the blocks they took); ended unused
    "prefetch_started",
    "prefetch_blocks",
    "prefetch_used",
    "prefetch_used_blocks",
    "prefetch_skipped",  # no hit, no DE, a gap too short or no memory left
    "prefetch_unused",  # the turn went to another DE
    "prefetch_cancelled",  # the gap ran past prefetch_hold_factor x its expected length
    "prefetch_evicted",  # made room for another
    "prefetch_replaced",  # a new tool call of the same session
    "prefetch_closed",  # its session closed
    "prefetch_lost",  # its DE died
)


class Outbox:
    """Sends on `server`, records to `events` (None: nothing is recorded) at `clock()` time, and
    keeps the router's `counters`."""

    def __init__(self, server: RpcServer, events: EventLog | None, clock: Callable[[], float]):
        self.server = server
        self.events = events
        self.clock = clock
        self.counters = dict.fromkeys(COUNTERS, 0)

    def send(self, ident: bytes, msg: messages.Msg) -> None:
        self.server.send(ident, msg)

    def event(self, kind: str, /, **fields) -> None:
        if self.events is not None:
            self.events.write(kind, t=self.clock(), **fields)

    def count(self, name: str, n: int = 1) -> None:
        """Adds `n` to counter `name` (one of `COUNTERS`)."""
        self.counters[name] += n

    def fail(self, ident: bytes, ref: str, message: str, kind: str = "bad_request") -> None:
        """Refuses or ends what `ref` names: counted, recorded, answered with `Error(kind)`."""
        self.count("errors")
        self.event("error", request=ref, message=message)
        self.send(ident, messages.Error(ref=ref, message=message, kind=kind))
