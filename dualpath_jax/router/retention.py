"""Session retention, the router's part (docs/kv_events.md): which sessions' stored blocks to keep.

Under `store.eviction="retention"` a store evicts the blocks of ended sessions first, then those
of idle sessions past their TTL, lower priorities first. `Retention` holds each open session's
settings (`priority`, `ttl_s`, from `OpenSession` and each `Submit`) and where it stands:

    opened --round_started--> active --round_ended--> idle (for its TTL) --closed--> ended

Each change is a `Retain` that goes to the router's own store and to every live decode engine's
(their stores index the blocks they persist); a decode engine that registers learns where every
open session stands (`engine_joined`). The sessions part tells it when a session opens, a round
starts or ends, and a session closes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from dualpath_jax.kvstore.store import BlockStore
from dualpath_jax.router.liveness import EngineInfo, EngineRegistry
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.wire import messages


def retention_problem(priority: int | None, ttl_s: float | None) -> str:
    """Why a session's retention settings are unusable ("" if they are fine; None: unchanged)."""
    if priority is not None and not -(2**31) <= priority < 2**31:
        return f"retention priority must fit in 32 bits, got {priority}"
    if ttl_s is not None and not (ttl_s == -1 or 0 <= ttl_s <= 1e9):
        return f"retention ttl_s must be -1 (the default) or lie in [0, 1e9] seconds, got {ttl_s}"
    return ""


@dataclasses.dataclass
class SessionRetention:
    priority: int = 0  # retention of its stored blocks (messages.OpenSession)
    ttl_s: float = -1.0  # -1: store.retention_ttl_s
    active: bool = False  # one of its rounds runs
    retained_until: float = -math.inf  # when its last round's retention ends (router clock)


class Retention:
    """Open sessions' retention (`retention[session]`). `default_ttl_s` is
    `store.retention_ttl_s`; `registry` names the live decode engines."""

    def __init__(
        self,
        store: BlockStore,
        default_ttl_s: float,
        registry: EngineRegistry,
        out: Outbox,
        clock: Callable[[], float],
    ):
        self.store = store
        self.default_ttl_s = default_ttl_s
        self.registry = registry
        self.out = out
        self.clock = clock
        self.sessions: dict[str, SessionRetention] = {}

    def __getitem__(self, session: str) -> SessionRetention:
        return self.sessions[session]

    # ------------------------------------------------------------------ sessions

    def opened(self, session: str, priority: int | None, ttl_s: float | None, resume: bool) -> None:
        """A session opened, or resumed with new settings (its blocks' retention takes them;
        None keeps a resumed session's, a new one's default)."""
        r = self.sessions.setdefault(session, SessionRetention())
        if priority is not None:
            r.priority = priority
        if ttl_s is not None:
            r.ttl_s = ttl_s
        if resume:
            self._tell(self._current(session, r))

    def round_started(self, session: str, priority: int | None, ttl_s: float | None) -> None:
        """A round runs: the session is active, with the round's settings where it names any."""
        r = self.sessions.get(session)
        if r is None:
            return
        if priority is not None:
            r.priority = priority
        if ttl_s is not None:
            r.ttl_s = ttl_s
        r.active = True
        self._tell(self._retain(session, r, "active"))

    def round_ended(self, session: str) -> None:
        """The round finished or failed: the session is idle for its TTL."""
        r = self.sessions.get(session)
        if r is None:  # closed meanwhile
            return
        r.active = False
        r.retained_until = self.clock() + self._ttl(r)
        self._tell(self._retain(session, r, "idle"))

    def closed(self, session: str) -> None:
        self.sessions.pop(session, None)
        self._tell(messages.Retain(session=session, state="ended"))

    # ------------------------------------------------------------------ engines

    def engine_joined(self, e: EngineInfo, msg: messages.Register) -> None:
        """A (re)started decode engine learns where every open session stands."""
        if e.role != "decode":
            return
        for session, r in list(self.sessions.items()):
            retain = self._current(session, r)
            if retain is not None:
                self.out.send(e.ident, retain)

    # ------------------------------------------------------------------ messages

    def _ttl(self, r: SessionRetention) -> float:
        return self.default_ttl_s if r.ttl_s < 0 else r.ttl_s

    def _retain(self, session: str, r: SessionRetention, state: str) -> messages.Retain:
        return messages.Retain(
            session=session, state=state, priority=r.priority, ttl_s=self._ttl(r)
        )

    def _current(self, session: str, r: SessionRetention) -> messages.Retain | None:
        """Where the session stands: active while a round runs, idle for what is left of its
        TTL, nothing to tell once that is over."""
        if r.active:
            return self._retain(session, r, "active")
        now = self.clock()
        if r.retained_until > now:
            return messages.Retain(
                session=session, state="idle", priority=r.priority, ttl_s=r.retained_until - now
            )
        return None

    def _tell(self, msg: messages.Retain | None) -> None:
        """The router's store and every live decode engine's learn `msg`."""
        if msg is None:
            return
        self.store.retain(msg.session, msg.state, msg.priority, msg.ttl_s)
        for e in self.registry.live("decode"):
            self.out.send(e.ident, msg)
