"""The OpenAI-compatible HTTP server over a router (`launch/api_server.py` starts it).

    server = ApiServer(client, tokenizer, ServerConfig(model="tiny-qwen2", max_context=2048))
    port = await server.start("127.0.0.1", 8000)

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`), `GET
/v1/models`, `GET /health`, `GET /metrics` (Prometheus), and the admin plane of RL trainers
(serving/admin.py: pause, resume, abort, weight updates, model info). Requests run as rounds of router
sessions:

- A request with a session id (`request_checks.session_id`: `X-Session-Id` or a peer's session
  header, else the body's `conversation_id` or `user`) runs in that
  agent's session: the server keeps the session's context (prompt and generated ids), sends the
  router only what the new prompt adds, and rewinds (`Submit.keep`) to the longest common prefix
  when the client rewrote history. The earlier turns' KV is found in the store by block key and
  read over the path the scheduler picks. One round per session runs at a time; others wait.
  `X-Session-Priority` (an int) and `X-Session-TTL` (seconds) set the KV retention of the
  request's session from this round on (`Client.submit`'s `priority` and `ttl_s`).
- A request without one runs in a fresh session that is closed afterwards; the store's
  hash-chain lookup still finds blocks of any prompt prefix stored before.

`usage.prompt_tokens_details.cached_tokens` is the prompt tokens whose KV was loaded from the
store rather than recomputed; the `X-DualPath-Read-Path` header (and the `dualpath` field of a
response or of a stream's last chunks) says which read path served it, with the router's timings.
A client that disconnects cancels its round, which frees its engines' slots.

aiohttp serves (one well-kept dependency for the server and the benchmark client, with
server-sent events and handler cancellation on disconnect); docs/serving.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dualpath_jax.serving import (
    admin,
    connections,
    group,
    http_hints,
    request_checks,
    responses,
)
from dualpath_jax.serving.metrics import ServerMetrics
from dualpath_jax.serving.protocol import ApiError, ChatRequest, CompletionRequest, parse
from dualpath_jax.serving.request_checks import RoundParams
from dualpath_jax.serving.responses import RoundStream
from dualpath_jax.serving.text import TextStream
from dualpath_jax.serving.tokenizer import Tokenizer, TokenizerError
from dualpath_jax.wire.client import Client, RolloutError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """`model`: the name `/v1/models` lists and requests must name. `max_context`: prompt plus
    generated tokens of a round (the router's limit). `vocab_size`: token-id prompts must lie
    below it. `api_key`: required as `Authorization: Bearer KEY` on /v1 ("" : none).
    `session_idle_s`: an agent session unused this long is closed (its blocks stay stored).
    `round_timeout_s`: a round that takes longer fails with 503. `retry_after_s`: the
    `Retry-After` of 429 and 503 answers. `max_session_priority` and `max_session_ttl_s`: the
    largest KV retention priority and TTL a client may ask for in its headers (a larger value
    is a 400: one client must not pin its blocks over everyone else's). `max_body_bytes`: the
    largest request body (0: 64 bytes per token of `max_context`, at least 1 MiB).

    A connection's limits (`connections.py`): its request head (line and headers) must arrive
    within `header_timeout_s`, its body within `body_timeout_s` after that (else 408), an idle
    keep-alive connection closes after `keepalive_timeout_s`, a write the client does not read
    within `write_timeout_s` closes the connection (and cancels its round), and connections past
    `max_connections` (0: no cap) are answered 503 and closed.

    `emulated_links`: link kind -> bytes per second of the links the cluster paces as token
    buckets (`transfer.links.emulated_links` of its config; empty: every link runs at the host's
    speed). The server logs them as a warning when it starts and `GET /health` reports them."""

    model: str
    max_context: int
    vocab_size: int
    api_key: str = ""
    default_max_tokens: int = 256
    session_idle_s: float = 1800.0
    round_timeout_s: float = 600.0
    retry_after_s: float = 1.0
    max_session_priority: int = 100
    max_session_ttl_s: float = 86400.0
    max_body_bytes: int = 0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    write_timeout_s: float = 60.0
    max_connections: int = 1024
    emulated_links: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def body_limit(self) -> int:
        return self.max_body_bytes or max(2**20, 64 * self.max_context)


@dataclasses.dataclass
class _AgentSession:
    """The server's copy of one router session: its context as the router has it."""

    router_id: str
    context: list[int] = dataclasses.field(default_factory=list)
    opened: bool = False
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    last_used: float = 0.0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ApiServer:
    """The HTTP front of a router; `client` is its `Client` (the client secret)."""

    def __init__(
        self,
        client: Client,
        tokenizer: Tokenizer,
        cfg: ServerConfig,
        *,
        registry: CollectorRegistry | None = None,
        ready: Any = None,
    ):
        self.client, self.tok, self.cfg = client, tokenizer, cfg
        self.registry = registry or CollectorRegistry()
        self.metrics = ServerMetrics(self.registry, stats=lambda: client.stats(timeout_s=5.0))
        for kind, rate in cfg.emulated_links.items():
            self.metrics.emulated_links.labels(kind).set(rate)
        self.sessions: dict[str, _AgentSession] = {}
        self.ready = ready or (lambda: True)
        self.runner: web.AppRunner | None = None
        self.site: connections.GuardedSite | None = None
        self._reaper: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # one-off sessions being closed
        self.running: dict[str, str] = {}  # response id -> its round's request (abort_requests)
        self.created = int(time.time())

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.cfg.body_limit)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.scrape)
        admin.Admin(self).add_routes(app)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Starts serving; returns the bound port."""
        # handler_cancellation: a client that disconnects cancels its handler (and its round).
        self.runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.cfg.keepalive_timeout_s,
        )
        await self.runner.setup()
        self.site = connections.GuardedSite(
            self.runner,
            host,
            port,
            header_timeout_s=self.cfg.header_timeout_s,
            max_connections=self.cfg.max_connections,
            on_close=self._closed_at_limit,
        )
        await self.site.start()
        if self.cfg.emulated_links:  # TTFT then waits for them: say so where users look
            rates = ", ".join(f"{k} {v / 1e6:g} MB/s" for k, v in self.cfg.emulated_links.items())
            log.warning(
                "emulated links (token buckets, not this host's speed): %s; GET /health lists"
                " them. To serve at the host's speed use configs/serve.py, or set the"
                " hardware.*_bytes_per_s rates to 0",
                rates,
            )
        self._reaper = asyncio.ensure_future(self._reap_idle())
        return self.site.port

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _reap_idle(self) -> None:
        """Closes agent sessions idle for `session_idle_s` (their stored blocks stay)."""
        while True:
            await asyncio.sleep(max(1.0, self.cfg.session_idle_s / 10))
            now = time.monotonic()
            for sid, s in list(self.sessions.items()):
                if now - s.last_used > self.cfg.session_idle_s and not s.lock.locked():
                    del self.sessions[sid]
                    if s.opened:
                        await self._call(self.client.close_session, s.router_id)

    @staticmethod
    async def _call(fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))

    call = _call  # what serving/http_hints.py uses of the server

    # ------------------------------------------------------------------ plumbing

    def _closed_at_limit(self, reason: str) -> None:
        self.metrics.connections_closed.labels(reason).inc()

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Answers every request: errors in OpenAI's shape, the response sent within
        `write_timeout_s`, the metrics; its connection's head clock stops meanwhile."""
        if self.site is not None:
            self.site.request_started(request)
        try:
            return await self._answer(request, handler)
        finally:
            if self.site is not None:
                self.site.request_done(request)

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        endpoint = request.path
        t0 = time.monotonic()
        api = endpoint.startswith("/v1/")
        guarded = api or endpoint in admin.PATHS  # behind the key
        if api:  # a scrape or a health check is not a request being served
            self.metrics.running.inc()
        try:
            if guarded and self.cfg.api_key:
                if not hmac.compare_digest(
                    request_checks.bearer(request).encode(), self.cfg.api_key.encode()
                ):
                    raise ApiError(401, "invalid API key", code="invalid_api_key")
            if guarded and endpoint not in ("/v1/models", "/get_model_info") and not self.ready():
                raise ApiError(
                    503,
                    "the server is starting (engines are compiling); GET /health answers 200"
                    " once it is ready",
                    retry_after=5,
                )
            resp = await handler(request)
        except ApiError as e:
            resp = self._error(e)
        except web.HTTPException as e:  # aiohttp's own (404 route, 405 method)
            resp = self._error(ApiError(e.status, e.reason or str(e)))
        except asyncio.CancelledError:
            self.metrics.requests.labels(endpoint, "disconnected").inc()
            raise
        except ConnectionResetError:  # the client left, or read nothing for write_timeout_s
            return self._gone(endpoint)
        except Exception as e:  # noqa: BLE001 - a bug answers 500, the server keeps serving
            log.exception("%s failed", endpoint)
            resp = self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            if api:
                self.metrics.running.dec()
        try:
            await connections.finish(request, resp, self.cfg.write_timeout_s, self._closed_at_limit)
        except ConnectionResetError:
            return self._gone(endpoint)
        if resp.status == 408 and request.transport is not None:
            # the answer is sent; aiohttp would linger for the rest of the late body
            request.transport.close()
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()
        if endpoint.startswith("/v1/"):
            self.metrics.e2e.labels(endpoint).observe(time.monotonic() - t0)
        return resp

    def _gone(self, endpoint: str) -> web.Response:
        """What a request whose client is gone returns (aiohttp's write of it fails quietly)."""
        self.metrics.requests.labels(endpoint, "disconnected").inc()
        return web.Response(status=499)

    def _error(self, e: ApiError) -> web.Response:
        headers = {}
        if e.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(e.retry_after)))
        resp = web.json_response(e.body(), status=e.status, headers=headers)
        if e.status == 408:  # a late body: the connection closes once this is sent
            resp.force_close()
        return resp

    def _rollout_error(self, e: RolloutError) -> ApiError:
        retry = self.cfg.retry_after_s
        match e.kind:
            case "bad_request":
                return ApiError(400, str(e))
            case "overloaded":
                return ApiError(429, str(e), code="overloaded", retry_after=retry)
            case "connection" | "engine" | "busy" | "stop":
                return ApiError(503, str(e), code=e.kind, retry_after=retry)
            case _:
                return ApiError(500, f"{e.kind}: {e}", code=e.kind)

    rollout_error = _rollout_error  # serving/http_hints.py's

    # ------------------------------------------------------------------ small endpoints

    async def health(self, request: web.Request) -> web.Response:
        """`{"status": "ok"}`, or 503 `"starting"`; with `"emulated_links"` (kind -> bytes per
        second) when the cluster emulates any."""
        links = {"emulated_links": dict(self.cfg.emulated_links)} if self.cfg.emulated_links else {}
        if not self.ready():
            return web.json_response({"status": "starting", **links}, status=503)
        return web.json_response({"status": "ok", **links})

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.cfg.model,
            "object": "model",
            "created": self.created,
            "owned_by": "dualpath_jax",
            "max_model_len": self.cfg.max_context,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def scrape(self, request: web.Request) -> web.Response:
        body = await self._call(generate_latest, self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ generation endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(await self._body(request), CompletionRequest)
        request_checks.check_common(req, self.cfg.model)
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        prompt = request_checks.completion_prompt(req.prompt, self.tok, self.cfg.vocab_size)
        params = self._round_params(req, req.max_tokens, len(prompt))
        return await self._respond(request, req, prompt, params, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse(await self._body(request), ChatRequest)
        request_checks.check_common(req, self.cfg.model)
        if req.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        try:
            prompt = self.tok.chat(req.messages)
        except TokenizerError as e:
            raise ApiError(400, str(e), param="messages") from None
        limit = req.max_completion_tokens
        limit = req.max_tokens if limit is None else limit
        params = self._round_params(req, limit, len(prompt))
        return await self._respond(request, req, prompt, params, chat=True)

    async def _body(self, request: web.Request) -> bytes:
        return await connections.read_body(request, self.cfg.body_timeout_s, self._closed_at_limit)

    async def _send(self, request: web.Request, resp: web.StreamResponse, data: Any) -> None:
        """One server-sent event (a dict) or raw bytes of a stream, within `write_timeout_s`."""
        if isinstance(data, dict):
            data = responses.event(data)
        await connections.write(
            request, resp, data, self.cfg.write_timeout_s, self._closed_at_limit
        )

    def _round_params(self, req: Any, max_tokens: int | None, prompt_len: int) -> RoundParams:
        return request_checks.round_params(
            req,
            max_tokens,
            prompt_len,
            max_context=self.cfg.max_context,
            default_max_tokens=self.cfg.default_max_tokens,
        )

    # ------------------------------------------------------------------ rounds

    async def _submit(
        self,
        rnd: RoundStream,
        sid: str | None,
        prompt: list[int],
        p: RoundParams,
        live: bool,
        retention: dict[str, Any],
    ) -> tuple[_AgentSession | None, str]:
        """Opens (or continues) the round's router session and submits (with `retention`, the
        `request_checks.retention` keywords); returns the agent session (None: a one-off
        session, closed after the round) and the router session id."""
        if sid is None:
            rid = f"http-{uuid.uuid4().hex}"
            # the open runs on even if this handler is cancelled (the client left): `_round`
            # closes the session once the open is done, whenever that is
            rnd.one_off = rid
            rnd.opening = asyncio.ensure_future(self._call(self.client.open_session, rid))
            await asyncio.shield(rnd.opening)
            agent, keep, append = None, -1, prompt
        else:
            agent = self.sessions[sid]
            rid = agent.router_id
            if not agent.opened:
                await self._call(self.client.open_session, rid, resume=True)
                agent.opened, agent.context = True, []
            # Always an explicit keep: a copy that is out of step with the router (e.g. a
            # restarted server attached to a running router) then fails loudly, never appends.
            keep = min(_common_prefix(agent.context, prompt), len(prompt) - 1)
            append = prompt[keep:]
        rnd.fut = self.client.submit(
            rid,
            append,
            p.max_tokens,
            sampling=p.sampling,
            keep=keep,
            stop_tokens=[] if p.ignore_eos else self.tok.eos_ids,
            on_tokens=rnd.on_tokens if live else None,
            **retention,
        )
        return agent, rid

    async def _respond(
        self, request: web.Request, req: Any, prompt: list[int], p: RoundParams, chat: bool
    ) -> web.StreamResponse:
        if req.n > 1:
            return await group.respond(self, request, req.n, prompt, p, chat)
        sid = request_checks.session_id(request, req)
        caps = (self.cfg.max_session_priority, self.cfg.max_session_ttl_s)
        hint, retention = request_checks.session_hint(request, req, sid, *caps)
        retention.update(request_checks.retention(request, *caps))
        if sid is not None:
            if hint is not None and hint.kind == "fork":
                sid = await http_hints.fork(self, sid, hint.session)
            if sid not in self.sessions:
                self.sessions[sid] = self.new_session(sid)
            agent = self.sessions[sid]
            agent.last_used = time.monotonic()
            async with agent.lock:
                try:
                    resp = await self._round(request, sid, prompt, p, chat, retention)
                finally:
                    agent.last_used = time.monotonic()
                if hint is not None:
                    await http_hints.after_round(self, agent, hint)
                return resp
        return await self._round(request, None, prompt, p, chat, retention)

    @staticmethod
    def new_session(sid: str) -> _AgentSession:
        """The server's copy of the agent session `sid` (not opened at the router yet)."""
        return _AgentSession(f"http:{sid}")

    async def _round(
        self,
        request: web.Request,
        sid: str | None,
        prompt: list[int],
        p: RoundParams,
        chat: bool,
        retention: dict[str, Any],
    ) -> web.StreamResponse:
        rnd = RoundStream(asyncio.get_running_loop())
        live = p.stream or bool(p.stops)
        try:
            agent, rid = await self._submit(rnd, sid, prompt, p, live, retention)
        except RolloutError as e:
            await self._close_one_off(rnd)
            raise self._rollout_error(e) from None
        except BaseException:  # cancelled (the client left) while opening or submitting
            await self._close_one_off(rnd)
            raise
        text = TextStream(
            self.tok, p.stops, [] if p.ignore_eos else self.tok.eos_ids, p.sampling.min_tokens
        )
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        resp: web.StreamResponse | None = None
        self.running[ident] = rnd.fut.request
        try:
            if p.stream:
                headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                if sid is not None:  # a fork's new session is named here
                    headers[request_checks.SESSION_HEADER] = sid
                resp = web.StreamResponse(headers=headers)
                await resp.prepare(request)
                if chat:
                    first = responses.chunk(
                        ident, self.cfg.model, chat, {"role": "assistant", "content": ""}
                    )
                    await self._send(request, resp, first)
            send = functools.partial(self._send, request, resp) if resp is not None else None
            await responses.relay(self, rnd, text, p, chat, ident, send)
            asked = p.sampling.logprobs is not None
            try:
                res = await rnd.result()
            except RolloutError as e:
                raise self._rollout_error(e) from None
            if agent is not None:
                agent.context = prompt + list(res.tokens)
            self.metrics.observe(res)
            rest = text.close()
            finish = "stop" if res.finish_reason != "length" or text.stopped else "length"
            if res.finish_reason == "abort" and not text.stopped:
                finish = "abort"  # (as vLLM answers an aborted request)
            # a stop string bills the tokens up to it: those decoded before the finish took
            # effect still extend the session (and its KV), not the answer
            answer = list(res.tokens[: text.used]) if text.stopped else list(res.tokens)
            usage = responses.usage(res, len(answer))
            extra = responses.extension(res, sid)
            if resp is not None:
                last = responses.chunk(ident, self.cfg.model, chat, rest, None, finish)
                last["dualpath"] = extra
                await self._send(request, resp, last)
                if p.include_usage:
                    tail = {**responses.chunk(ident, self.cfg.model, chat, None), "choices": []}
                    await self._send(request, resp, {**tail, "usage": usage, "dualpath": extra})
                await self._send(request, resp, responses.DONE)
                return resp
            lp = res.logprobs if asked else None
            choice = responses.choice(self.tok, chat, 0, text.text, finish, answer, lp, p.token_ids)
            body = {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.cfg.model,
                "choices": [choice],
                "usage": usage,
                "dualpath": extra,
            }
            if p.token_ids:
                body["prompt_token_ids"] = prompt
            headers = {responses.READ_PATH_HEADER: res.read_path or "none"}
            if sid is not None:  # a fork's new session is named here
                headers[request_checks.SESSION_HEADER] = sid
            return web.json_response(body, headers=headers)
        except TimeoutError:
            self.client.cancel(rnd.fut.request)
            e = ApiError(503, "the round timed out", retry_after=self.cfg.retry_after_s)
            if resp is None:
                raise e from None
            await self._send(request, resp, e.body())
            await self._send(request, resp, responses.DONE)
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            if rnd.fut is not None and not rnd.fut.done():
                self.client.cancel(rnd.fut.request)  # frees its slot; the session stays as it was
            raise
        except ApiError as e:
            if resp is None:
                raise
            await self._send(request, resp, e.body())  # the stream has begun: its last event
            await self._send(request, resp, responses.DONE)
            return resp
        finally:
            self.running.pop(ident, None)
            await self._close_one_off(rnd)

    async def _close_one_off(self, rnd: RoundStream) -> None:
        """Closes the round's one-off session (if it opened one) after its open completes, in a
        task of its own that a cancelled handler waits for but cannot cancel."""
        opening, rnd.opening = rnd.opening, None
        if opening is None:
            return
        rid = rnd.one_off

        async def close() -> None:
            try:
                await opening
            except Exception:  # noqa: BLE001 - never opened: nothing to close
                return
            try:
                await self._call(self.client.close_session, rid)
            except RolloutError as e:
                log.warning("closing session %s failed: %s", rid, e)

        task = asyncio.ensure_future(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)
