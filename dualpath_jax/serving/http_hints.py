"""Session hints over HTTP (`X-Session-Hint`, or the body's `session_hint`; wire/hints.py,
docs/serving.md): what a request's hint does around its round.

- `tool_call`, `pin`, `ttl`: the session's retention from this round on (the round's `priority`
  and `ttl_s`, `request_checks.session_hint`). A `tool_call` also tells the router, once the
  round has answered, that a tool now runs for about `expected_s` seconds (`Client.tool_call`):
  with `scheduler.prefetch` on, a decode engine reads the session's stored KV meanwhile.
- `fork`: the round runs on a new session that starts with the named session's context
  (`Client.open_session(fork_of=...)`: its stored KV is shared, nothing is copied). The new id is
  the hint's `session`, else `<id>/<6 hex digits>`; the response names it in `X-Session-Id`, and
  later requests continue it under that id.
- `release`: once the round has answered, the session is closed and its stored KV that no other
  session uses is deleted; a later request under its id starts afresh.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from dualpath_jax.serving.protocol import ApiError
from dualpath_jax.serving.request_checks import HINT_HEADER, check_session_id
from dualpath_jax.wire import hints
from dualpath_jax.wire.client import RolloutError

log = logging.getLogger(__name__)


async def fork(server: Any, sid: str, child: str) -> str:
    """Opens `child` (or a fresh id) as a fork of the server's session `sid`, waiting for a
    round of `sid` that runs; returns the new session's id. A 400 when `sid` has no context at
    the router yet or `child` is taken."""
    parent = server.sessions.get(sid)
    if parent is None or not parent.opened:
        raise ApiError(
            400, f"cannot fork session {sid!r}: it has no context yet", param=HINT_HEADER
        )
    child = check_session_id(child or f"{sid}/{uuid.uuid4().hex[:6]}", HINT_HEADER)
    if child in server.sessions:
        raise ApiError(400, f"cannot fork into session {child!r}: it exists", param=HINT_HEADER)
    agent = server.new_session(child)
    async with parent.lock:
        try:
            await server.call(server.client.open_session, agent.router_id, fork_of=parent.router_id)
        except RolloutError as e:
            raise server.rollout_error(e) from None
        agent.context, agent.opened = list(parent.context), True
    server.sessions[child] = agent
    return child


async def after_round(server: Any, agent: Any, hint: hints.SessionHint) -> None:
    """What `hint` does once its round has answered (under the session's lock): a tool call is
    told to the router (a failure is logged, the answer stands); a release closes the session."""
    if hint.kind == "tool_call":
        try:
            await server.call(server.client.tool_call, agent.router_id, hint.expected_s)
        except RolloutError as e:
            log.warning("the tool_call hint of %s failed: %s", agent.router_id, e)
    elif hint.kind == "release":
        try:
            await server.call(server.client.close_session, agent.router_id, release=True)
        except RolloutError as e:
            log.warning("releasing %s failed: %s", agent.router_id, e)
        agent.opened, agent.context = False, []  # a later request opens it afresh
