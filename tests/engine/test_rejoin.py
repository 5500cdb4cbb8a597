"""An engine that was paused (SIGSTOP) or cut off beyond the heartbeat timeout survives it: its
heartbeat thread does not count the pause as silence of the router (`RouterSilence`), and once
the router, which declared it dead and requeued its rounds, tells it to rejoin, both engines drop
every request they held and register again. Driven with fakes in place of the control link,
the decoder, the model and the loads; the router's side is in test_router_faults.py, a paused
engine process of a real cluster in tests/integration/test_pause.py. Also: a job of params the
engine does not serve is reported as kind `params` (retried elsewhere by the router)."""

from __future__ import annotations

import types

import pytest

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.engines.common import RouterSilence, failure_kind
from dualpath_jax.engines.core import EngineId
from dualpath_jax.engines.decode_engine import DecodeEngine
from dualpath_jax.engines.decode_engine import _Req as DecodeReq
from dualpath_jax.engines.params import ParamsMismatch, ParamsSlot
from dualpath_jax.engines.prefill_engine import PrefillEngine
from dualpath_jax.engines.prefill_engine import _Req as PrefillReq
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.wire import messages

# ----------------------------------------------------------------------------- heartbeats


def test_a_pause_of_the_engine_is_not_silence_of_the_router():
    s = RouterSilence(interval_s=1.0, timeout_s=10.0, now=0.0)
    for t in range(1, 5):
        s.tick(t)
        s.answered(t)
    s.tick(45.0)  # the process was stopped for 40 s: the thread's next run
    assert s.lost(45.0) == 0.0  # the router gets a full timeout to answer again
    for t in range(46, 55):  # a router that never answers again ...
        s.tick(t)
        assert s.lost(t) == 0.0
    s.tick(55)
    assert s.lost(55) == 11.0  # ... is taken for dead after 10 s of running


def test_an_answer_ends_the_silence_and_no_timeout_never_loses_the_router():
    s = RouterSilence(interval_s=1.0, timeout_s=10.0, now=0.0)
    s.tick(1)
    s.tick(12)  # a gap of 11 s, 10 of them not running
    s.answered(12)
    for t in range(13, 23):
        s.tick(t)
    assert s.lost(22) == 0.0 and s.lost(23) == 11.0
    forever = RouterSilence(interval_s=1.0, timeout_s=0.0, now=0.0)
    forever.tick(1000)
    assert forever.lost(1000) == 0.0


# ----------------------------------------------------------------------------- rejoining


class FakeControl:
    def __init__(self) -> None:
        self.sent: list[messages.Msg] = []

    def send(self, msg: messages.Msg) -> None:
        self.sent.append(msg)


class FakeLoad:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeDecoder:
    def __init__(self) -> None:
        self.runner = types.SimpleNamespace(mesh=None)  # one device: the default one
        self.freed: list[int] = []

    def free(self, slot: int) -> None:
        self.freed.append(slot)


def _cfg() -> ExperimentConfig:
    return ExperimentConfig(
        model=TINY_QWEN2, store=StoreConfig(block_tokens=16), cluster=ClusterConfig()
    )


def _ctx():
    return types.SimpleNamespace(
        channel=types.SimpleNamespace(address="inproc://x"), row_pieces=1, row_offers=None
    )


def _job(request: str, engine: int) -> messages.LoadJobMsg:
    return messages.LoadJobMsg(
        request=request, keys=[], pe_blocks=0, de_blocks=0, prompt=[1, 2], gen=2, pe_engine=0,
        pe_node=0, pe_address="", de_engine=engine, de_node=engine, de_address="", oracle=False,
        layerwise=True, params_version="v1", attempt=1,
    )  # fmt: skip


def _rejoin() -> messages.Error:
    return messages.Error(ref="1", message="engine 1 was declared dead", kind="rejoin")


def _registers(sent: list[messages.Msg]) -> list[messages.Register]:
    return [m for m in sent if isinstance(m, messages.Register)]


def _check_rejoins(engine, control: FakeControl) -> None:
    """The order is ignored until the new `Register` is answered, then acted on again."""
    engine.handle(_rejoin())  # answers a fetch sent before the Register: ignored
    assert len(_registers(control.sent)) == 1
    engine.handle(messages.Ack(ref=str(engine.who.engine)))
    engine.handle(_rejoin())
    assert len(_registers(control.sent)) == 2 and not engine.stopped


def test_a_decode_engine_told_to_rejoin_drops_its_work_and_registers_again():
    control, decoder = FakeControl(), FakeDecoder()
    params = ParamsSlot(None, "v1", 1)
    de = DecodeEngine(_cfg(), EngineId("decode", 1, 1), control, _ctx(), decoder, params)
    de.register()
    de.handle(messages.Ack(ref="1"))
    decoding, starting = FakeLoad(), FakeLoad()
    de.reqs = {
        "a": DecodeReq(_job("a", 1), decoding, slot=0),  # in a decode slot
        "b": DecodeReq(_job("b", 1), starting),  # its loads running
        "c": DecodeReq(_job("c", 1), None),  # waiting for buffer room
    }
    de.slot_req, de.waiting = {0: "a"}, ["c"]
    params._staged = ("v2", object())  # an update it loaded before the pause
    control.sent.clear()
    de.handle(_rejoin())
    assert de.reqs == {} and de.slot_req == {} and de.waiting == []
    assert decoder.freed == [0] and decoding.closed and starting.closed
    assert params._staged is None and params.version == "v1"
    (reg,) = control.sent
    assert isinstance(reg, messages.Register)
    assert (reg.role, reg.engine, reg.params_version) == ("decode", 1, "v1")
    _check_rejoins(de, control)


def test_a_prefill_engine_told_to_rejoin_drops_its_work_and_registers_again():
    control = FakeControl()
    runner = types.SimpleNamespace(mesh=None)
    pe = PrefillEngine(_cfg(), EngineId("prefill", 1, 1), control, _ctx(), runner,
                       ParamsSlot(None, "v1", 1))  # fmt: skip
    pe.register()
    pe.handle(messages.Ack(ref="1"))
    reading, queued = FakeLoad(), FakeLoad()
    pe.reqs = {
        "a": PrefillReq(_job("a", 2), reading, 0.0),
        "b": PrefillReq(_job("b", 2), queued, 0.0),
    }
    pe.reading = ["a"]
    control.sent.clear()
    pe.handle(_rejoin())
    assert pe.reqs == {} and pe.reading == [] and reading.closed and queued.closed
    (reg,) = control.sent
    assert isinstance(reg, messages.Register) and (reg.role, reg.engine) == ("prefill", 1)
    _check_rejoins(pe, control)


def test_a_stop_still_stops_an_engine():
    control = FakeControl()
    de = DecodeEngine(_cfg(), EngineId("decode", 1, 1), control, _ctx(), FakeDecoder(),
                      ParamsSlot(None, "", 1))  # fmt: skip
    de.handle(messages.Error(ref="1", message="engine not registered", kind="stop"))
    assert de.stopped and _registers(control.sent) == []


# ----------------------------------------------------------------------------- params


def test_a_job_of_other_params_is_a_params_failure():
    slot = ParamsSlot(None, "v0", 1)
    with pytest.raises(ParamsMismatch, match="needs params version 'v1'; this engine serves 'v0'"):
        slot.check_job(_job("a", 1))
    control = FakeControl()
    de = DecodeEngine(_cfg(), EngineId("decode", 1, 1), control, _ctx(), FakeDecoder(), slot)
    de.handle(messages.Work(jobs=[_job("a", 1)]))
    (failed,) = control.sent
    assert isinstance(failed, messages.Failed) and failed.kind == "params" and failed.attempt == 1
    assert failure_kind(ParamsMismatch("x")) == "params" and de.reqs == {}
