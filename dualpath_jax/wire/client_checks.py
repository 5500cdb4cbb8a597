"""What the client checks before anything is sent, and how its rounds fail: `RolloutError`,
the token-id and session-id checks, and `RoundFuture` (wire/client.py re-exports them)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from concurrent import futures
from typing import Any


class RolloutError(RuntimeError):
    """A round was refused or failed. `kind`: bad_request (the input), overloaded (queue full),
    store, transfer or engine (the cluster failed it; `str(e)` carries the cause), cancelled,
    auth (wrong secret), connection (the router stopped answering), unsupported (the backend
    cannot run that method: `wire.backend.Backend`)."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


TOKEN_LIMIT = 2**31  # token ids are int32 on the device


def check_tokens(tokens: Sequence[int], what: str = "token id") -> list[int]:
    """Token ids as plain ints; anything but an integer (numpy integers are fine; bool, float and
    str are not) or a value outside [0, 2**31) raises RolloutError(kind="bad_request")."""
    if isinstance(tokens, str | bytes):
        raise RolloutError(
            f"{what}s must be a sequence of ints, got {type(tokens).__name__}", "bad_request"
        )
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise RolloutError(f"{what} {t!r} is not an int ({type(t).__name__})", "bad_request")
        v = int(t)
        if not 0 <= v < TOKEN_LIMIT:
            raise RolloutError(f"{what} {v} is out of range [0, 2**31)", "bad_request")
        out.append(v)
    return out


MAX_SESSION_NAME = 1024


def check_session(session: Any) -> str:
    """A session name: a non-empty str of at most `MAX_SESSION_NAME` characters; anything else
    raises RolloutError(kind="bad_request") before a message is sent (the router would drop a
    message it cannot decode, and the call would wait out its timeout)."""
    if not isinstance(session, str) or not session:
        raise RolloutError(f"a session must be a non-empty str, got {session!r}", "bad_request")
    if len(session) > MAX_SESSION_NAME:
        raise RolloutError(
            f"a session name is at most {MAX_SESSION_NAME} characters, got {len(session)}",
            "bad_request",
        )
    return session


def check_ttl(value: Any) -> float:
    """A retention TTL in seconds: a real number (the router bounds its range)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RolloutError(f"ttl_s must be a number of seconds, got {value!r}", "bad_request")
    return float(value)


def check_int(value: Any, name: str, low: int, high: int) -> int:
    """`value` as a plain int in [low, high) (numpy integers are fine; bool is not); anything
    else raises RolloutError(kind="bad_request") naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RolloutError(f"{name} must be an int, got {value!r}", "bad_request")
    v = int(value)
    if v < low:
        bound = "> 0" if low == 1 else f">= {low}"
        raise RolloutError(f"{name} must be {bound}, got {v}", "bad_request")
    if v >= high:
        raise RolloutError(f"{name} must be < {high}, got {v}", "bad_request")
    return v


class RoundFuture(futures.Future):
    """The future of one round; `request` is its id (for `Client.cancel`)."""

    request: str = ""


# Their public home is the client (wire/client.py re-exports them): errors and reprs name it.
RolloutError.__module__ = RoundFuture.__module__ = "dualpath_jax.wire.client"
