"""Session hints: what a client tells the cluster about a session's future (docs/serving.md).

    session.hint("tool_call", expected_s=12)   # a tool runs now; the next turn in ~12 s
    session.hint("ttl", ttl_s=600)             # keep its stored KV 600 s after each round
    session.hint("pin")                        # keep its stored KV as long as it is open
    session.hint("release")                    # ends it and deletes its unshared stored KV
    child = session.hint("fork")               # a subagent starting from this prefix

Over HTTP: the `X-Session-Hint` header or the body field `session_hint`, as a string
(`"tool_call:12"`, `"ttl:600"`, `"pin"`, `"release"`) or a JSON object (`{"kind": "tool_call",
"expected_s": 12}`). An unknown hint or parameter is an error (`RolloutError` "bad_request",
HTTP 400).

What each does in the local cluster (`Backend.hint`, `apply_hint`): `tool_call` keeps the session's stored KV
through the gap (its retention TTL becomes `TOOL_CALL_HOLD` x `expected_s`) and, with
`scheduler.prefetch` on, lets a decode engine read that KV into memory during the gap
(router/prefetch.py; the simulator does the same, sim/prefetch.py).
`pin` and `ttl` are the session's retention (`Client.open_session`'s `priority` / `ttl_s`):
`pin` is the highest priority with the longest TTL. `release` is `close_session(release=True)`.
`fork` is `open_session(new, fork_of=session)` (`Session.hint` returns the new `Session`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

from dualpath_jax.wire.client_checks import RolloutError

HINT_KINDS = ("tool_call", "pin", "ttl", "release", "fork")
# Each kind's parameters and, for the string form `kind:value`, the one the value sets.
_PARAMS: dict[str, tuple[str, ...]] = {
    "tool_call": ("expected_s",),
    "pin": (),
    "ttl": ("ttl_s",),
    "release": (),
    "fork": ("session",),
}
TOOL_CALL_HOLD = 3.0  # as `scheduler.prefetch_hold_factor`'s default
PIN_PRIORITY = 2**31 - 1
PIN_TTL_S = 1e9  # the largest TTL the router takes
MAX_HINT_CHARS = 512


@dataclasses.dataclass(frozen=True)
class SessionHint:
    """One hint. `expected_s`: a tool call's expected length (s); `ttl_s`: a retention TTL
    (s); `session`: a fork's new session id ("": one is made)."""

    kind: str
    expected_s: float = 0.0
    ttl_s: float = -1.0
    session: str = ""


def _bad(msg: str) -> RolloutError:
    return RolloutError(f"session hint: {msg}", "bad_request")


def check_seconds(value: Any, name: str = "expected_s") -> float:
    """`value` as seconds in [0, PIN_TTL_S]; anything else raises `RolloutError`."""
    return _seconds(value, name)


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _bad(f"{name} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(f"{name} must be a number of seconds, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and 0 <= value <= PIN_TTL_S):
        raise _bad(f"{name} must lie in [0, {PIN_TTL_S:g}] seconds, got {value!r}")
    return value


def parse_hint(value: str | Mapping[str, Any] | SessionHint) -> SessionHint:
    """A `SessionHint` from its string form (`"kind"` or `"kind:value"`, or a JSON object in a
    string), a mapping (`{"kind": ..., param: value}`) or a hint; anything else, an unknown kind,
    an unknown or missing parameter raises `RolloutError` ("bad_request")."""
    if isinstance(value, SessionHint):
        value = {k: v for k, v in dataclasses.asdict(value).items() if v not in ("", -1.0, 0.0)}
        value.setdefault("kind", "")
    if isinstance(value, str):
        text = value.strip()
        if len(text) > MAX_HINT_CHARS:
            raise _bad(f"at most {MAX_HINT_CHARS} characters")
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError:
                raise _bad(f"not a JSON object: {text!r}") from None
        else:
            kind, sep, arg = text.partition(":")
            value = {"kind": kind.strip()}
            params = _PARAMS.get(kind.strip())
            if sep:
                if not params:
                    raise _bad(f"{kind.strip()!r} takes no value, got {arg!r}")
                value[params[0]] = arg.strip()
    if not isinstance(value, Mapping):
        raise _bad(f"a hint is a string or an object, got {type(value).__name__}")
    kind = value.get("kind")
    if kind not in _PARAMS:
        raise _bad(f"unknown hint {kind!r}; known: {list(HINT_KINDS)}")
    extra = set(value) - {"kind", *_PARAMS[kind]}
    if extra:
        raise _bad(f"{kind!r} takes {list(_PARAMS[kind]) or 'no parameters'}, got {sorted(extra)}")
    if kind == "tool_call":
        if "expected_s" not in value:
            raise _bad("tool_call needs expected_s (the tool's expected seconds)")
        return SessionHint(kind, expected_s=_seconds(value["expected_s"], "expected_s"))
    if kind == "ttl":
        if "ttl_s" not in value:
            raise _bad("ttl needs ttl_s (seconds)")
        return SessionHint(kind, ttl_s=_seconds(value["ttl_s"], "ttl_s"))
    if kind == "fork":
        child = value.get("session", "")
        if not isinstance(child, str):
            raise _bad(f"fork's session must be a str, got {child!r}")
        return SessionHint(kind, session=child)
    return SessionHint(kind)


def retention_of(hint: SessionHint) -> dict[str, Any]:
    """The retention settings (`priority`, `ttl_s`) a hint maps onto ({} for release, fork)."""
    if hint.kind == "pin":
        return {"priority": PIN_PRIORITY, "ttl_s": PIN_TTL_S}
    if hint.kind == "ttl":
        return {"ttl_s": hint.ttl_s}
    if hint.kind == "tool_call":
        return {"ttl_s": min(PIN_TTL_S, TOOL_CALL_HOLD * hint.expected_s)}
    return {}


def apply_hint(backend: Any, session: str, hint: SessionHint) -> None:
    """Applies `hint` to an open `session` of `backend` (a `wire.backend.Backend`, whose
    `hint` calls this): retention hints re-open it with the new settings (`resume=True`),
    `release` closes it releasing its KV, `tool_call` then tells the backend
    (`Backend.tool_call`: the router may prefetch the session's KV). `fork` is the caller's
    (`Backend.hint`, `Session.hint`): it opens a new session."""
    if hint.kind == "release":
        backend.close_session(session, True)
    elif hint.kind == "fork":
        raise _bad("fork opens a new session: use Session.hint('fork')")
    else:
        backend.open_session(session, resume=True, **retention_of(hint))
        if hint.kind == "tool_call":
            backend.tool_call(session, hint.expected_s)
