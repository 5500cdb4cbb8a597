"""The HTTP server's edges: how long a slow or silent client may hold a connection, and how many
connections it may hold.

aiohttp closes an idle keep-alive connection after `keepalive_timeout` (also one that never
sends a request), but it bounds neither a request head that arrives a byte at a time, nor a body
that trickles in, nor a response written to a client that stopped reading, nor the number of
open connections; a few hundred slow clients would hold the server's sockets forever. So:

- `GuardedSite` listens like aiohttp's `TCPSite`, with each connection behind a `_Guard`: the
  request head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening, or of its first byte after the previous response; a connection past
  `max_connections` is answered 503 (`Retry-After`) and closed at once. The server's middleware
  tells the site when a request starts (its head is complete) and ends (`request_started`,
  `request_done`), so the head's clock never runs while a request is served.
- `read_body(request, timeout_s)`: the body must arrive within `timeout_s` of the head, else a
  408 answers and the connection closes.
- `write(request, resp, data, timeout_s)` and `finish(request, resp, timeout_s)`: a write that
  cannot drain within `timeout_s` (the client stopped reading) aborts the connection and raises
  ConnectionResetError, which cancels the request's round as a disconnect does.

Each close at a limit is counted by reason (`on_close`: `header_timeout`, `body_timeout`,
`write_timeout`, `too_many_connections`). docs/serving.md, "Slow clients".
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from dualpath_jax.serving.protocol import ApiError

log = logging.getLogger(__name__)


def _refusal(max_connections: int) -> bytes:
    """The whole HTTP answer to a connection past `max_connections`."""
    err = ApiError(
        503,
        f"the server holds its limit of {max_connections} connections; retry later",
        code="too_many_connections",
    )
    body = json.dumps(err.body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Guard(asyncio.Protocol):
    """One connection: aiohttp's protocol (`inner`) behind the head timeout and the cap."""

    def __init__(self, site: GuardedSite, inner: asyncio.Protocol):
        self.site, self.inner = site, inner
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = False  # a request is being served (its head arrived)
        self.admitted = False

    # asyncio's protocol calls, passed on to aiohttp's
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.site._admit(self):
            transport.write(self.site.refusal)  # type: ignore[attr-defined]
            transport.close()
            self.site.on_close("too_many_connections")
            return
        self.admitted = True
        self._arm()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if not self.busy and self.timer is None:
            self._arm()  # the first byte of a request head: its clock starts
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.admitted:
            self.site._forget(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    # the head's clock
    def started(self) -> None:
        self.busy = True
        self._disarm()

    def done(self) -> None:
        self.busy = False

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.site.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        self.timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        log.debug("closing a connection whose request head took over %s s",
                  self.site.header_timeout_s)  # fmt: skip
        self.site.on_close("header_timeout")
        self.transport.abort()


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site with the head timeout and the connection cap (module docstring).
    `max_connections` 0: no cap. `on_close(reason)` counts the closes at a limit."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        header_timeout_s: float,
        max_connections: int = 0,
        on_close: Callable[[str], None] = lambda reason: None,
        backlog: int = 128,
    ):
        super().__init__(runner, backlog=backlog)
        self.host, self.requested_port = host, port
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.on_close = on_close
        self.refusal = _refusal(max_connections)
        self.guards: dict[Any, _Guard] = {}  # transport -> its connection's guard
        self.port = port

    @property
    def name(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self.guards)

    async def start(self) -> None:
        await super().start()  # registers the site with its runner (cleanup stops it)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Guard(self, server()),  # aiohttp's Server makes each connection's protocol
            self.host,
            self.requested_port,
            backlog=self._backlog,
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def _admit(self, guard: _Guard) -> bool:
        if self.max_connections and len(self.guards) >= self.max_connections:
            return False
        self.guards[guard.transport] = guard
        return True

    def _forget(self, guard: _Guard) -> None:
        self.guards.pop(guard.transport, None)

    def request_started(self, request: web.BaseRequest) -> None:
        """The request's head is complete: its connection's head clock stops."""
        guard = self.guards.get(request.transport)
        if guard is not None:
            guard.started()

    def request_done(self, request: web.BaseRequest) -> None:
        """The request is answered: the connection's next byte starts a new head's clock."""
        guard = self.guards.get(request.transport)
        if guard is not None:
            guard.done()


async def read_body(request: web.Request, timeout_s: float, on_close=None) -> bytes:
    """The request's body, which must arrive within `timeout_s`; else ApiError 408 (the
    server closes the connection once that is sent, without waiting for the rest)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        if on_close is not None:
            on_close("body_timeout")
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout"
        ) from None


async def write(
    request: web.BaseRequest,
    resp: web.StreamResponse,
    data: bytes,
    timeout_s: float,
    on_close=None,
) -> None:
    """`resp.write(data)`, which must drain within `timeout_s`; else the connection is aborted
    and ConnectionResetError raised (a client that stopped reading is treated as gone)."""
    await _bounded(request, resp.write(data), timeout_s, on_close)


async def finish(
    request: web.BaseRequest, resp: web.StreamResponse, timeout_s: float, on_close=None
) -> None:
    """Sends a whole response (its head, body and end) within `timeout_s` (as `write`)."""

    async def send() -> None:
        await resp.prepare(request)
        await resp.write_eof()

    await _bounded(request, send(), timeout_s, on_close)


async def _bounded(request: web.BaseRequest, coro, timeout_s: float, on_close) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await coro
    except TimeoutError:
        if on_close is not None:
            on_close("write_timeout")
        transport = request.transport
        if transport is not None:
            transport.abort()  # close() would wait for the client to read what is buffered
        raise ConnectionResetError(
            f"the client read nothing for {timeout_s:g} s; connection closed"
        ) from None
