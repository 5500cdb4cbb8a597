"""Requests with `n` > 1 (group sampling): `n` choices of one prompt through
`Client.submit_group` (the prompt is prefilled once, the other choices fork its KV on the decode
engine; docs/serving.md), answered whole or streamed (each chunk names its choice's `index`); a
stop string finishes its own choice's round as it is found."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from dualpath_jax.serving import responses
from dualpath_jax.serving.protocol import ApiError
from dualpath_jax.serving.request_checks import RoundParams
from dualpath_jax.serving.responses import RoundStream
from dualpath_jax.serving.text import TextStream
from dualpath_jax.wire.client import RolloutError

# Choice i of a request with n > 1 samples with the request's seed plus i times this (mod 2**32):
# distinct seeds, the same for the same request seed.
SEED_STEP = 0x9E3779B1


async def respond(
    server: Any, request: web.Request, n: int, prompt: list[int], p: RoundParams, chat: bool
) -> web.StreamResponse:
    """`n` choices of one prompt (`Client.submit_group`: the prompt is prefilled once), each
    in a one-off session (an agent session is not advanced by a request with n > 1). Choice
    i samples with the request's seed advanced by i (reproducible with a `seed`)."""
    samplings = [
        msgspec.structs.replace(p.sampling, seed=(p.sampling.seed + i * SEED_STEP) % 2**32)
        for i in range(n)
    ]
    sids = [f"http-{uuid.uuid4().hex}" for _ in range(n)]
    opened: list[str] = []
    try:
        for sid in sids:
            await server._call(server.client.open_session, sid)
            opened.append(sid)
        return await _choices(server, request, prompt, p, chat, samplings, sids)
    except RolloutError as e:
        raise server._rollout_error(e) from None
    finally:
        for sid in opened:
            task = asyncio.ensure_future(server._call(server.client.close_session, sid))
            server._closing.add(task)
            task.add_done_callback(server._closing.discard)


async def _choices(
    server: Any,
    request: web.Request,
    prompt: list[int],
    p: RoundParams,
    chat: bool,
    samplings: list,
    sids: list[str],
) -> web.StreamResponse:
    """Runs the group and answers: whole (one body with every choice) or streamed, the choices'
    chunks as they come, each with its choice's `index` (a chat choice's first chunk is its
    role), each choice's last chunk with its `finish_reason` and `dualpath` extension, then
    `usage` (with `stream_options.include_usage`) and `[DONE]`. With a stop string every
    choice's tokens are followed as they come (`responses.relay`), so each round finishes at its
    own stop."""
    loop = asyncio.get_running_loop()
    live = p.stream or bool(p.stops)
    rnds = [RoundStream(loop) for _ in sids]
    futs = server.client.submit_group(
        sids,
        prompt,
        p.max_tokens,
        samplings=samplings,
        stop_tokens=[] if p.ignore_eos else server.tok.eos_ids,
        timeout_s=server.cfg.round_timeout_s,
        on_tokens=[r.on_tokens for r in rnds] if live else None,
    )
    for r, f in zip(rnds, futs):
        r.fut = f
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    model = server.cfg.model
    resp: web.StreamResponse | None = None
    if p.stream:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
    lock = asyncio.Lock()  # one event at a time on the stream

    async def send(data: Any) -> None:
        async with lock:
            await server._send(request, resp, data)

    done: dict[int, tuple[Any, TextStream]] = {}  # choice -> its result and text

    async def choice(i: int) -> None:
        text = TextStream(
            server.tok, p.stops, [] if p.ignore_eos else server.tok.eos_ids, p.sampling.min_tokens
        )
        if resp is not None and chat:
            role = {"role": "assistant", "content": ""}
            await send(responses.chunk(ident, model, chat, role, index=i))
        if live:
            await responses.relay(
                server, rnds[i], text, p, chat, ident, send if resp is not None else None, i
            )
            res = await rnds[i].result()
        else:
            res = await asyncio.wait_for(rnds[i].result(), server.cfg.round_timeout_s)
            text.add(list(res.tokens))
        server.metrics.observe(res)
        rest = text.close()
        done[i] = (res, text)
        if resp is not None:
            last = responses.chunk(ident, model, chat, rest, None, _finish(res, text), index=i)
            last["dualpath"] = responses.extension(res, None)
            await send(last)

    tasks = [asyncio.ensure_future(choice(i)) for i in range(len(sids))]
    try:
        await asyncio.gather(*tasks)
    except BaseException as e:
        for t in tasks:
            t.cancel()
        for f in futs:
            if not f.done():
                server.client.cancel(f.request)
        if isinstance(e, TimeoutError):
            e = ApiError(503, "the round timed out", retry_after=server.cfg.retry_after_s)
        elif isinstance(e, RolloutError):
            e = server._rollout_error(e)
        if resp is None or not isinstance(e, ApiError):
            raise e from None  # (the client left, or the server failed: as it is)
        await server._send(request, resp, e.body())  # the stream has begun: its last event
        await server._send(request, resp, responses.DONE)
        return resp
    answers = [_answer(*done[i]) for i in range(len(sids))]
    first = done[0][0]
    usage = responses.usage(first, sum(len(a) for a in answers))
    usage["prompt_tokens_details"]["cached_tokens"] = min(r.cached_tokens for r, _ in done.values())
    if resp is not None:
        if p.include_usage:
            tail = {**responses.chunk(ident, model, chat, None), "choices": []}
            await send({**tail, "usage": usage})
        await send(responses.DONE)
        return resp
    choices = []
    for i, answer in enumerate(answers):
        res, text = done[i]
        lp = res.logprobs if p.sampling.logprobs is not None else None
        choices.append(
            responses.choice(
                server.tok, chat, i, text.text, _finish(res, text), answer, lp, p.token_ids
            )
        )
    body = {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "dualpath": responses.extension(first, None),
    }
    if p.token_ids:
        body["prompt_token_ids"] = prompt
    return web.json_response(body)


def _answer(res: Any, text: TextStream) -> list[int]:
    """The choice's tokens: up to its stop string's, else every one it generated."""
    return list(res.tokens[: text.used]) if text.stopped else list(res.tokens)


def _finish(res: Any, text: TextStream) -> str:
    return "stop" if res.finish_reason != "length" or text.stopped else "length"
