"""A decode step's new tokens travel as one message at each hop: the decode engine sends one
`TokensOut` per step with an entry per round that reports (every token of a streamed round, the
second of every round, a fork's first), and the router hands each client one `Partial` with its
streamed rounds' entries, timing each round's second token (TTST) and a fork's first (TTFT)."""

from __future__ import annotations

import math

import numpy as np
from router_rig import CLIENT, DE_ID, only

from dualpath_jax.engines.decode_engine import DecodeEngine, _Req
from dualpath_jax.model.sampling_params import SamplingParams
from dualpath_jax.results import Logprobs
from dualpath_jax.wire import frames, messages

OTHER = b"client2"  # a second client's connection


class _Control:
    def __init__(self) -> None:
        self.sent: list[messages.Msg] = []

    def send(self, msg: messages.Msg) -> None:
        self.sent.append(msg)


def _req(request: str, tokens: list[int], *, stream: bool, logprobs: int | None = None,
         source: str = "", gen: int = 64, stop: tuple[int, ...] = ()) -> _Req:  # fmt: skip
    job = messages.LoadJobMsg(
        request=request, keys=[], pe_blocks=0, de_blocks=0, prompt=[1, 2], gen=gen,
        pe_engine=0, pe_node=0, pe_address="", de_engine=1, de_node=1, de_address="",
        oracle=False, layerwise=True, params_version="", stream=stream,
        sampling=SamplingParams(logprobs=logprobs), stop_tokens=list(stop),
    )  # fmt: skip
    r = _Req(msg=job, load=None, tokens=list(tokens), source=source)
    r.logprobs = Logprobs() if logprobs is not None else None
    return r


def _engine(reqs: dict[int, _Req]) -> DecodeEngine:
    """A decode engine holding `reqs` in their slots (slot -> request), sending into `control`."""
    de = DecodeEngine.__new__(DecodeEngine)
    de.control = _Control()
    de.reqs = {r.msg.request: r for r in reqs.values()}
    de.slot_req = {slot: r.msg.request for slot, r in reqs.items()}
    return de


def test_a_step_sends_one_tokens_out_with_every_reporting_round():
    reqs = {
        0: _req("streamed", [4, 5], stream=True, logprobs=0),
        1: _req("second", [7], stream=False),  # its second token: the router times TTST
        2: _req("third", [7, 8], stream=False),  # nothing to report
        3: _req("fork", [], stream=False, source="streamed"),  # a fork's first token (TTFT)
    }
    de = _engine(reqs)
    chosen = np.array([[-0.5, -0.25], [-1.0, -1.0], [-2.0, -2.0], [-3.0, -3.0]], np.float32)
    de.consume(np.array([10, 11, 12, 13]), 1, dict(reqs), chosen=chosen)
    [out] = de.control.sent
    assert out == messages.TokensOut(
        rounds=[
            messages.RoundTokens(
                request="streamed",
                start=2,
                tokens=[10],
                logprobs=Logprobs(sampled=[-0.5], model=[-0.25]),
            ),
            messages.RoundTokens(request="second", start=1, tokens=[11]),
            messages.RoundTokens(request="fork", start=0, tokens=[13]),
        ]
    )
    assert [r.tokens for r in reqs.values()] == [[4, 5, 10], [7, 11], [7, 8, 12], [13]]
    assert reqs[0].logprobs == Logprobs(sampled=[-0.5], model=[-0.25])
    assert all(type(t) is int for r in reqs.values() for t in r.tokens)

    de.control.sent.clear()  # the next step: the streamed round and the fork's second token
    de.consume(np.array([20, 21, 22, 23]), 1, dict(reqs), chosen=chosen)
    assert de.control.sent == [
        messages.TokensOut(
            rounds=[
                messages.RoundTokens(
                    request="streamed",
                    start=3,
                    tokens=[20],
                    logprobs=Logprobs(sampled=[-0.5], model=[-0.25]),
                ),
                messages.RoundTokens(request="fork", start=1, tokens=[23]),
            ]
        )
    ]


def test_a_multi_step_dispatch_reports_each_rounds_tokens_in_one_entry_in_order():
    """`cluster.decode_steps` > 1: a dispatch of 3 steps gives each round its 3 tokens in step
    order in one entry, with a log-probability per token; a round done mid-dispatch (its last
    token, a stop token) keeps the tokens up to it, the rest rode along and are dropped."""
    reqs = {
        0: _req("streamed", [4], stream=True, logprobs=0),
        1: _req("short", [7], stream=True, gen=3),  # done at the dispatch's second step
        2: _req("stops", [7], stream=False, stop=(31,)),  # draws its stop token at the first
        3: _req("quiet", [7, 8, 9], stream=False),  # past its second token: nothing to report
    }
    de = _engine(reqs)
    done: list[tuple[str, str]] = []
    de.complete = lambda r, reason: done.append((r.msg.request, reason))
    tokens = np.array([[10, 20, 31, 40], [11, 21, 32, 41], [12, 22, 33, 42]])  # [step, slot]
    chosen = np.arange(24, dtype=np.float32).reshape(3, 4, 2) * -1
    de.consume(tokens, 3, dict(reqs), chosen=chosen)
    [out] = de.control.sent
    assert out == messages.TokensOut(
        rounds=[
            messages.RoundTokens(
                request="streamed",
                start=1,
                tokens=[10, 11, 12],
                logprobs=Logprobs(sampled=[0.0, -8.0, -16.0], model=[-1.0, -9.0, -17.0]),
            ),
            messages.RoundTokens(request="short", start=1, tokens=[20, 21]),
            messages.RoundTokens(request="stops", start=1, tokens=[31]),
        ]
    )
    assert reqs[0].logprobs == out.rounds[0].logprobs
    assert [r.tokens for r in reqs.values()] == [
        [4, 10, 11, 12], [7, 20, 21], [7, 31], [7, 8, 9, 40, 41, 42]
    ]  # fmt: skip
    assert done == [("short", "length"), ("stops", "stop")]


def test_a_step_with_nothing_to_report_sends_nothing():
    reqs = {0: _req("a", [1, 2], stream=False), 5: _req("b", [3, 4, 5], stream=False)}
    de = _engine(reqs)
    de.consume(np.arange(8), 1, dict(reqs))
    assert de.control.sent == [] and reqs[5].tokens == [3, 4, 5, 5]


def test_a_round_gone_since_the_step_was_dispatched_reports_nothing():
    reqs = {0: _req("gone", [1], stream=True), 1: _req("here", [2], stream=True)}
    de = _engine(reqs)
    riders = dict(reqs)
    del de.slot_req[0], de.reqs["gone"]
    de.consume(np.array([8, 9]), 1, riders)
    assert de.control.sent == [
        messages.TokensOut(rounds=[messages.RoundTokens(request="here", start=1, tokens=[9])])
    ]


def _submit(rig, client: bytes, session: str, request: str, stream: bool) -> None:
    rig.handle(messages.OpenSession(session=session), client, frames.CLIENT)
    sub = messages.Submit(request=request, session=session, append=[1, 2, 3], gen=8, stream=stream)
    assert rig.handle(sub, client, frames.CLIENT) == []


def test_the_router_sends_each_client_one_partial_per_step(rig):
    _submit(rig, CLIENT, "s1", "a", stream=True)
    _submit(rig, CLIENT, "s2", "b", stream=True)
    _submit(rig, OTHER, "s3", "c", stream=True)
    _submit(rig, CLIENT, "s4", "quiet", stream=False)
    rig.clock.t = 2.5
    step = [
        messages.RoundTokens(request="a", start=1, tokens=[5], logprobs=Logprobs(sampled=[-1.0])),
        messages.RoundTokens(request="c", start=1, tokens=[6]),
        messages.RoundTokens(request="quiet", start=1, tokens=[7]),
        messages.RoundTokens(request="unknown", start=1, tokens=[8]),
        messages.RoundTokens(request="b", start=1, tokens=[9]),
    ]
    sent = rig.sends(messages.TokensOut(rounds=step), DE_ID)
    assert sent == [
        (CLIENT, messages.Partial(rounds=[step[0], step[4]])),
        (OTHER, messages.Partial(rounds=[step[1]])),
    ]
    requests = rig.router.rounds.table.requests
    assert all(requests[r].t_second == 2.5 for r in ("a", "b", "c", "quiet"))

    rig.clock.t = 3.0  # a later token changes no timing
    rig.sends(messages.TokensOut(rounds=[messages.RoundTokens(request="a", start=2, tokens=[1])]))
    assert requests["a"].t_second == 2.5


def test_a_forks_first_token_from_its_decode_engine_times_its_ttft(rig):
    _submit(rig, CLIENT, "s1", "fork", stream=False)
    st = rig.router.rounds.table.requests["fork"]
    assert st.first_token < 0 and math.isnan(st.t_second)
    rig.clock.t = 1.25
    first = messages.RoundTokens(request="fork", start=0, tokens=[42])
    assert only(rig.sends(messages.TokensOut(rounds=[first]), DE_ID), messages.Partial) == []
    assert (st.first_token, st.t_first) == (42, 1.25) and math.isnan(st.t_second)
