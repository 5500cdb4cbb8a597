"""`RoundResult`, the one record of a round: the router's answer on the wire, the in-process
engine's and the simulator's results, and what `metrics.summary` reads from either."""

from __future__ import annotations

import doctest
import math

import msgspec
import pytest

from dualpath_jax import results as rounds
from dualpath_jax.metrics.summary import summarize
from dualpath_jax.results import RoundResult
from dualpath_jax.wire import frames


def _timed(**kw) -> RoundResult:
    times = dict(t_submit=10.0, t_assign=10.5, t_first=11.0, t_second=11.25, t_done=12.0)
    fields = dict(cached_tokens=16, prompt_tokens=40, read_path="de")
    return RoundResult.timed("s#0", [5, 6, 7], **{**times, **fields, **kw})


def test_the_router_s_record_round_trips_the_wire():
    r = _timed(recomputed_blocks=2, finish_reason="stop", persist_error="store full")
    for token in ("", "sekrit"):
        got = frames.decode(frames.encode(r, token), token)
        assert type(got) is RoundResult and got == r
    assert (r.ttft_s, r.ttst_s, r.tpot_s, r.jct_s, r.queue_s, r.submit_s) == (
        1.0,
        0.25,
        0.5,
        2.0,
        0.5,
        10.0,
    )


def test_unknown_timings_stay_off_the_wire_and_come_back_nan():
    body = msgspec.msgpack.decode(frames.encode(_timed()))["body"]
    assert body["type"] == "RoundResult"
    assert not {"read_s", "prefill_s", "recomputed_blocks", "persist_error"} & set(body)
    got = frames.decode(frames.encode(_timed()))
    assert math.isnan(got.read_s) and math.isnan(got.prefill_s)
    with_times = _timed(read_s=0.125, prefill_s=0.25)
    assert frames.decode(frames.encode(with_times)) == with_times


def test_a_malformed_record_is_refused():
    body = msgspec.msgpack.decode(frames.encode(_timed()))
    body["body"]["tokens"] = "abc"
    with pytest.raises(frames.FrameError, match="malformed message"):
        frames.decode(msgspec.msgpack.encode(body))


def test_one_token_and_an_unreached_second_token():
    one = RoundResult.timed(
        "s#1",
        [5],
        t_submit=0.0,
        t_assign=0.0,
        t_first=1.0,
        t_second=math.nan,
        t_done=1.5,
        cached_tokens=0,
        prompt_tokens=3,
        read_path="none",
    )
    assert (one.ttst_s, one.tpot_s, one.jct_s) == (0.0, 0.0, 1.5)


def test_the_summary_reads_router_and_simulator_records_alike():
    """The simulator keeps `range(n)` tokens and its TTFT breakdown on the record; the router
    sends token ids and reports the breakdown in events. The summary reads both."""
    router = _timed()
    sim = RoundResult.timed(
        "s#0",
        range(3),
        t_submit=10.0,
        t_assign=10.5,
        t_first=11.0,
        t_second=11.25,
        t_done=12.0,
        cached_tokens=16,
        prompt_tokens=40,
        read_path="de",
        read_s=0.25,
        prefill_s=0.125,
    )
    kw = dict(policy="dualpath", mode="offline", emulated=True, agents=1, errors=0, jct_s=2.0)
    event = {"kind": "first_token", "request": "s#0", "read_s": 0.25, "prefill_s": 0.125}
    a = summarize(results=[router], reports=[], events=[event], **kw)
    b = summarize(results=[sim], reports=[], **kw)
    assert a == b and a["tokens_generated"] == 3
    assert a["ttft_breakdown_s"]["kv_read"]["mean"] == 0.25


def test_the_module_examples_run():
    assert doctest.testmod(rounds).failed == 0
