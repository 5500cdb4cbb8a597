"""Requests with `n` > 1 (group sampling): `n` choices of one prompt through
`Client.submit_group` (the prompt is prefilled once, the other choices fork its KV on the decode
engine; docs/serving.md), answered whole or streamed (each chunk names its choice's `index`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from dualpath_jax.engine.client import RolloutError
from dualpath_jax.serving import responses
from dualpath_jax.serving.protocol import ApiError
from dualpath_jax.serving.request_checks import RoundParams
from dualpath_jax.serving.responses import RoundStream
from dualpath_jax.serving.text import TextStream

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
        if p.stream:
            return await _stream(server, request, prompt, p, chat, samplings, sids)
        futs = _submit(server, sids, prompt, p, samplings)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(asyncio.wrap_future(f) for f in futs)),
                server.cfg.round_timeout_s,
            )
        except TimeoutError:
            for f in futs:
                if getattr(f, "request", ""):
                    server.client.cancel(f.request)
            raise ApiError(
                503, "the round timed out", retry_after=server.cfg.retry_after_s
            ) from None
    except RolloutError as e:
        raise server._rollout_error(e) from None
    finally:
        for sid in opened:
            task = asyncio.ensure_future(server._call(server.client.close_session, sid))
            server._closing.add(task)
            task.add_done_callback(server._closing.discard)
    choices, generated = [], 0
    for i, res in enumerate(results):
        server.metrics.observe(res)
        text = TextStream(
            server.tok, p.stops, [] if p.ignore_eos else server.tok.eos_ids, p.sampling.min_tokens
        )
        text.add(list(res.tokens))
        text.close()
        answer = list(res.tokens[: text.used]) if text.stopped else list(res.tokens)
        generated += len(answer)
        finish = "stop" if res.finish_reason != "length" or text.stopped else "length"
        lp = res.logprobs if p.sampling.logprobs is not None else None
        choices.append(
            responses.choice(server.tok, chat, i, text.text, finish, answer, lp, p.token_ids)
        )
    first = results[0]
    usage = responses.usage(first, generated)
    usage["prompt_tokens_details"]["cached_tokens"] = min(r.cached_tokens for r in results)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": server.cfg.model,
        "choices": choices,
        "usage": usage,
        "dualpath": responses.extension(first, None),
    }
    if p.token_ids:
        body["prompt_token_ids"] = prompt
    return web.json_response(body)


def _submit(
    server: Any,
    sids: list[str],
    prompt: list[int],
    p: RoundParams,
    samplings: list,
    on_tokens: list | None = None,
) -> list:
    """The group's rounds (`Client.submit_group`), one per one-off session."""
    return server.client.submit_group(
        sids,
        prompt,
        p.max_tokens,
        samplings=samplings,
        stop_tokens=[] if p.ignore_eos else server.tok.eos_ids,
        timeout_s=server.cfg.round_timeout_s,
        on_tokens=on_tokens,
    )


async def _stream(
    server: Any,
    request: web.Request,
    prompt: list[int],
    p: RoundParams,
    chat: bool,
    samplings: list,
    sids: list[str],
) -> web.StreamResponse:
    """The `n` choices streamed as they come, each chunk with its choice's `index` (a chat
    choice's first chunk is its role), a stop string finishing its own choice; each choice's
    last chunk carries its `finish_reason` and `dualpath` extension; then `usage` (with
    `stream_options.include_usage`) and `[DONE]`."""
    loop = asyncio.get_running_loop()
    rnds = [RoundStream(loop) for _ in sids]
    futs = _submit(server, sids, prompt, p, samplings, [r.on_tokens for r in rnds])
    for r, f in zip(rnds, futs):
        r.fut = f
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    model = server.cfg.model
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    lock = asyncio.Lock()  # one event at a time on the stream

    async def send(data: Any) -> None:
        async with lock:
            await server._send(request, resp, data)

    done: dict[int, tuple[Any, int]] = {}  # choice -> (its result, its answer's tokens)

    async def choice(i: int) -> None:
        text = TextStream(
            server.tok, p.stops, [] if p.ignore_eos else server.tok.eos_ids, p.sampling.min_tokens
        )
        if chat:
            await send(
                responses.chunk(ident, model, chat, {"role": "assistant", "content": ""}, index=i)
            )
        await responses.relay(server, rnds[i], text, p, chat, ident, send, i)
        res = await rnds[i].result()
        server.metrics.observe(res)
        rest = text.close()
        finish = "stop" if res.finish_reason != "length" or text.stopped else "length"
        last = responses.chunk(ident, model, chat, rest, None, finish, index=i)
        last["dualpath"] = responses.extension(res, None)
        await send(last)
        done[i] = (res, len(res.tokens[: text.used]) if text.stopped else len(res.tokens))

    tasks = [asyncio.ensure_future(choice(i)) for i in range(len(sids))]
    try:
        await asyncio.gather(*tasks)
    except BaseException as e:
        for t in tasks:
            t.cancel()
        for f in futs:
            if not f.done():
                server.client.cancel(f.request)
        if isinstance(e, RolloutError | TimeoutError):
            err = (
                server._rollout_error(e)
                if isinstance(e, RolloutError)
                else ApiError(503, "the round timed out", retry_after=server.cfg.retry_after_s)
            )
            await server._send(request, resp, err.body())  # the stream has begun: its last event
            await server._send(request, resp, responses.DONE)
            return resp
        raise  # the client left (cancelled), or the server failed
    if p.include_usage:
        usage = responses.usage(done[0][0], sum(n for _, n in done.values()))
        cached = min(r.cached_tokens for r, _ in done.values())
        usage["prompt_tokens_details"]["cached_tokens"] = cached
        tail = {**responses.chunk(ident, model, chat, None), "choices": []}
        await send({**tail, "usage": usage})
    await send(responses.DONE)
    return resp
