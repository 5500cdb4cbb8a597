"""Control-plane messages: msgspec structs and their one tagged union (`Body`).

Nothing on the wire is pickled: every message is a msgspec struct encoded as msgpack (a round's
answer is the `results.RoundResult` record, its sampling a `model.sampling_params.SamplingParams`,
both checked as they are decoded). How a message becomes a frame (the versioned, signed envelope)
is `wire/frames.py`.

Two credentials: the engine secret (engines, and the admin who may `Shutdown`) and the client
secret (sessions, stats, params updates). The router accepts `ENGINE_ONLY` messages from the
engine role alone.
"""

from __future__ import annotations

import msgspec

from dualpath_jax.kv_events import KVEvent
from dualpath_jax.model.sampling_params import GREEDY, SamplingParams
from dualpath_jax.results import Logprobs, RoundResult
from dualpath_jax.transfer.params_offer import ParamsOffer


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of every control message (tagged by class name). `RoundResult` is one too, with the
    same options but not this base: the simulator, which sends nothing, keeps it as well."""


# ----------------------------------------------------------------------------- client <-> router


class OpenSession(Msg):
    """Opens a session; one that exists already is an error unless `resume` (continue it).

    `priority` and `ttl_s` set the retention of its stored blocks (`store.eviction="retention"`,
    docs/kv_events.md): kept while a round runs and for `ttl_s` seconds after each (-1:
    `store.retention_ttl_s`), lower priorities evicted first; None: unchanged on a resume.
    `fork_of`: the new session starts with that (existing, idle) session's context."""

    session: str
    resume: bool = False
    priority: int | None = None  # a new session: 0
    ttl_s: float | None = None  # a new session: -1
    fork_of: str = ""


class CloseSession(Msg):
    session: str
    release: bool = False  # delete the trajectory's stored blocks no other trajectory uses


class Submit(Msg):
    """One round: append `append` to the session's context and generate exactly `gen` tokens,
    drawn with `sampling` (greedy by default; `model.sampling_params`: a round's tokens depend only on
    params, context and seed, never on batching, engine or retries). Answered `RoundResult`."""

    request: str
    session: str
    append: list[int]
    gen: int
    sampling: SamplingParams = GREEDY
    # How much of the session's context the round builds on: -1 all of it; k keeps the first k
    # tokens (history rewritten later): the prompt is context[:k] + append (its KV found by key).
    keep: int = -1
    # The round ends early, as if it had generated `gen` tokens, right after any of these (its
    # last token); none before `sampling.min_tokens` tokens (at most 16 distinct ones with it).
    stop_tokens: list[int] = []
    stream: bool = False  # send the tokens as they are generated (`Partial`), then the result
    # Change the session's retention (see OpenSession) from this round on; None keeps it.
    priority: int | None = None
    ttl_s: float | None = None
    # Group sampling: the request id of a round of the same prompt submitted just before (the
    # group's first). Its decode engine forks that round's prompt KV for this one (shared
    # pages, no prefill, no store read); where it cannot, the round runs on its own.
    follows: str = ""


class FinishRound(Msg):
    """Client -> router: end a round now with the tokens generated so far (e.g. a stop string
    matched); unlike `CancelRound` the round completes: its tokens extend the session and its
    blocks are persisted. Its `RoundResult` carries `finish_reason="finished"`."""

    request: str


class RoundTokens(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of round `request`, from position `start` of its generated tokens: one entry
    of a `TokensOut` or a `Partial`."""

    request: str
    start: int
    tokens: list[int]
    logprobs: Logprobs | None = None  # the tokens' (when the round asked for logprobs)


class Partial(Msg):
    """Router -> client: new tokens of the client's streamed rounds, an entry per round: those
    of one decode step of a DE (`TokensOut`), or a round's first token from its PE. A retried
    round streams again from 0 with the same tokens (they depend only on params, context and
    seed), so a client keeps the first copy of each position."""

    rounds: list[RoundTokens]


class CancelRound(Msg):
    """Client -> router: abandon a round (its future fails with kind `cancelled`); the session
    may submit again at once. Unknown or finished requests are ignored."""

    request: str


class AbortRounds(Msg):
    """Client -> router: end rounds now with their tokens, `finish_reason="abort"`: those named
    in `requests`, those of `sessions`, with `all` every round in flight (any client's). One at
    its DE returns what it generated (its KV up to there persisted); one not yet there, none
    (its append still joins the session's context). Answered with `Aborted`."""

    ref: str  # the answer's
    requests: list[str] = []
    sessions: list[str] = []
    all: bool = False


class Aborted(Msg):
    """Router -> client: the rounds an `AbortRounds` ended (their own results follow)."""

    ref: str
    requests: list[str]


# What in-flight rounds do while paused (`Pause.mode`): "abort" ends them now, "wait" lets them
# finish, "keep" halts their decoding (`PauseDecode`; an update lands under them, docs/rl.md).
PAUSE_MODES = ("abort", "wait", "keep")


class Pause(Msg):
    """Client -> router: start no more rounds; new ones are held (they count against
    `scheduler.max_queue`) until `Resume`. `mode` (`PAUSE_MODES`) says what happens to those in
    flight. Answered with `Ack(ref)` once no round is in flight ("keep": at once, the decode
    engines told to halt)."""

    ref: str
    mode: str = "wait"


class Resume(Msg):
    """Client -> router: the held rounds start, in order; answered with `Ack(ref)`."""

    ref: str


class PauseDecode(Msg):
    """Router -> DE: halt decoding (`paused`; the slots and their KV stay, the step in flight
    is taken) or go on (`Pause(mode="keep")`, `Resume`)."""

    paused: bool


class Ping(Msg):
    """Client -> router liveness probe, answered `Ack(ref="ping", epoch=<the router's>)`."""


class Ack(Msg):
    ref: str = ""
    epoch: str = ""  # a ping's answer: the router's incarnation (another one: it restarted)


class Error(Msg):
    """A request or message was refused or failed; `message` says why. `kind`: bad_request,
    overloaded, store, transfer, engine, cancelled, auth, frame, busy, stop (to an engine: end),
    rejoin (to an engine the router declared dead: drop your work and register again), ..."""

    ref: str
    message: str
    kind: str = "error"


class GetStats(Msg):
    pass


class Stats(Msg):
    json: str


class Shutdown(Msg):
    pass


# ----------------------------------------------------------------------------- engine <-> router


class Load(Msg):
    """An engine's load report (paper 6.1) and spare capacity. The router schedules on its own,
    always current, `seq_e`/`tok_e`/`read_q` (`Dispatch.engine_load`); what engines send there is
    their local view and is not used for scheduling."""

    seq_e: int = 0
    tok_e: int = 0
    read_q: int = 0
    hbm_capacity_tokens: int = 0  # DE: KV tokens its decode slots hold in all
    slots: int = 0  # DE: decode slots
    batch: int = 0  # requests in its latest forward (PE: prefill batch; DE: decoding slots)


class PrefillCost(Msg):
    """A PE's prefill cost model, `sched.cost.FittedCostModel.prefill`: `p0 + p1 * new_tokens +
    p2 * attention_pairs` seconds per forward batch (its compute quota packs with it; the router
    derives beta from it)."""

    prefill: tuple[float, float, float]
    calibrated: bool  # fitted by the PE at start (False: given by cluster.prefill_cost_json)
    calibration_s: float = 0.0  # what calibrating took, compiles included
    samples: list[tuple[int, int, float]] = []  # what it timed: (cached, new, median seconds)


class Register(Msg):
    role: str  # "prefill" | "decode"
    engine: int
    node: int
    group: int
    address: str  # KV channel address
    pid: int
    params_version: str = ""  # the version of the params the engine serves
    prefill_cost: PrefillCost | None = None  # PEs: the cost model they batch with
    devices: list[str] = []  # the devices the engine runs the model on (its mesh's, in order)
    mesh: str = ""  # its mesh, "data=2,tensor=2" (`cluster.prefill_mesh` form); "": one device
    kv_pieces: int = 1  # a PE: the column pieces its KV rows split into (whole KV heads each)
    kv_piece_addresses: list[str] = []  # a spanning PE: where each piece is offered (row_offers)
    kv_piece_holders: list[list[int]] = []  # ... and which of its processes hold each


class Heartbeat(Msg):
    """Sent by every engine from a thread of its own, so a long compile or forward in the engine
    loop never looks like a dead engine. The router answers `Ack(ref="hb")`; an engine that hears
    nothing for `cluster.heartbeat_timeout_s` takes the router for dead and stops."""

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
    sampling: SamplingParams = GREEDY  # see Submit
    stop_tokens: list[int] = []  # see Submit
    stream: bool = False  # the DE reports every new token (TokensOut)
    session: str = ""  # the DE's store claims the round's blocks for it (retention)
    pe_pieces: int = 1  # the DE offers each hit layer in the PE's column pieces (Register)
    pe_piece_addresses: list[str] = []  # where the PE offers each piece of its new rows
    pe_piece_holders: list[list[int]] = []  # which PE processes hold each piece (pull the hit)
    # Leading hit blocks the PE recomputes (load or recompute); `pe_blocks`, `de_blocks` follow.
    lead_blocks: int = 0


class Work(Msg):
    jobs: list[LoadJobMsg]


class DeReady(Msg):
    """DE -> router: the DE half of a job has started (its buffer is reserved, its reads are
    issued), so the PE may start: no PE ever waits on a DE that is not ready."""

    request: str
    engine: int
    attempt: int = 0


class PrefillDone(Msg):
    request: str
    engine: int
    first_token: int
    hit_blocks: int  # hit blocks loaded (after the lead)
    recomputed_blocks: int
    read_s: float
    prefill_s: float
    lead_blocks: int = 0  # leading hit blocks recomputed by choice (before the loaded ones)
    attempt: int = 0  # the job's attempt (0: unknown; a stale attempt's report is ignored)
    first_logprobs: Logprobs | None = None  # the first token's (when the round asked for them)
    params_version: str = ""  # the params the PE's forward ran with ("": the job's)


class ReadsDone(Msg):
    """Engine -> router: this engine's share of a request's storage reads has finished (its
    node's `read_q` no longer holds them); they took `read_s` s, `held_blocks` of them from a
    tool-gap prefetch's memory."""

    request: str
    engine: int
    attempt: int = 0
    read_s: float = 0.0
    held_blocks: int = 0


class FirstToken(Msg):
    """Router -> DE: the PE's first generated token of a request; `hit_blocks`: the prompt's
    leading blocks already in the store (loaded or recomputed by choice), which the DE does not
    persist again."""

    request: str
    token: int
    hit_blocks: int
    logprobs: Logprobs | None = None  # the token's (when the round asked for logprobs)
    params_version: str = ""  # the params that drew it (PrefillDone's)
    # Rounds of the same prompt (`Submit.follows`) the DE starts from this one's prompt pages:
    # each draws its own first token; a fork that cannot start fails (kind "transfer").
    forks: list[LoadJobMsg] = []


class TokensOut(Msg):
    """DE -> router: one decode step's new tokens, an entry per round that reports one: every
    token of a streamed round, the second of every round (the router times TTST by it) and a
    fork's first (its TTFT). One message per step, however many rounds decode."""

    rounds: list[RoundTokens]


class DecodeDone(Msg):
    request: str
    engine: int
    tokens: list[int]
    persisted_blocks: int
    persist_error: str = ""  # see RoundResult.persist_error
    finish_reason: str = "length"  # see RoundResult.finish_reason
    attempt: int = 0  # the job's attempt (0: unknown; a stale attempt's report is ignored)
    logprobs: Logprobs | None = None  # every token's (when the round asked for logprobs)
    params_versions: list[tuple[int, str]] = []  # see RoundResult.params_versions


class KVEvents(Msg):
    """Engine -> router: what the engine's block store reported (kv_events.py), in its
    order, for the router to publish (`cluster.kv_events_address`). Sent on the engine's control
    socket ahead of any message it sends later, so a round's `BlockStored` comes before its
    `DecodeDone`."""

    engine: int
    events: list[KVEvent]


class Failed(Msg):
    """An engine could not finish its part of a request. `kind`: transfer (a peer vanished or
    timed out: the router retries, up to `cluster.max_attempts`), params (the job's params
    version is not the engine's: retried on another engine, this one leaves rotation), store or
    engine (reported to the client with `message`)."""

    request: str
    engine: int
    message: str
    kind: str = "engine"
    attempt: int = 0  # the job's attempt (0: unknown; a stale attempt's report is ignored)


class Cancel(Msg):
    request: str


class Finish(Msg):
    """Router -> DE: complete `request` now with the tokens it has (see `FinishRound`), its
    `finish_reason` being `reason` ("finished", or "abort": `AbortRounds`)."""

    request: str
    reason: str = "finished"


class Stop(Msg):
    pass


class Retain(Msg):
    """Router -> DE: the retention of session `session`'s blocks in the engine's store index
    (`kvstore.index.BlockIndex.retain`): `state` is active, idle (for `ttl_s`) or ended."""

    session: str
    state: str
    priority: int = 0
    ttl_s: float = 0.0


# ----------------------------------------------------------------------------- params update
# Client -> router `UpdateParams`; router -> engine `LoadParams` / `CommitParams`; engine ->
# router `ParamsLoaded` (router/params_update.py, engines/params.py, docs/rl.md).


class UpdateParams(Msg):
    """Client -> router: serve new parameters as `version`: those in `path` (an orbax checkpoint
    directory every engine can read) or, without a path, those of `offer` (streamed from the
    client's process). Answered `Ack(ref="params:<version>")` once every live engine loaded and
    checked them, or `Error` (the old params stay). KV of older versions is never reused because
    the version enters the block-key fingerprint. `pause`: what the rounds in flight do meanwhile
    (`PAUSE_MODES`: "wait" lets them finish on the old params, "abort" ends them now with what
    they generated, "keep" halts their decoding, serves the new params under them, and lets them
    decode on)."""

    version: str
    path: str = ""
    offer: ParamsOffer | None = None
    pause: str = "wait"


class LoadParams(Msg):
    """Router -> engine: load and check the parameters in `path`, or pull those of `offer`
    (its process k takes copy `copy + k`), staged, not yet served."""

    version: str
    path: str = ""
    offer: ParamsOffer | None = None
    copy: int = 0


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


# ----------------------------------------------------------------------------- tool-gap prefetch
# Client -> router `ToolCall`; router -> engine (a DE or a PE) `Prefetch` / `DropPrefetch`;
# engine -> router `Prefetched` (router/prefetch.py, docs/policies.md).


class ToolCall(Msg):
    """Client -> router: a round of `session` ended with a tool call expected to last
    `expected_s` seconds (the `tool_call` session hint). Answered `Ack(ref=session)` whether or
    not a prefetch starts (none when the policy or the config has none, the session has no
    stored hit, or the gap is too short to be worth a read)."""

    session: str
    expected_s: float


class Prefetch(Msg):
    """Router -> engine: read the blocks `keys` (the session's leading hit, chain order) from the
    store into the engine's prefetch memory while nothing more urgent reads; `epoch` names this
    prefetch in the `Prefetched` answer."""

    session: str
    keys: list[str]
    epoch: int


class DropPrefetch(Msg):
    """Router -> engine: forget the prefetch `epoch` of `session` (cancelled, evicted, or its turn
    went to another engine): stop reading and free its memory."""

    session: str
    epoch: int


class Prefetched(Msg):
    """Engine -> router: prefetch `epoch` of `session` holds its first `blocks` blocks in memory
    (its reads ended: all read, a block missing from the store, memory short, or stopped),
    after `read_s` seconds of reading."""

    engine: int
    session: str
    epoch: int
    blocks: int
    read_s: float = 0.0


Body = (
    OpenSession
    | CloseSession
    | Submit
    | CancelRound
    | FinishRound
    | AbortRounds
    | Aborted
    | Pause
    | Resume
    | Partial
    | Ping
    | RoundResult
    | Ack
    | Error
    | GetStats
    | Stats
    | UpdateParams
    | Shutdown
    | Load
    | PrefillCost
    | Register
    | LoadParams
    | ParamsLoaded
    | CommitParams
    | Heartbeat
    | Fetch
    | LoadJobMsg
    | Work
    | DeReady
    | PrefillDone
    | ReadsDone
    | FirstToken
    | TokensOut
    | DecodeDone
    | KVEvents
    | Failed
    | Cancel
    | Finish
    | PauseDecode
    | Stop
    | Retain
    | ToolCall
    | Prefetch
    | DropPrefetch
    | Prefetched
)


# Messages only the engine role may send (Shutdown: the engine secret is the admin's too).
ENGINE_ONLY: frozenset[type] = frozenset(
    {
        Register,
        Heartbeat,
        Fetch,
        DeReady,
        PrefillDone,
        ReadsDone,
        TokensOut,
        DecodeDone,
        KVEvents,
        Failed,
        ParamsLoaded,
        Prefetched,
        Shutdown,
    }
)
