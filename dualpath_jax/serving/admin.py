"""The admin plane RL frameworks drive an engine with, over HTTP, named as SGLang names it
(vLLM's RL endpoints agree where they overlap), behind the server's API key:

- `POST /pause_generation` `{"mode": "abort" | "wait"}`: start no more rounds (new requests
  wait, not refused) until resumed; "abort" ends the rounds in flight now (their responses come
  back with what they generated, `finish_reason: "abort"`), "wait" lets them finish; answers once
  none is in flight.
- `POST /resume_generation`: the waiting requests start.
- `POST /abort_requests` `{"request_ids": [...], "session_ids": [...], "abort_all": bool}`: ends
  those requests (a response `id`, as a stream's first chunk shows it) or the requests of those
  agent sessions (`X-Session-Id`), or all, with what they generated; answers with how many.
- `POST /update_weights_from_disk` `{"model_path": ..., "weight_version": ..., "pause": "wait" |
  "abort"}`: serve the checkpoint at `model_path` (every engine reads it) as `weight_version`
  (default: a fresh name); `{"success", "message", "weight_version"}`.
- `GET /get_model_info`: the model, its context and the weights version served.
- `GET /health_generate`: 200 once a one-token round went through the engines, else 503.

Every call goes to the router through the server's `Client` (`pause`, `resume`, `abort`,
`update_params_from_checkpoint`, `stats`); docs/serving.md and docs/rl.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from dualpath_jax.serving.protocol import ApiError, parse
from dualpath_jax.wire import messages
from dualpath_jax.wire.client import RolloutError

PATHS = frozenset(
    {
        "/pause_generation",
        "/resume_generation",
        "/abort_requests",
        "/update_weights_from_disk",
        "/get_model_info",
        "/health_generate",
    }
)


class PauseRequest(msgspec.Struct, kw_only=True):
    mode: str = "abort"  # SGLang's default


class AbortRequest(msgspec.Struct, kw_only=True):
    request_ids: list[str] = []
    session_ids: list[str] = []
    abort_all: bool = False


class UpdateWeightsRequest(msgspec.Struct, kw_only=True):
    model_path: str
    weight_version: str | None = None
    pause: str = "wait"


def _check_mode(mode: str, param: str) -> None:
    """A pause mode (`messages.PAUSE_MODES`), else a 400 naming `param`."""
    if mode not in messages.PAUSE_MODES:
        modes = list(messages.PAUSE_MODES)
        raise ApiError(400, f"{param} must be one of {modes}, got {mode!r}", param=param)


class Admin:
    """The admin endpoints of `server` (a `server.ApiServer`; `add_routes`)."""

    def __init__(self, server: Any):
        self.server = server

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/resume_generation", self.resume)
        app.router.add_post("/abort_requests", self.abort)
        app.router.add_post("/update_weights_from_disk", self.update_weights)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/health_generate", self.health_generate)

    async def _call(self, fn, *args, **kw) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))
        except RolloutError as e:
            raise self.server._rollout_error(e) from None  # noqa: SLF001 - one mapping

    async def _body(self, request: web.Request, kind: type) -> Any:
        raw = await self.server._body(request)  # noqa: SLF001 - the server's limits
        return parse(raw or b"{}", kind)

    async def pause(self, request: web.Request) -> web.Response:
        req = await self._body(request, PauseRequest)
        _check_mode(req.mode, "mode")
        await self._call(self.server.client.pause, req.mode)
        return web.json_response({"success": True, "mode": req.mode})

    async def resume(self, request: web.Request) -> web.Response:
        await self._call(self.server.client.resume)
        return web.json_response({"success": True})

    async def abort(self, request: web.Request) -> web.Response:
        req = await self._body(request, AbortRequest)
        running = self.server.running
        requests = [running[i] for i in req.request_ids if i in running]
        sessions = [
            self.server.sessions[s].router_id for s in req.session_ids if s in self.server.sessions
        ]
        ended: list[str] = []
        if requests or sessions or req.abort_all:
            ended = await self._call(
                self.server.client.abort, requests, sessions=sessions, all=req.abort_all
            )
        return web.json_response({"success": True, "aborted": len(ended)})

    async def update_weights(self, request: web.Request) -> web.Response:
        req = await self._body(request, UpdateWeightsRequest)
        _check_mode(req.pause, "pause")
        try:
            version = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: self.server.client.update_params_from_checkpoint(
                    req.model_path, req.weight_version, pause=req.pause
                ),
            )
        except (RolloutError, ValueError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response(
            {"success": True, "message": "weights updated", "weight_version": version}
        )

    async def model_info(self, request: web.Request) -> web.Response:
        stats = await self._call(self.server.client.stats, timeout_s=5.0)
        cfg = self.server.cfg
        return web.json_response(
            {
                "model_path": cfg.model,
                "max_model_len": cfg.max_context,
                "is_generation": True,
                "weight_version": stats.get("params_version", ""),
            }
        )

    async def health_generate(self, request: web.Request) -> web.Response:
        """One greedy token of a one-token prompt in a session of its own."""
        client = self.server.client
        sid = f"health-{id(request):x}-{asyncio.get_running_loop().time():.6f}"
        try:
            await self._call(client.open_session, sid)
            try:
                fut = client.submit(sid, [0], 1)
                await asyncio.wait_for(asyncio.wrap_future(fut), self.server.cfg.round_timeout_s)
            finally:
                await self._call(client.close_session, sid, True)
        except (ApiError, RolloutError, TimeoutError) as e:
            msg = str(e) or "no token within the round timeout"
            return web.json_response({"status": "unhealthy", "message": msg}, status=503)
        return web.json_response({"status": "ok"})
