"""The router's pause part: `Pause` / `Resume` (RL trainers pause generation around a weight
update, then resume it).

While paused, new rounds are held here (counted with the queued ones against `max_queue`, one
over it refused as `overloaded`) and released in order on `Resume`; a held round its client
cancels ends here. A `Pause` is answered once no round is in flight: with mode "wait" the
running rounds finish first, with "abort" the router ends them at once (`Rounds.on_abort`) and
the answer comes when their partial results are out; with "keep" at once, the router having
told the decode engines to halt (`PauseDecode`: the rounds stay, with their KV, until resumed).
Pausing twice changes nothing but the mode; resuming an unpaused router is answered at once.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath_jax.router.held import HeldRounds
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.wire import messages


class PauseGate:
    """Whether the router starts rounds (`paused`), the rounds `held` meanwhile and the clients
    whose `Pause` waits for the rounds in flight (`in_flight()`) to end."""

    def __init__(
        self,
        out: Outbox,
        in_flight: Callable[[], int],
        *,
        queued: Callable[[], int] = lambda: 0,
        max_queue: int = 1 << 30,
    ):
        self.out = out
        self.in_flight = in_flight
        self.mode = ""  # "": not paused, else the Pause's mode
        self.held = HeldRounds(out, queued, max_queue)
        self.released: list[tuple[bytes, messages.Submit]] = []
        self.waiting: list[tuple[bytes, str]] = []  # (client, ref) of Pauses not yet answered

    @property
    def paused(self) -> bool:
        return bool(self.mode)

    def on_pause(self, ident: bytes, msg: messages.Pause) -> bool:
        """Pauses; False (the client told why) for an unknown mode."""
        if msg.mode not in messages.PAUSE_MODES:
            self.out.fail(
                ident,
                msg.ref,
                f"pause mode must be one of {messages.PAUSE_MODES}, got {msg.mode!r}",
            )
            return False
        self.mode = msg.mode
        self.out.count("pauses")
        self.out.event("pause", mode=msg.mode, in_flight=self.in_flight())
        if msg.mode == "keep":  # the rounds stay in flight, halted: answered at once
            self.out.send(ident, messages.Ack(ref=msg.ref))
        else:
            self.waiting.append((ident, msg.ref))
        return True

    def on_resume(self, ident: bytes, msg: messages.Resume) -> None:
        if self.paused:
            self.out.event("resume", held=len(self.held))
        self.mode = ""
        for who, ref in self.waiting:  # a pause never reached: it ends here
            self.out.fail(who, ref, "resumed before the rounds in flight ended", kind="cancelled")
        self.waiting = []
        self.released += self.held.take_all()
        self.out.send(ident, messages.Ack(ref=msg.ref))

    def advance(self) -> None:
        """Answers the pending `Pause`s once no round is in flight."""
        if self.waiting and not self.in_flight():
            for who, ref in self.waiting:
                self.out.send(who, messages.Ack(ref=ref))
            self.waiting = []

    def hold(self, ident: bytes, msg: messages.Submit) -> bool:
        """Holds a round submitted while paused (True; one beyond `max_queue` is refused as
        `overloaded`, True too); False when not paused."""
        if not self.paused:
            return False
        self.held.hold(ident, msg, "while generation is paused")
        return True

    def take_released(self) -> list[tuple[bytes, messages.Submit]]:
        released, self.released = self.released, []
        return released
