"""Rounds the router holds instead of starting them: submitted during a params update
(router/params_update.py) or while generation is paused (router/pause.py). They keep their
order, count with the queued rounds against `max_queue` (one over it is refused as
`overloaded`), end here when their client cancels them, and are handed back (`take_all`, or
`take` those an abort picks) for the router to start."""

from __future__ import annotations

from collections.abc import Callable

from dualpath_jax.router.outbox import Outbox
from dualpath_jax.wire import messages

Held = tuple[bytes, messages.Submit]  # (client, its Submit)


class HeldRounds:
    def __init__(self, out: Outbox, queued: Callable[[], int], max_queue: int):
        self.out = out
        self.queued = queued  # rounds queued in the scheduler
        self.max_queue = max_queue
        self.rounds: list[Held] = []

    def __len__(self) -> int:
        return len(self.rounds)

    def hold(self, ident: bytes, msg: messages.Submit, why: str) -> None:
        """Holds `msg`, or refuses it as `overloaded` past `max_queue` (`why` they are held)."""
        queued = self.queued() + len(self.rounds)
        if queued >= self.max_queue:
            self.out.count("overloaded")
            self.out.fail(
                ident,
                msg.request,
                f"overloaded: {queued} requests queued (max_queue={self.max_queue}), "
                f"{len(self.rounds)} of them held {why}",
                kind="overloaded",
            )
            return
        self.rounds.append((ident, msg))

    def holds(self, session: str, ident: bytes | None = None) -> bool:
        """Whether a round of `session` (submitted by `ident`, if given) is held."""
        return any(m.session == session and ident in (None, i) for i, m in self.rounds)

    def cancel(self, ident: bytes, msg: messages.CancelRound) -> bool:
        """Ends `ident`'s held round `msg.request` as cancelled; False if there is none."""
        for i, (who, sub) in enumerate(self.rounds):
            if sub.request == msg.request and who == ident:
                del self.rounds[i]
                self.out.count("cancelled")
                self.out.fail(ident, msg.request, "cancelled by the client", kind="cancelled")
                return True
        return False

    def take(self, chosen: Callable[[messages.Submit], bool]) -> list[Held]:
        """Removes and returns the held rounds `chosen` picks, in order."""
        out = [(who, sub) for who, sub in self.rounds if chosen(sub)]
        self.rounds = [(who, sub) for who, sub in self.rounds if not chosen(sub)]
        return out

    def take_all(self) -> list[Held]:
        out, self.rounds = self.rounds, []
        return out
