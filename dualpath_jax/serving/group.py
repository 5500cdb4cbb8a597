"""Requests with `n` > 1 (group sampling): `n` choices of one prompt through
`Client.submit_group` (the prompt is prefilled once and its KV stored once; docs/serving.md)."""

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
from dualpath_jax.serving.text import TextStream

# Choice i of a request with n > 1 samples with the request's seed plus i times this (mod 2**32):
# distinct seeds, the same for the same request seed.
SEED_STEP = 0x9E3779B1


async def respond(
    server: Any, n: int, prompt: list[int], p: RoundParams, chat: bool
) -> web.Response:
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
        futs = server.client.submit_group(
            sids,
            prompt,
            p.max_tokens,
            samplings=samplings,
            stop_tokens=[] if p.ignore_eos else server.tok.eos_ids,
            timeout_s=server.cfg.round_timeout_s,
        )
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
