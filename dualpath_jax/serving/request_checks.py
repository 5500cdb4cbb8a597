"""What a request asks the server for, checked: the model, its prompt as token ids, its round's
parameters (`RoundParams`), its agent session and the session's KV retention. A bad value raises
`ApiError(400)` naming its field (or header), before anything is submitted."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from aiohttp import web

from dualpath_jax.model.sampling_params import SamplingError, SamplingParams
from dualpath_jax.serving.protocol import ApiError, CompletionRequest
from dualpath_jax.serving.tokenizer import Tokenizer
from dualpath_jax.wire import hints
from dualpath_jax.wire.client_checks import RolloutError

SESSION_HEADER = "X-Session-Id"
# What peers' clients send as a session id, after SESSION_HEADER, in this order of precedence
# (then the body's `conversation_id`, then its `user`): AIPerf's and vLLM's benchmark clients.
SESSION_HEADERS = (SESSION_HEADER, "X-Session-Affinity", "X-Correlation-Id")
PRIORITY_HEADER = "X-Session-Priority"
TTL_HEADER = "X-Session-TTL"
HINT_HEADER = "X-Session-Hint"
MAX_SESSION_ID = 256
MAX_TTL_S = 1e9  # the router's bound (engine.retention.retention_problem)
MAX_N = 64  # choices per request (group sampling)


@dataclasses.dataclass
class RoundParams:
    """How a request's round runs and answers (`round_params`)."""

    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    token_ids: bool


def bearer(request: web.Request) -> str:
    """The key of an `Authorization: Bearer KEY` header ("" without one)."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def check_common(req: Any, model: str) -> None:
    """What completions and chat requests both must be: for `model` (or naming none), at most
    `MAX_N` choices. Another model is a 404 `model_not_found`,
    as OpenAI answers it."""
    if req.model is not None and req.model != model:
        raise ApiError(
            404,
            f"the model {req.model!r} does not exist here (this server serves {model!r})",
            param="model",
            code="model_not_found",
        )
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must lie in [1, {MAX_N}], got {req.n}", param="n")


def logprobs_asked(req: Any) -> tuple[int | None, str]:
    """`SamplingParams.logprobs` for a request (None: none asked) and the field that asked:
    a completion's `logprobs` (alternatives per token), or chat's `logprobs: true` with
    `top_logprobs` (which needs it, as OpenAI checks)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs, "logprobs"
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if not req.logprobs:
        return None, "logprobs"
    return (req.top_logprobs or 0), "top_logprobs" if req.top_logprobs else "logprobs"


def completion_prompt(prompt: Any, tok: Tokenizer, vocab_size: int) -> list[int]:
    """A completion's prompt as token ids: a string encoded by `tok`, or token ids below
    `vocab_size` (either alone or as a batch of one)."""
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of range [0, {vocab_size})", param="prompt")
    elif prompt and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return completion_prompt(prompt[0], tok, vocab_size)  # a batch of one prompt
    else:
        raise ApiError(
            400, "prompt must be a string or a non-empty list of token ids", param="prompt"
        )
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def round_params(
    req: Any,
    max_tokens: int | None,
    prompt_len: int,
    *,
    max_context: int,
    default_max_tokens: int,
) -> RoundParams:
    """The round a request of `prompt_len` tokens asks for: at most `max_tokens` (None: the
    default, clipped to the room left in `max_context`), its sampling (a random seed unless it
    names one; `min_tokens` at most the round's tokens), stop strings and how it answers."""
    room = max_context - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this model's context is {max_context} tokens",
            param="prompt" if isinstance(req, CompletionRequest) else "messages",
            code="context_length_exceeded",
        )
    n = default_max_tokens if max_tokens is None else max_tokens
    n = min(n, room) if max_tokens is None else n
    if n < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {n}", param="max_tokens")
    if prompt_len + n > max_context:
        raise ApiError(
            400,
            f"the prompt ({prompt_len} tokens) plus max_tokens ({n}) exceeds this model's"
            f" context of {max_context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    t = 1.0 if req.temperature is None else req.temperature
    if t > 2:  # the API's range; SamplingParams checks the rest
        raise ApiError(400, f"temperature must lie in [0, 2], got {t}", param="temperature")
    if not 0 <= req.min_tokens <= n:
        raise ApiError(
            400, f"min_tokens must lie in [0, max_tokens={n}], got {req.min_tokens}",
            param="min_tokens",
        )  # fmt: skip
    seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(4), "little")
    logprobs, field = logprobs_asked(req)
    try:
        sampling = SamplingParams(
            temperature=t,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=seed,
            min_tokens=req.min_tokens,  # the end-of-turn ids' logits are masked until then
            logprobs=logprobs,
        )
    except SamplingError as e:
        raise ApiError(400, str(e), param=field if e.field == "logprobs" else e.field) from None
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
        raise ApiError(400, "at most 4 stop sequences", param="stop")
    return RoundParams(
        max_tokens=n,
        sampling=sampling,
        stops=stops,
        ignore_eos=req.ignore_eos,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        token_ids=req.return_token_ids,
    )


def session_id(request: web.Request, req: Any) -> str | None:
    """The request's agent session: the first of the `SESSION_HEADERS` present, else the body's
    `conversation_id`, else its `user`; None: a one-off session."""
    field = next((h for h in SESSION_HEADERS if request.headers.get(h)), None)
    sid = request.headers[field] if field else None
    for name in ("conversation_id", "user"):
        if sid is None and getattr(req, name):
            field, sid = name, getattr(req, name)
    if sid is None:
        return None
    return check_session_id(sid, field)


def check_session_id(sid: str, param: str) -> str:
    """`sid` if it is a usable session id (at most MAX_SESSION_ID printable characters), else a
    400 naming `param`."""
    if len(sid) > MAX_SESSION_ID or not sid.isprintable():
        raise ApiError(
            400, f"a session id is at most {MAX_SESSION_ID} printable characters", param=param
        )
    return sid


def retention(
    request: web.Request, max_priority: int = 2**31 - 1, max_ttl_s: float = MAX_TTL_S
) -> dict[str, Any]:
    """The `priority` and `ttl_s` for `Client.submit` from the `X-Session-Priority` and
    `X-Session-TTL` headers, only those present; a bad value, or one above the server's
    `max_priority` / `max_ttl_s`, is a 400 naming its header."""
    out: dict[str, Any] = {}
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is not None:
        try:
            priority = int(raw.strip())
        except ValueError:
            priority = None
        if priority is None or not -(2**31) <= priority <= max_priority:
            raise ApiError(
                400,
                f"{PRIORITY_HEADER} must be an integer in [-2**31, {max_priority}], got {raw!r}",
                param=PRIORITY_HEADER,
            )
        out["priority"] = priority
    raw = request.headers.get(TTL_HEADER)
    if raw is not None:
        try:
            ttl = float(raw.strip())
        except ValueError:
            ttl = math.nan
        cap = min(max_ttl_s, MAX_TTL_S)
        if not 0 <= ttl <= cap:  # NaN fails too
            raise ApiError(
                400,
                f"{TTL_HEADER} must be a number of seconds in [0, {cap:g}], got {raw!r}",
                param=TTL_HEADER,
            )
        out["ttl_s"] = ttl
    return out


def session_hint(
    request: web.Request,
    req: Any,
    sid: str | None,
    max_priority: int = 2**31 - 1,
    max_ttl_s: float = MAX_TTL_S,
) -> tuple[hints.SessionHint | None, dict[str, Any]]:
    """The request's session hint (`X-Session-Hint`, else the body's `session_hint`;
    `wire.hints`; None: none) and the retention keywords it sets: `tool_call`, `pin` and `ttl`
    set the session's retention from this round on (`pin` at the server's `max_priority` and
    `max_ttl_s`, a TTL capped at `max_ttl_s`); `release` and `fork` act around the round
    (serving/http_hints.py). A bad or unknown hint, or one without a session, is a 400."""
    raw = request.headers.get(HINT_HEADER)
    param = HINT_HEADER if raw is not None else "session_hint"
    raw = raw if raw is not None else getattr(req, "session_hint", None)
    if raw is None:
        return None, {}
    try:
        hint = hints.parse_hint(raw)
    except RolloutError as e:
        raise ApiError(400, str(e), param=param) from None
    if sid is None:
        raise ApiError(400, "a session hint needs a session (X-Session-Id)", param=param)
    out = hints.retention_of(hint)
    if "priority" in out:
        out["priority"] = min(out["priority"], max_priority)
    if "ttl_s" in out:
        out["ttl_s"] = min(out["ttl_s"], max_ttl_s, MAX_TTL_S)
    return hint, out
