"""How the server answers a round: its generated tokens as they come (`RoundStream`), and the
OpenAI response pieces built from them: stream chunks sent as server-sent events, `usage`,
`logprobs` in OpenAI's chat and completion shapes, and the `dualpath` extension (the read path
and the router's timings).

Log-probabilities are the model's (its log-softmax, as vLLM reports them by default), and each
token also carries `sampling_logprob`, its log-probability under the distribution it was drawn
from (temperature and top-p applied), for trainers that want that one."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent import futures
from typing import Any

from dualpath_jax.results import Logprobs
from dualpath_jax.serving.tokenizer import Tokenizer
from dualpath_jax.wire import messages

READ_PATH_HEADER = "X-DualPath-Read-Path"


class RoundStream:
    """One submitted round: its streamed token deltas (`deltas()`), then its `RoundResult`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, list[int], Logprobs | None]] = asyncio.Queue()
        self.fut: futures.Future | None = None
        self.have = 0  # generated tokens passed on so far
        self.logprobs = Logprobs()  # theirs, when the round asked for them
        self.one_off: str | None = None  # the round's own router session, if it has one
        self.opening: asyncio.Future | None = None  # ... and its open (closed after it)

    def on_tokens(
        self, start: int, tokens: list[int], logprobs: Logprobs | None = None
    ) -> None:  # the client's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (start, tokens, logprobs))

    def _new(self, start: int, tokens: list[int], logprobs: Logprobs | None = None) -> list[int]:
        """The tokens past what was passed on (a retried round streams positions again); their
        log-probabilities join `logprobs`."""
        if start + len(tokens) <= self.have or start > self.have:
            return []
        out = tokens[self.have - start :]
        if logprobs is not None:
            self.logprobs.extend(logprobs.tail(self.have - start))
        self.have += len(out)
        return out

    async def deltas(self, timeout_s: float) -> AsyncIterator[list[int]]:
        """New generated tokens as they come, until the round is over; raises TimeoutError if
        it is not over within `timeout_s`."""
        assert self.fut is not None
        done = asyncio.wrap_future(self.fut)
        # A round whose handler was cancelled (the client left) still ends; nobody awaits it.
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        deadline = time.monotonic() + timeout_s
        while True:
            get = asyncio.ensure_future(self.queue.get())
            left = deadline - time.monotonic()
            try:
                await asyncio.wait({get, done}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:  # also when the handler is cancelled (its client left) in this wait
                if not get.done():
                    get.cancel()
            if not get.done() or get.cancelled():
                if not done.done():
                    raise TimeoutError
                break
            new = self._new(*get.result())
            if new:
                yield new
        while not self.queue.empty():
            new = self._new(*self.queue.get_nowait())
            if new:
                yield new
        if not done.exception():
            res = done.result()
            rest = self._new(0, list(res.tokens), res.logprobs)
            if rest:
                yield rest

    async def result(self) -> messages.RoundResult:
        assert self.fut is not None
        return await asyncio.wrap_future(self.fut)


async def relay(
    server: Any,
    rnd: RoundStream,
    text: Any,
    p: Any,
    chat: bool,
    ident: str,
    send: Callable[[dict], Awaitable[None]] | None,
    index: int = 0,
) -> None:
    """Takes round `rnd`'s tokens into `text` (a `TextStream`) as they come, until the round
    is over: a stop string finishes the round there (it completes and keeps its KV); with
    `send` (a stream) each delta goes out as a chunk of choice `index`, with its token ids and
    log-probabilities when `p` (the `RoundParams`) asks for them. `server`: the `ApiServer`."""
    finishing = False
    asked = p.sampling.logprobs is not None
    streamed = 0  # generated ids of the answer streamed so far
    shown = 0  # characters of its text streamed so far (a completion's text_offset)
    async for new in rnd.deltas(server.cfg.round_timeout_s):
        was_stopped = text.stopped
        delta = text.add(new)
        if text.stopped and not finishing and rnd.fut is not None:
            finishing = True  # the round completes now and keeps its KV
            server.client.finish(rnd.fut.request)
        used = new[: max(0, text.used - streamed)]  # the answer's ids among them
        ids = used if p.token_ids else None
        lp = None
        if asked and used:
            lp = logprobs_field(server.tok, chat, used, rnd.logprobs.tail(streamed), shown)
        streamed += len(used)
        if send is not None and not was_stopped and (delta or ids or lp):
            await send(chunk(ident, server.cfg.model, chat, delta, ids, logprobs=lp, index=index))
        shown += len(delta)


def chunk(
    ident: str,
    model: str,
    chat: bool,
    delta: Any,
    token_ids: list[int] | None = None,
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One stream chunk of response `ident`, choice `index`: a chat delta (a dict, or text) or
    completion text, with its tokens' `logprobs` (`logprobs_field`) when the request asked for
    them."""
    if chat:
        content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
        choice: dict[str, Any] = {"index": index, "delta": content, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
    else:
        choice = {
            "index": index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs,
        }  # fmt: skip
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": ident,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


DONE = b"data: [DONE]\n\n"  # a stream's last event


def event(data: dict) -> bytes:
    """`data` as one server-sent event."""
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def usage(res: messages.RoundResult, completion_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's `usage`; `completion_tokens` (default: every generated token) counts what the
    answer is made of when a stop string ended it early."""
    n = len(res.tokens) if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": res.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": res.cached_tokens},
    }


def extension(res: messages.RoundResult, sid: str | None) -> dict[str, Any]:
    """The `dualpath` field of a response: the read path, the session and the router's timings."""
    return {
        "read_path": res.read_path or "none",
        "session": sid,
        "ttft_s": res.ttft_s,
        "tpot_s": res.tpot_s,
        "jct_s": res.jct_s,
        "queue_s": res.queue_s,
        "recomputed_blocks": res.recomputed_blocks,
    }


def choice(
    tok: Tokenizer,
    chat: bool,
    index: int,
    text: str,
    finish: str,
    answer: list[int],
    logprobs: Logprobs | None,
    token_ids: bool,
) -> dict[str, Any]:
    """One choice of a whole (not streamed) response: its `text` (chat: the assistant's message),
    `finish` reason, the `answer`'s ids when `token_ids` and their `logprobs` when given."""
    out: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
    if logprobs is not None:
        out["logprobs"] = logprobs_field(tok, chat, answer, logprobs.head(len(answer)))
    if chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    if token_ids:
        out["token_ids"] = answer
    return out


def logprobs_field(
    tok: Tokenizer, chat: bool, ids: list[int], lp: Logprobs, offset: int = 0
) -> dict[str, Any]:
    """A choice's `logprobs` for the generated `ids` with their entries `lp`, in OpenAI's shape:
    chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` or a completion's `{tokens,
    token_logprobs, top_logprobs, text_offset}` (`offset`: where the first token's text starts
    in the completion). Each token's text is its own decoding; `sampling_logprob(s)` is the
    extension (see the module docstring)."""
    text = [tok.decode([i]) for i in ids]
    tops = lp.top_ids[: len(ids)] if lp.top_ids else [[] for _ in ids]
    top_vals = lp.top[: len(ids)] if lp.top else [[] for _ in ids]
    if chat:
        content = []
        for k, t in enumerate(text):
            alts = [
                {"token": a, "logprob": v, "bytes": list(a.encode())}
                for a, v in zip((tok.decode([j]) for j in tops[k]), top_vals[k])
            ]
            content.append(
                {
                    "token": t,
                    "logprob": lp.model[k],
                    "bytes": list(t.encode()),
                    "top_logprobs": alts,
                    "sampling_logprob": lp.sampled[k],
                }
            )
        return {"content": content}
    offsets, at = [], offset
    for t in text:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": text,
        "token_logprobs": lp.model[: len(ids)],
        "top_logprobs": (
            [{tok.decode([j]): v for j, v in zip(tops[k], top_vals[k])} for k in range(len(ids))]
            if lp.top_ids
            else None
        ),
        "text_offset": offsets,
        "sampling_logprobs": lp.sampled[: len(ids)],
    }
