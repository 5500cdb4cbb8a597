"""The engine interface: what the prefill and decode engines are to the runtimes that drive them.

An engine is a state machine driven by one loop (`drive`):

    engine.register()                     # announce itself to the router
    while not engine.stopped:
        handle every control message      # engine.handle(msg)
        send what other threads queued    # engine.outbox (store KV events, workers' reports)
        engine.step()                     # fetch work, advance loads, run one batch or step

`Engine` is that contract; `PrefillEngine` and `DecodeEngine` implement it, and
`runtimes.build.build_engine` assembles either the same way for every runtime (a process of
`LocalCluster` or `launch/engine.py`, a thread of `InProcessCluster`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Protocol

from dualpath_jax.engines.common import pump
from dualpath_jax.wire import messages

ROLES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class EngineId:
    """Who an engine is: its role, id (unique across roles), node (its storage NIC) and group."""

    role: str  # prefill | decode
    engine: int
    node: int
    group: int = 0

    @property
    def name(self) -> str:
        """`pe3` / `de4`: the engine's name in links, owners and logs."""
        return f"{'pe' if self.role == 'prefill' else 'de'}{self.engine}"


class ControlLink(Protocol):
    """The engine's control connection to the router (an `RpcClient`)."""

    def send(self, msg: messages.Msg) -> None: ...

    def recv(self, timeout_ms: int) -> messages.Msg | None: ...

    def close(self) -> None: ...


class Engine(Protocol):
    """What the loop drives. `stopped` turns true when the router orders a stop."""

    who: EngineId
    stopped: bool
    outbox: queue.Queue[messages.Msg]
    control: ControlLink

    def register(self) -> None:
        """Announces the engine (channel address, params version, devices, cost model)."""

    def handle(self, msg: messages.Msg) -> None:
        """Acts on one control message from the router."""

    def busy(self) -> bool:
        """True while there is device work queued (the loop then does not wait for messages)."""

    def step(self) -> None:
        """One turn of the engine's own work: fetch, advance loads, one forward or decode step."""


def drive(
    engine: Engine, halt: threading.Event | None = None, gate: threading.Event | None = None
) -> None:
    """Runs `engine` until it is stopped by the router (or `halt` is set: a runtime ending it).
    While `gate` is clear it waits before its next turn (a runtime freezing it)."""
    engine.register()
    while not engine.stopped and not (halt is not None and halt.is_set()):
        if gate is not None:
            gate.wait()
        pump(engine.control, engine.handle, 0 if engine.busy() else 5)
        while not engine.outbox.empty():
            engine.control.send(engine.outbox.get_nowait())
        engine.step()
