"""Control-plane messages: msgspec structs, one tagged union, a versioned signed envelope.

Nothing on the wire is pickled: every message is a msgspec struct encoded as msgpack. Each frame
is `Envelope(v=SCHEMA_VERSION, token=..., body=<message>)`; receivers reject frames with another
version, a wrong token, an unknown tag or over the size limit, answering with `Error`.
"""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 64 * 2**20


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of every control message (tagged by class name)."""


# ----------------------------------------------------------------------------- client <-> router


class OpenSession(Msg):
    session: str


class CloseSession(Msg):
    session: str
    release: bool = False  # delete the trajectory's stored blocks no other trajectory uses


class Submit(Msg):
    """One round: append `append` to the session's context and generate exactly `gen` tokens.

    `temperature` 0 is greedy; above 0 the token at absolute position p of the sequence is drawn
    from softmax(logits / temperature) with the key `fold_in(key(seed), p)`, so a round's tokens
    depend only on (params, context, seed), never on batching, engine or retries."""

    request: str
    session: str
    append: list[int]
    gen: int
    temperature: float = 0.0
    seed: int = 0  # uint32


class Result(Msg):
    """The generated tokens of a round, with its timings (seconds, router clock)."""

    request: str
    tokens: list[int]
    ttft_s: float
    ttst_s: float
    tpot_s: float
    jct_s: float
    queue_s: float
    cached_tokens: int
    prompt_tokens: int
    read_path: str
    recomputed_blocks: int


class Ack(Msg):
    ref: str = ""


class Error(Msg):
    """A request or message was refused or failed; `message` says why."""

    ref: str
    message: str
    kind: str = "error"


class GetStats(Msg):
    pass


class Stats(Msg):
    json: str


class UpdateParams(Msg):
    """Client -> router: serve the parameters in `path` (an orbax checkpoint directory every
    engine can read) as `version`. Answered `Ack(ref="params:<version>")` once every live engine
    loaded and checked them, or `Error` (the old params stay). KV of older versions is never
    reused because the version enters the block-key fingerprint."""

    version: str
    path: str


class Shutdown(Msg):
    pass


# ----------------------------------------------------------------------------- engine <-> router


class Load(Msg):
    """An engine's load report (paper 6.1) and spare capacity. The router schedules on its own,
    always current, `seq_e`/`tok_e`/`read_q` (router.engine_load); what engines send there is
    their local view and is not used for scheduling."""

    seq_e: int = 0
    tok_e: int = 0
    read_q: int = 0
    hbm_capacity_tokens: int = 0  # DE: KV tokens its decode slots hold in all
    slots: int = 0  # DE: decode slots


class Register(Msg):
    role: str  # "prefill" | "decode"
    engine: int
    node: int
    group: int
    address: str  # KV channel address
    pid: int
    params_version: str = ""  # the version of the params the engine serves


class LoadParams(Msg):
    """Router -> engine: load and check the parameters in `path` (staged, not yet served)."""

    version: str
    path: str


class ParamsLoaded(Msg):
    """Engine -> router: the staged load of `version` succeeded (`ok`) or why not."""

    engine: int
    version: str
    ok: bool
    message: str = ""


class CommitParams(Msg):
    """Router -> engine: serve the staged `version` (`commit`) or drop it. Sent on the same
    socket before any job of the new version, so no job ever runs on the wrong params."""

    version: str
    commit: bool


class Heartbeat(Msg):
    """Sent by every engine from a thread of its own, so a long compile or forward in the engine
    loop never looks like a dead engine."""

    engine: int


class Fetch(Msg):
    """A leader engine asks for work for itself (groups of one engine in the local cluster)."""

    engine: int
    load: Load
    links: str = ""  # JSON snapshot of the engine's link counters (for metrics)


class LoadJobMsg(Msg):
    """The wire form of `transfer.loader.LoadJob` plus what the engine computes."""

    request: str
    keys: list[str]
    pe_blocks: int
    de_blocks: int
    prompt: list[int]
    gen: int
    pe_engine: int
    pe_node: int
    pe_address: str
    de_engine: int
    de_node: int
    de_address: str
    oracle: bool
    layerwise: bool
    params_version: str
    attempt: int = 0
    temperature: float = 0.0  # see Submit
    seed: int = 0


class Work(Msg):
    jobs: list[LoadJobMsg]


class PrefillDone(Msg):
    request: str
    engine: int
    first_token: int
    hit_blocks: int
    recomputed_blocks: int
    read_s: float
    prefill_s: float


class ReadsDone(Msg):
    """Engine -> router: this engine's share of a request's storage reads has finished, so its
    node's read queue (the scheduler's `read_q`) no longer holds those tokens."""

    request: str
    engine: int
    attempt: int = 0


class FirstToken(Msg):
    """Router -> DE: the PE's first generated token of a request."""

    request: str
    token: int
    hit_blocks: int


class TokensOut(Msg):
    """DE -> router: tokens generated so far for a request (streamed)."""

    request: str
    tokens: list[int]


class DecodeDone(Msg):
    request: str
    engine: int
    tokens: list[int]
    persisted_blocks: int


class Failed(Msg):
    """An engine could not finish its part of a request. `kind`: transfer (a peer vanished or
    timed out: the router retries the request), store, or error (reported to the client)."""

    request: str
    engine: int
    message: str
    kind: str = "error"


class Cancel(Msg):
    request: str


class Stop(Msg):
    pass


Body = (
    OpenSession
    | CloseSession
    | Submit
    | Result
    | Ack
    | Error
    | GetStats
    | Stats
    | UpdateParams
    | Shutdown
    | Load
    | Register
    | LoadParams
    | ParamsLoaded
    | CommitParams
    | Heartbeat
    | Fetch
    | LoadJobMsg
    | Work
    | PrefillDone
    | ReadsDone
    | FirstToken
    | TokensOut
    | DecodeDone
    | Failed
    | Cancel
    | Stop
)


class Envelope(msgspec.Struct):
    v: int
    token: str
    body: Body


class FrameError(ValueError):
    """A frame could not be accepted (size, version, token, schema)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(body: Msg, token: str = "") -> bytes:
    return _encoder.encode(Envelope(SCHEMA_VERSION, token, body))


def decode(frame: bytes, token: str = "") -> Msg:
    """Decodes and checks one frame; raises `FrameError` naming the problem."""
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        env = _decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise FrameError(f"malformed message: {e}") from None
    if env.v != SCHEMA_VERSION:
        raise FrameError(
            f"schema version {env.v} is not supported (this side speaks {SCHEMA_VERSION})"
        )
    if env.token != token:
        raise FrameError("authentication failed: wrong or missing token")
    return env.body
