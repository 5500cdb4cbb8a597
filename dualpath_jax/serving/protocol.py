"""The OpenAI request bodies the server takes (msgspec structs), and its error responses.

Only what the server implements is accepted: `n=1`, no echo, no tools. Unknown fields are
ignored, as OpenAI clients send many. Log-probabilities as OpenAI asks for them: completions'
`logprobs` (an integer: that many alternatives per token), chat's `logprobs` (true) with
`top_logprobs`, at most `MAX_TOP_LOGPROBS` alternatives. Three extensions, as vLLM names them:
`ignore_eos` (generate exactly `max_tokens` tokens), `return_token_ids` (each choice carries
`token_ids`, the generated ids, and the response `prompt_token_ids`) and `min_tokens` (neither
an end-of-turn token nor a stop string ends the answer before it has this many tokens).
"""

from __future__ import annotations

from typing import Any

import msgspec


class ApiError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
    `retry_after` (seconds) adds a `Retry-After` header (429 and 503)."""

    TYPES = {
        401: "authentication_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message = status, message
        self.param, self.code, self.retry_after = param, code, retry_after

    def body(self) -> dict[str, Any]:
        # as OpenAI: any other client error (400, 404 unknown model or route, 405 method) is an
        # invalid request; a server's own failure a server error
        other = "invalid_request_error" if self.status < 500 else "server_error"
        kind = self.TYPES.get(self.status, other)
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None  # None: the one model served (as vLLM)
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    conversation_id: str | None = None  # a session id, as some clients send it
    session_hint: str | dict | None = None  # engine.hints (X-Session-Hint in a header)
    # extensions
    ignore_eos: bool = False
    return_token_ids: bool = False
    min_tokens: int = 0  # no end-of-turn token or stop string ends the answer before this many


class CompletionRequest(_Common, kw_only=True):
    # A string, or token ids (a list of ints); OpenAI's batches of prompts are refused.
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None  # each token's log-probability, with this many alternatives


class ChatRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: Any = None
    logprobs: bool | None = None  # each token's log-probability ...
    top_logprobs: int | None = None  # ... with this many alternatives


def parse(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """A request body as `kind`; malformed JSON or a field of the wrong type is a 400 naming it."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rsplit("$.", 1)[-1].split("[")[0].rstrip("`") if "$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec's own depth limit: not a server failure
        raise ApiError(400, "the body's JSON is nested too deeply") from None
