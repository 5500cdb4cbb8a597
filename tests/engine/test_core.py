"""The engine interface (`engines.core`): the loop every runtime drives, checked with a fake
engine and a fake control link, and the two engines' conformance to the contract."""

from __future__ import annotations

import inspect
import queue
import threading

import pytest

from dualpath_jax.engines.core import Engine, EngineId, drive
from dualpath_jax.engines.decode_engine import DecodeEngine
from dualpath_jax.engines.prefill_engine import PrefillEngine
from dualpath_jax.wire import messages


class FakeControl:
    """A control link with scripted incoming messages; records what is sent."""

    def __init__(self, incoming: list[list[messages.Msg]]):
        self.incoming = incoming  # one list per pump: what recv yields, then None
        self.sent: list[messages.Msg] = []
        self.waits: list[int] = []
        self._pending: list[messages.Msg] = []

    def send(self, msg: messages.Msg) -> None:
        self.sent.append(msg)

    def recv(self, timeout_ms: int) -> messages.Msg | None:
        if not self._pending:
            self.waits.append(timeout_ms)
            if not self.incoming:
                return None
            self._pending = list(self.incoming.pop(0))
            if not self._pending:
                return None
        return self._pending.pop(0)

    def close(self) -> None:
        pass


class FakeEngine:
    """Counts its calls; stops after `steps` steps; a `Cancel` queues an outbox message."""

    def __init__(self, control: FakeControl, steps: int, busy: bool = False):
        self.who = EngineId("decode", 3, 3)
        self.control = control
        self.outbox: queue.Queue[messages.Msg] = queue.Queue()
        self.stopped = False
        self.calls: list[str] = []
        self.steps, self._busy = steps, busy

    def register(self) -> None:
        self.calls.append("register")

    def handle(self, msg: messages.Msg) -> None:
        self.calls.append(f"handle:{type(msg).__name__}")
        if isinstance(msg, messages.Cancel):
            self.outbox.put(messages.Heartbeat(engine=self.who.engine))
        if isinstance(msg, messages.Stop):
            self.stopped = True

    def busy(self) -> bool:
        return self._busy

    def step(self) -> None:
        self.calls.append("step")
        # what the loop sent before this step: every outbox message queued by the handlers
        self.calls.append(f"sent:{len(self.control.sent)}")
        self.steps -= 1
        if self.steps == 0:
            self.stopped = True


def test_the_loop_registers_handles_flushes_then_steps():
    control = FakeControl([[messages.Cancel(request="r1"), messages.Ack()], [], []])
    engine = FakeEngine(control, steps=3)
    drive(engine)
    assert engine.calls == [
        "register",
        "handle:Cancel",
        "handle:Ack",
        "step",
        "sent:1",  # the handler's outbox message went out before the step
        "step",
        "sent:1",
        "step",
        "sent:1",
    ]
    assert control.sent == [messages.Heartbeat(engine=3)]


def test_an_idle_engine_waits_for_messages_a_busy_one_does_not():
    idle = FakeControl([[], []])
    drive(FakeEngine(idle, steps=2))
    busy = FakeControl([[], []])
    drive(FakeEngine(busy, steps=2, busy=True))
    assert idle.waits == [5, 5] and busy.waits == [0, 0]


def test_a_stop_from_the_router_ends_the_loop_before_another_step():
    control = FakeControl([[messages.Stop()]])
    engine = FakeEngine(control, steps=100)
    drive(engine)
    assert engine.calls == ["register", "handle:Stop", "step", "sent:0"]


def test_halt_ends_the_loop_from_another_thread():
    control = FakeControl([])
    engine = FakeEngine(control, steps=-1)  # never stops by itself
    halt = threading.Event()
    t = threading.Thread(target=drive, args=(engine, halt))
    t.start()
    halt.set()
    t.join(10)
    assert not t.is_alive() and engine.calls[0] == "register"


@pytest.mark.parametrize("cls", [PrefillEngine, DecodeEngine])
def test_both_engines_implement_the_interface(cls):
    members = {"register", "handle", "busy", "step"}
    protocol = {
        name for name, _ in inspect.getmembers(Engine, inspect.isfunction) if name in members
    }
    assert protocol == members
    for name in members:
        assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name}"
    signature = inspect.signature(cls.__init__).parameters
    params = list(signature)
    # grouped dependencies: config, identity, control link, loader context, the model side;
    # the rest (outbox, clock, a spanning leader) are optional keywords
    assert params[1:5] == ["cfg", "who", "control", "ctx"]
    positional = [p for p in params[1:] if signature[p].kind != inspect.Parameter.KEYWORD_ONLY]
    assert len(positional) <= 7, positional


def test_engine_names_and_roles():
    assert EngineId("prefill", 0, 0).name == "pe0" and EngineId("decode", 4, 4, 1).name == "de4"
