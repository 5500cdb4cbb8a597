"""Control messages of the tool-gap prefetch (engine/prefetch.py, docs/policies.md).

Client -> router `ToolCall`; router -> engine (a DE or a PE) `Prefetch` / `DropPrefetch`;
engine -> router `Prefetched`. They are members of the control plane's one union (engine/messages.py).
"""

from __future__ import annotations

from dualpath_jax.engine.msg_base import Msg


class ToolCall(Msg):
    """Client -> router: a round of `session` ended with a tool call expected to last
    `expected_s` seconds (the `tool_call` session hint). Answered `Ack(ref=session)` whether or
    not a prefetch starts (none when the policy or the config has none, the session has no
    stored hit, or the gap is too short to be worth a read)."""

    session: str
    expected_s: float


class Prefetch(Msg):
    """Router -> engine: read the blocks `keys` (the session's leading hit, chain order) from the
    store into the engine's prefetch memory while nothing more urgent reads; `epoch` names this
    prefetch in the `Prefetched` answer."""

    session: str
    keys: list[str]
    epoch: int


class DropPrefetch(Msg):
    """Router -> engine: forget the prefetch `epoch` of `session` (cancelled, evicted, or its turn
    went to another engine): stop reading and free its memory."""

    session: str
    epoch: int


class Prefetched(Msg):
    """Engine -> router: prefetch `epoch` of `session` holds its first `blocks` blocks in memory
    (its reads ended: all read, a block missing from the store, memory short, or stopped),
    after `read_s` seconds of reading."""

    engine: int
    session: str
    epoch: int
    blocks: int
    read_s: float = 0.0
