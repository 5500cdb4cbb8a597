"""`SamplingParams`, the one sampling value: its checks and their messages (when made, and when a
`Submit` carrying one is decoded), the numbers it accepts, and its compact wire form."""

from __future__ import annotations

import doctest
import math

import msgspec
import numpy as np
import pytest

from dualpath_jax.model import sampling_params as sampling
from dualpath_jax.model.sampling_params import GREEDY, SamplingError, SamplingParams
from dualpath_jax.wire import frames, messages

BAD = [
    ({"temperature": -0.5}, "temperature", "temperature must be a finite number >= 0, got -0.5"),
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number >= 0, got nan"),
    ({"temperature": math.inf}, "temperature", "temperature must be a finite number >= 0, got inf"),
    ({"top_p": 0.0}, "top_p", "top_p must lie in (0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p", "top_p must lie in (0, 1], got 1.5"),
    ({"top_p": math.nan}, "top_p", "top_p must lie in (0, 1], got nan"),
    ({"seed": -1}, "seed", "seed must lie in [0, 2**32), got -1"),
    ({"seed": 2**32}, "seed", "seed must lie in [0, 2**32), got 4294967296"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens must lie in [0, 2**31), got -1"),
]
BAD_TYPES = [
    ({"temperature": "0.5"}, "temperature", "temperature must be a number, got '0.5'"),
    ({"top_p": True}, "top_p", "top_p must be a number, got True"),
    ({"seed": 1.5}, "seed", "seed must be an int, got 1.5"),
    ({"min_tokens": 2.0}, "min_tokens", "min_tokens must be an int, got 2.0"),
]


@pytest.mark.parametrize("kw, field, message", BAD + BAD_TYPES)
def test_bad_fields_raise_naming_the_field(kw, field, message):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kw)
    assert (e.value.field, str(e.value)) == (field, message)
    assert isinstance(e.value, ValueError)


def test_numbers_of_any_kind_become_plain_python_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_p=1, seed=np.uint32(7))
    assert p == SamplingParams(temperature=0.5, top_p=1.0, seed=7)
    assert [type(v) for v in (p.temperature, p.top_p, p.seed)] == [float, float, int]
    assert GREEDY == SamplingParams() and GREEDY.greedy and not p.greedy
    assert hash(p) == hash(SamplingParams(temperature=0.5, seed=7))  # frozen: a value
    with pytest.raises(AttributeError):
        p.seed = 8  # type: ignore[misc]


def test_the_wire_carries_only_what_differs_from_greedy():
    def body(sampling: SamplingParams) -> dict:
        msg = messages.Submit(request="r", session="s", append=[1], gen=2, sampling=sampling)
        return msgspec.msgpack.decode(frames.encode(msg))["body"]["sampling"]

    assert body(GREEDY) == {}
    assert body(SamplingParams(temperature=0.7, seed=3)) == {"temperature": 0.7, "seed": 3}
    assert body(SamplingParams(min_tokens=4)) == {"min_tokens": 4}


def test_min_tokens_holds_back_the_stop_tokens_of_the_first_draws_only():
    p = SamplingParams(min_tokens=2)
    assert [sampling.held_back(p, [7, 9], k) for k in range(3)] == [[7, 9], [7, 9], []]
    assert sampling.held_back(GREEDY, [7, 9], 0) == []
    assert sampling.min_tokens_problem(p, 2, [7]) == ""
    assert sampling.min_tokens_problem(p, 1, [7]) == (
        "min_tokens (2) exceeds the tokens to generate (1)"
    )
    many = list(range(sampling.MAX_HELD_STOP_TOKENS + 1))
    assert "at most 16 stop tokens, got 17" in sampling.min_tokens_problem(p, 8, many)
    assert sampling.min_tokens_problem(GREEDY, 8, many) == ""  # nothing to hold back


@pytest.mark.parametrize("kw, field, message", BAD)
def test_a_submit_with_bad_sampling_does_not_decode(kw, field, message):
    """Checked on arrival too: a frame whose sampling is bad is refused with the same text (the
    router answers it as a frame error) and never reaches the router's round state."""
    frame = msgspec.msgpack.decode(
        frames.encode(messages.Submit(request="r", session="s", append=[1], gen=2))
    )
    frame["body"]["sampling"] = kw
    with pytest.raises(frames.FrameError) as e:
        frames.decode(msgspec.msgpack.encode(frame))
    assert message in str(e.value) and "sampling" in str(e.value)


def test_the_module_examples_run():
    assert doctest.testmod(sampling).failed == 0
