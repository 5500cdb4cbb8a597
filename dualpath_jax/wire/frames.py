"""Frames: each control message travels as `Envelope(v=SCHEMA_VERSION, token=..., body=...)`,
msgpack-encoded (`encode` / `decode`). Receivers reject frames with another version, a wrong
token, an unknown tag or over the size limit, answering with `Error`. A frame's token says which
role sent it (`ENGINE` or `CLIENT`, `decode_role`). Senders refuse frames over `MAX_FRAME_BYTES`
before they leave; a peer that sends one anyway is disconnected by ZeroMQ.
"""

from __future__ import annotations

import hmac

import msgspec

from dualpath_jax.wire.messages import Body, Error, Msg

SCHEMA_VERSION = 6
MAX_FRAME_BYTES = 64 * 2**20
ENGINE, CLIENT = "engine", "client"


class Envelope(msgspec.Struct):
    v: int
    token: str
    body: Body


class FrameError(ValueError):
    """A frame could not be accepted (size, version, token, schema)."""


class _Head(msgspec.Struct):
    """An envelope's version and token alone: decoding it skips the body without building it."""

    v: int
    token: str


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_head_decoder = msgspec.msgpack.Decoder(_Head)


class AuthError(FrameError):
    """A frame carried a token this side does not accept."""


def encode(body: Msg, token: str = "") -> bytes:
    """One frame; raises `FrameError` if a field cannot be encoded (e.g. an int of 2**64) or the
    frame exceeds `MAX_FRAME_BYTES`, so nothing malformed or oversized is ever sent."""
    try:
        frame = _encoder.encode(Envelope(SCHEMA_VERSION, token, body))
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        raise FrameError(f"cannot encode {type(body).__name__}: {e}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError(
            f"{type(body).__name__} of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
        )
    return frame


def _head(frame: bytes) -> _Head:
    """The frame's version and token, checked before anything of its body is built: a stranger's
    frame costs a scan, not its objects."""
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        head = _head_decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise FrameError(f"malformed message: {e}") from None
    if head.v != SCHEMA_VERSION:
        raise FrameError(
            f"schema version {head.v} is not supported (this side speaks {SCHEMA_VERSION})"
        )
    return head


def _body(frame: bytes) -> Msg:
    """The body of a frame whose head `_head` has checked."""
    try:
        return _decoder.decode(frame).body
    except msgspec.DecodeError as e:
        raise FrameError(f"malformed message: {e}") from None


def decode(frame: bytes, token: str = "") -> Msg:
    """Checks one frame's version and token, then decodes its body; raises `FrameError` naming
    the problem."""
    head = _head(frame)
    if not hmac.compare_digest(head.token.encode(), token.encode()):
        raise AuthError("authentication failed: wrong or missing token")
    return _body(frame)


def decode_role(frame: bytes, tokens: dict[str, str]) -> tuple[Msg, str]:
    """Checks a frame's token, names the role whose token it carries (`tokens`: role -> secret)
    and decodes its body. With no tokens configured every frame is the engine role's (a
    loopback-only setup)."""
    head = _head(frame)
    if not tokens:
        return _body(frame), ENGINE
    for role, secret in tokens.items():
        if hmac.compare_digest(head.token.encode(), secret.encode()):
            return _body(frame), role
    raise AuthError("authentication failed: wrong or missing token")


def decode_unsigned_error(frame: bytes) -> Error | None:
    """The `Error` a server sends, without a token, to a peer whose frame it rejected (the server
    must not reveal its token to a stranger); None for anything else."""
    try:
        if _head(frame).token:
            return None
        body = _body(frame)
    except FrameError:
        return None
    return body if isinstance(body, Error) else None
