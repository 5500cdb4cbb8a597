"""The router: sessions, request states, the GlobalScheduler, engine liveness and metrics.

One loop (`serve`) owns every piece of state; nothing here is shared between threads. Clients
submit rounds of their sessions; leader engines fetch work (pull based) and report progress;
the router answers clients when a round's tokens are complete.

Request lifecycle: submitted -> queued (scheduler) -> assigned (PE, DE, read path; the DE gets
the job) -> DE ready (its buffer reserved, reads issued; now the PE gets the job) -> prefilled
(first token, forwarded to the DE) -> decoded (tokens, blocks persisted) -> answered.

Failures (docs/failures.md): an engine's `Failed` of kind `transfer` is retried up to
`cluster.max_attempts`; `store` and `engine` failures end the round with that kind and the
engine's text. An engine that stops heartbeating is declared dead; every unfinished request it
touched is cancelled on the surviving engine and requeued (its persisted blocks are still in the
store, so the retry is a normal, possibly shorter, hit). With no live engine of a role for
`cluster.no_engine_timeout_s`, rounds fail with kind `engine`. Admission: no DE holds more than
its slots plus `cluster.decode_queue` requests; beyond that rounds queue, up to
`scheduler.max_queue`, and the rest are refused as `overloaded`.

Roles: frames carry the engine or the client secret (engine/credentials.py); engine messages
(`messages.ENGINE_ONLY`) from a client are refused, and so is a message that names an engine
from a connection other than the one that registered it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable

import msgspec

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engine import messages as M
from dualpath_jax.engine.params import check_version, initial_params_version
from dualpath_jax.engine.rpc import RpcServer
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.kvstore.store import BlockStore
from dualpath_jax.metrics.events import EventLog
from dualpath_jax.sched.scheduler import GlobalScheduler, QueueFull
from dualpath_jax.sched.types import EngineLoad, ReadPath, Request

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineInfo:
    role: str
    engine: int
    node: int
    group: int
    address: str
    ident: bytes
    pid: int
    last_seen: float
    alive: bool = True
    hbm_tokens: int = 0  # DE: KV capacity in tokens
    slots: int = 0
    links: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SessionState:
    id: str
    context: list[int] = dataclasses.field(default_factory=list)  # A_1 G_1 ... (appendix A.3)
    busy: bool = False


@dataclasses.dataclass
class RequestState:
    id: str
    session: str
    client: bytes
    request: Request
    prompt: list[int]
    keys: list[str]
    gen: int
    t_submit: float
    t_assign: float = math.nan
    t_first: float = math.nan
    t_second: float = math.nan
    pe: int = -1
    de: int = -1
    path: str = ""
    hit_blocks: int = 0
    recomputed_blocks: int = 0
    attempts: int = 0
    first_token: int = -1
    pe_read_tokens: int = 0  # hit tokens read on the PE's node, until its reads finish
    de_read_tokens: int = 0  # hit tokens read on the DE's node, until its reads finish
    pe_reads_done: bool = False
    de_reads_done: bool = False
    temperature: float = 0.0
    seed: int = 0
    job: M.LoadJobMsg | None = (
        None  # the current attempt's job, sent to the PE once the DE is ready
    )
    last_error: str = ""  # the last engine failure's text and kind (for the final error)
    last_kind: str = ""


FAILURE_KINDS = ("transfer", "store", "engine")


@dataclasses.dataclass
class ParamsUpdate:
    """An `UpdateParams` in progress (see engine/params.py): draining, then loading."""

    client: bytes
    version: str
    path: str
    loading: bool = False
    t_load: float = 0.0  # when the engines were told to load
    waiting: set[int] = dataclasses.field(default_factory=set)  # engines yet to answer
    errors: list[str] = dataclasses.field(default_factory=list)


class Router:
    """Serves clients and engines on one `RpcServer`. Clocks are injected (`clock`)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        server: RpcServer,
        store: BlockStore,
        scheduler: GlobalScheduler,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.server = server
        self.store = store
        self.scheduler = scheduler
        self.events = events
        self.clock = clock
        self.bt = cfg.store.block_tokens
        self.params_version = initial_params_version(cfg.cluster)
        self.params_path = cfg.cluster.params_path
        self.fingerprint = model_fingerprint(cfg.model, self.params_version)
        self.update: ParamsUpdate | None = None
        self.held: list[tuple[bytes, M.Submit]] = []  # rounds submitted during an update
        self.engines: dict[int, EngineInfo] = {}
        # When a live engine of each role was last known: rounds fail once one role has had
        # none for `cluster.no_engine_timeout_s`.
        self.role_seen = {"prefill": clock(), "decode": clock()}
        self.sessions: dict[str, SessionState] = {}
        self.requests: dict[str, RequestState] = {}
        self.counters = {
            "requests_done": 0,
            "errors": 0,
            "requeued": 0,
            "engine_deaths": 0,
            "recomputed_blocks": 0,
            "path_pe": 0,
            "path_de": 0,
            "path_split": 0,
            "path_none": 0,
            "hit_blocks": 0,
            "failed": 0,
            "cancelled": 0,
            "overloaded": 0,
            "persist_errors": 0,
            "refused_frames": 0,
        }
        self.stopping = False

    # ------------------------------------------------------------------ loop

    def serve(self, until: Callable[[], bool] | None = None) -> None:
        """Runs until a `Shutdown` arrives (or `until()` is true)."""
        last_tick = self.clock()
        while not self.stopping and not (until and until()):
            got = self.server.recv(timeout_ms=20)
            if got is not None:
                ident, msg, role = got
                try:
                    self.handle(ident, msg, role)
                except Exception as e:  # noqa: BLE001 - one bad message must not stop the router
                    log.exception("handling %s failed", type(msg).__name__)
                    self.server.send(
                        ident, M.Error(ref=getattr(msg, "request", ""), message=str(e))
                    )
            now = self.clock()
            if now - last_tick >= 0.1:
                self.check_liveness(now)
                last_tick = now
        for e in self.engines.values():
            if e.alive:
                self.server.send(e.ident, M.Stop())

    def event(self, kind: str, /, **fields) -> None:
        if self.events is not None:
            self.events.write(kind, t=self.clock(), **fields)

    def refuse(self, ident: bytes, msg: M.Msg, why: str) -> None:
        """Drops a message its sender may not send (wrong role, another engine's id)."""
        self.counters["refused_frames"] += 1
        log.warning("refused %s: %s", type(msg).__name__, why)
        self.server.send(ident, M.Error(ref="", message=why, kind="auth"))

    def handle(self, ident: bytes, msg: M.Msg, role: str = M.ENGINE) -> None:
        if role != M.ENGINE and type(msg) in M.ENGINE_ONLY:
            return self.refuse(ident, msg, f"{type(msg).__name__} needs the engine secret")
        engine = getattr(msg, "engine", None)
        if isinstance(engine, int) and engine in self.engines and not isinstance(msg, M.Register):
            e = self.engines[engine]
            if e.ident != ident and not isinstance(msg, M.Heartbeat):
                return self.refuse(
                    ident, msg, f"engine {engine} is registered from another connection"
                )
            e.last_seen = self.clock()
        match msg:
            case M.OpenSession(session=s, resume=resume):
                if s in self.sessions and not resume:
                    return self.fail(
                        ident, s, f"session {s!r} exists; pass resume=True to continue it"
                    )
                self.sessions.setdefault(s, SessionState(s))
                self.server.send(ident, M.Ack(ref=s))
            case M.CancelRound():
                self.on_cancel(ident, msg)
            case M.Ping():
                self.server.send(ident, M.Ack(ref="ping"))
            case M.CloseSession():
                self.on_close(ident, msg)
            case M.UpdateParams():
                self.on_update_params(ident, msg)
            case M.ParamsLoaded():
                self.on_params_loaded(msg)
            case M.Submit():
                self.on_submit(ident, msg)
            case M.Register():
                self.on_register(ident, msg)
            case M.Heartbeat():
                self.server.send(ident, M.Ack(ref="hb"))  # last_seen was updated above
            case M.Fetch():
                self.on_fetch(ident, msg)
            case M.DeReady():
                self.on_de_ready(msg)
            case M.PrefillDone():
                self.on_prefill_done(msg)
            case M.ReadsDone():
                self.on_reads_done(msg)
            case M.TokensOut(request=r):
                st = self.requests.get(r)
                if st is not None and math.isnan(st.t_second) and len(msg.tokens) >= 2:
                    st.t_second = self.clock()
            case M.DecodeDone():
                self.on_decode_done(msg)
            case M.Failed():
                self.on_failed(msg)
            case M.GetStats():
                self.server.send(ident, M.Stats(json=json.dumps(self.stats())))
            case M.Shutdown():
                self.stopping = True
                self.server.send(ident, M.Ack(ref="shutdown"))
            case _:
                self.server.send(ident, M.Error(ref="", message=f"unexpected {type(msg).__name__}"))
        self.advance_update()

    # ------------------------------------------------------------------ clients

    def fail(self, ident: bytes, ref: str, message: str, kind: str = "bad_request") -> None:
        self.counters["errors"] += 1
        self.event("error", request=ref, message=message)
        self.server.send(ident, M.Error(ref=ref, message=message, kind=kind))

    def on_close(self, ident: bytes, msg: M.CloseSession) -> None:
        """Ends a session; `release` also deletes its stored blocks that no live session claims."""
        s = self.sessions.get(msg.session)
        if s is None:
            return self.server.send(
                ident, M.Error(ref=msg.session, message=f"unknown session {msg.session!r}")
            )
        if msg.release and (s.busy or any(i == ident and m.session == s.id for i, m in self.held)):
            return self.fail(
                ident,
                msg.session,
                f"session {s.id!r} has a round running; close it when it is done",
            )
        del self.sessions[msg.session]
        if msg.release:
            try:
                n = self.store.release(msg.session).result(self.cfg.store.timeout_s)
            except Exception as e:  # noqa: BLE001 - the session is closed either way
                return self.fail(
                    ident, msg.session, f"releasing the session's blocks failed: {e}", kind="store"
                )
            self.event("release", session=msg.session, blocks=n)
        self.server.send(ident, M.Ack(ref=msg.session))

    def on_submit(self, ident: bytes, msg: M.Submit) -> None:
        if self.update is not None:  # runs with the new params once the update is over
            self.held.append((ident, msg))
            return
        model = self.cfg.model
        s = self.sessions.get(msg.session)
        if s is None:
            return self.fail(ident, msg.request, f"unknown session {msg.session!r}")
        if s.busy:
            return self.fail(
                ident, msg.request, f"session {msg.session!r} already has a round running"
            )
        missing = self.missing_role()
        if missing:
            return self.fail(ident, msg.request, missing, kind="engine")
        if msg.request in self.requests:
            return self.fail(ident, msg.request, f"duplicate request id {msg.request!r}")
        if msg.gen <= 0:
            return self.fail(ident, msg.request, f"gen must be > 0, got {msg.gen}")
        if not msg.append:
            return self.fail(ident, msg.request, "a round must append at least one token")
        if not (math.isfinite(msg.temperature) and msg.temperature >= 0):
            return self.fail(
                ident,
                msg.request,
                f"temperature must be a finite number >= 0, got {msg.temperature}",
            )
        if not 0 <= msg.seed < 2**32:
            return self.fail(ident, msg.request, f"seed must lie in [0, 2**32), got {msg.seed}")
        bad = next((t for t in msg.append if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            return self.fail(
                ident, msg.request, f"token id {bad} is out of range [0, {model.vocab_size})"
            )
        prompt = s.context + list(msg.append)
        limit = min(model.max_seq_len, self.cfg.cluster.decode_max_len)
        if len(prompt) + msg.gen > limit:
            return self.fail(
                ident,
                msg.request,
                f"context of {len(prompt)} + {msg.gen} tokens exceeds the limit of {limit}",
            )
        keys = block_keys(prompt, self.bt, self.fingerprint)
        try:
            hit = self.store.lookup(keys).result(self.cfg.store.timeout_s)
        except Exception as e:  # noqa: BLE001 - store failures become the request's error
            return self.fail(ident, msg.request, f"store unavailable: {e}", kind="store")
        if hit * self.bt >= len(prompt):  # keep at least one new token to produce logits
            hit -= 1
        req = Request(msg.request, msg.session, 0, len(prompt), hit * self.bt, msg.gen)
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            self.counters["overloaded"] += 1
            return self.fail(ident, msg.request, f"overloaded: {e}", kind="overloaded")
        s.busy = True
        self.requests[msg.request] = RequestState(
            msg.request,
            msg.session,
            ident,
            req,
            prompt,
            keys[:hit],
            msg.gen,
            self.clock(),
            temperature=msg.temperature,
            seed=msg.seed,
        )
        self.event(
            "submit", request=msg.request, prompt=len(prompt), cached=hit * self.bt, gen=msg.gen
        )

    def finish(self, st: RequestState, tokens: list[int], persist_error: str = "") -> None:
        now = self.clock()
        s = self.sessions.get(st.session)
        if s is not None:
            s.context = st.prompt + tokens
            s.busy = False
        # The session claims the blocks its DE persisted (and the hit it read), so closing it
        # with release=True can delete them.
        self.store.claim(st.session, block_keys(st.prompt + tokens[:-1], self.bt, self.fingerprint))
        g = len(tokens)
        ttst = st.t_second - st.t_first if g > 1 and not math.isnan(st.t_second) else 0.0
        res = M.Result(
            request=st.id,
            tokens=tokens,
            ttft_s=st.t_first - st.t_submit,
            ttst_s=ttst,
            tpot_s=(now - st.t_first) / (g - 1) if g > 1 else 0.0,
            jct_s=now - st.t_submit,
            queue_s=st.t_assign - st.t_submit,
            cached_tokens=st.hit_blocks * self.bt,
            prompt_tokens=len(st.prompt),
            read_path=st.path,
            recomputed_blocks=st.recomputed_blocks,
            persist_error=persist_error,
        )
        if persist_error:
            self.counters["persist_errors"] += 1
            log.warning("request %s: its blocks were not persisted: %s", st.id, persist_error)
            self.event("persist_failed", request=st.id, engine=st.de, message=persist_error)
        self.counters["requests_done"] += 1
        self.event(
            "done", **{k: v for k, v in msgspec.structs.asdict(res).items() if k != "tokens"}
        )
        self.server.send(st.client, res)
        del self.requests[st.id]

    # ------------------------------------------------------------------ engines

    def on_register(self, ident: bytes, msg: M.Register) -> None:
        old = self.engines.get(msg.engine)
        if old is not None and old.alive and (old.ident != ident or old.pid != msg.pid):
            why = (
                f"engine id {msg.engine} is already registered by pid {old.pid}; "
                f"refused the second one (pid {msg.pid})"
            )
            self.counters["refused_frames"] += 1
            log.warning("%s", why)
            self.event("register_refused", engine=msg.engine, pid=msg.pid, message=why)
            return self.server.send(ident, M.Error(ref=str(msg.engine), message=why, kind="stop"))
        if msg.role not in ("prefill", "decode"):
            return self.server.send(
                ident,
                M.Error(ref=str(msg.engine), message=f"unknown role {msg.role!r}", kind="stop"),
            )
        self.engines[msg.engine] = EngineInfo(
            msg.role, msg.engine, msg.node, msg.group, msg.address, ident, msg.pid, self.clock()
        )
        self.event("register", engine=msg.engine, role=msg.role, node=msg.node, pid=msg.pid)
        self.server.send(ident, M.Ack(ref=str(msg.engine)))
        if msg.params_version != self.params_version:
            # An engine that (re)started after an update: bring it to the current params. If it
            # cannot load them, its jobs fail with a clear version mismatch.
            log.warning(
                "engine %d serves params %r, the cluster %r",
                msg.engine,
                msg.params_version,
                self.params_version,
            )
            if self.params_path:
                self.server.send(
                    ident, M.LoadParams(version=self.params_version, path=self.params_path)
                )
                self.server.send(ident, M.CommitParams(version=self.params_version, commit=True))

    # ------------------------------------------------------------------ params updates

    def on_update_params(self, ident: bytes, msg: M.UpdateParams) -> None:
        """Starts an update (engine/params.py): new rounds are held, running ones drain."""
        ref = f"params:{msg.version}"
        try:
            check_version(msg.version)
        except ValueError as e:
            return self.fail(ident, ref, str(e))
        if not msg.path:
            return self.fail(ident, ref, "UpdateParams needs the path of a parameter checkpoint")
        if self.update is not None:
            return self.fail(
                ident,
                ref,
                f"params update {self.update.version!r} is still in progress",
                kind="busy",
            )
        if msg.version == self.params_version:
            return self.fail(
                ident,
                ref,
                f"params version {msg.version!r} is already served; name updates uniquely",
            )
        self.update = ParamsUpdate(ident, msg.version, msg.path)
        self.event(
            "params_update", version=msg.version, path=msg.path, in_flight=len(self.requests)
        )

    def advance_update(self) -> None:
        """Moves an update on: once no round is in flight, every live engine loads the params."""
        u = self.update
        if u is None or u.loading or self.requests:
            return
        u.loading, u.t_load = True, self.clock()
        u.waiting = {e.engine for e in self.engines.values() if e.alive}
        for e in self.engines.values():
            if e.engine in u.waiting:
                self.server.send(e.ident, M.LoadParams(version=u.version, path=u.path))
        self.end_update_if_answered()

    def on_params_loaded(self, msg: M.ParamsLoaded) -> None:
        u = self.update
        if u is None or not u.loading or msg.version != u.version or msg.engine not in u.waiting:
            return
        u.waiting.discard(msg.engine)
        if not msg.ok:
            u.errors.append(f"engine {msg.engine}: {msg.message}")
        self.end_update_if_answered()

    def end_update_if_answered(self) -> None:
        u = self.update
        if u is None or u.waiting:
            return
        ok = not u.errors
        for e in self.engines.values():
            if e.alive:
                self.server.send(e.ident, M.CommitParams(version=u.version, commit=ok))
        self.update = None
        ref = f"params:{u.version}"
        if ok:
            self.params_version, self.params_path = u.version, u.path
            self.fingerprint = model_fingerprint(self.cfg.model, self.params_version)
            self.event("params_served", version=u.version)
            self.server.send(u.client, M.Ack(ref=ref))
        else:
            msg = (
                f"params {u.version!r} refused, still serving {self.params_version!r}: "
                + "; ".join(u.errors)
            )
            self.fail(u.client, ref, msg)
        held, self.held = self.held, []
        for ident, sub in held:
            self.on_submit(ident, sub)

    def node_read_q(self, node: int) -> int:
        """Hit tokens assigned to be read on `node` whose reads have not finished: the router's
        own view of the node's storage read queue, exact up to one `ReadsDone` message in flight
        (requests waiting for compute after their reads no longer count against the NIC)."""
        q = 0
        for r in self.requests.values():
            if r.pe < 0 or not math.isnan(r.t_first):
                continue
            if not r.pe_reads_done and self.engines[r.pe].node == node:
                q += r.pe_read_tokens
            if not r.de_reads_done and r.de >= 0 and self.engines[r.de].node == node:
                q += r.de_read_tokens
        return q

    def on_reads_done(self, msg: M.ReadsDone) -> None:
        st = self.requests.get(msg.request)
        if st is None or msg.attempt != st.attempts:
            return  # a finished request or an older attempt
        if msg.engine == st.pe:
            st.pe_reads_done = True
        if msg.engine == st.de:
            st.de_reads_done = True

    def engine_load(self, e: EngineInfo) -> EngineLoad:
        """Loads from the router's own in-flight tracking (exact, unlike delayed reports)."""
        mine = [
            r
            for r in self.requests.values()
            if (r.pe == e.engine and e.role == "prefill" and math.isnan(r.t_first))
            or (r.de == e.engine and e.role == "decode")
        ]
        tok = sum(r.request.tokens for r in mine)
        free = 0
        if e.role == "decode":
            free = max(0, e.hbm_tokens - sum(r.request.hbm_tokens for r in mine))
            if len(mine) >= e.slots + self.cfg.cluster.decode_queue:
                free = 0
        return EngineLoad(e.engine, e.node, e.group, len(mine), tok, self.node_read_q(e.node), free)

    def on_fetch(self, ident: bytes, msg: M.Fetch) -> None:
        e = self.engines.get(msg.engine)
        if e is None or not e.alive:
            self.server.send(
                ident, M.Error(ref=str(msg.engine), message="engine not registered", kind="stop")
            )
            return
        e.hbm_tokens = msg.load.hbm_capacity_tokens
        e.slots = msg.load.slots
        if msg.links:
            e.links = json.loads(msg.links)
        group = [
            x for x in self.engines.values() if x.alive and x.role == e.role and x.group == e.group
        ]
        loads = [self.engine_load(x) for x in group]
        if e.role == "prefill":  # every DE node's read queue as of now, for the read-path choice
            self.scheduler.report(
                [
                    self.engine_load(x)
                    for x in self.engines.values()
                    if x.alive and x.role == "decode"
                ],
                "de",
            )
        if e.role == "decode":
            for r, de in self.scheduler.fetch_de(e.group, loads):
                self.requests[r.id].de = de
            return
        for a in self.scheduler.fetch_pe(e.group, loads):
            st = self.requests[a.request.id]
            st.pe, st.de, st.t_assign = a.pe, a.de, self.clock()
            st.path = a.path.value
            st.attempts += 1
            st.pe_read_tokens = a.pe_read_blocks * self.bt
            st.de_read_tokens = a.de_read_blocks * self.bt
            st.pe_reads_done = st.de_reads_done = False
            self.counters[f"path_{a.path.value}"] += 1
            pe, de = self.engines[a.pe], self.engines[a.de]
            n = len(st.keys)
            oracle = not self.scheduler.policy.reads
            job = M.LoadJobMsg(
                request=st.id,
                keys=st.keys,
                pe_blocks=n if oracle else a.pe_read_blocks,
                de_blocks=0 if oracle else a.de_read_blocks,
                prompt=st.prompt,
                gen=st.gen,
                pe_engine=pe.engine,
                pe_node=pe.node,
                pe_address=pe.address,
                de_engine=de.engine,
                de_node=de.node,
                de_address=de.address,
                oracle=oracle,
                layerwise=self.scheduler.policy.layerwise,
                params_version=self.params_version,
                attempt=st.attempts,
                temperature=st.temperature,
                seed=st.seed,
            )
            self.event(
                "assign",
                request=st.id,
                pe=a.pe,
                de=a.de,
                path=a.path.value,
                pe_blocks=job.pe_blocks,
                de_blocks=job.de_blocks,
            )
            st.job = job
            self.server.send(de.ident, M.Work(jobs=[job]))  # the PE's part waits for DeReady

    def on_de_ready(self, msg: M.DeReady) -> None:
        """The DE half of a job runs: now the PE may start (it never waits on a DE that is not
        ready, e.g. one whose buffer is full)."""
        st = self.requests.get(msg.request)
        if st is None or st.de != msg.engine or msg.attempt != st.attempts or st.job is None:
            return
        pe = self.engines.get(st.pe)
        if pe is not None and pe.alive:
            self.server.send(pe.ident, M.Work(jobs=[st.job]))
        st.job = None

    def on_prefill_done(self, msg: M.PrefillDone) -> None:
        st = self.requests.get(msg.request)
        if st is None or st.pe != msg.engine:
            return  # a cancelled attempt
        st.t_first = self.clock()
        st.first_token = msg.first_token
        st.hit_blocks = msg.hit_blocks
        st.recomputed_blocks += msg.recomputed_blocks
        self.counters["recomputed_blocks"] += msg.recomputed_blocks
        self.counters["hit_blocks"] += msg.hit_blocks
        self.event(
            "first_token",
            request=st.id,
            hit_blocks=msg.hit_blocks,
            recomputed=msg.recomputed_blocks,
            read_s=msg.read_s,
            prefill_s=msg.prefill_s,
        )
        de = self.engines.get(st.de)
        if de is not None and de.alive:
            self.server.send(
                de.ident,
                M.FirstToken(request=st.id, token=msg.first_token, hit_blocks=msg.hit_blocks),
            )

    def on_decode_done(self, msg: M.DecodeDone) -> None:
        st = self.requests.get(msg.request)
        if st is None or st.de != msg.engine:
            return
        self.event("decoded", request=st.id, persisted_blocks=msg.persisted_blocks)
        self.finish(st, list(msg.tokens), msg.persist_error)

    def on_failed(self, msg: M.Failed) -> None:
        """An engine's part of a request failed: `transfer` is retried (bounded by
        `cluster.max_attempts`), anything else ends the round with the engine's text."""
        st = self.requests.get(msg.request)
        if st is None or msg.engine not in (st.pe, st.de):
            return
        if msg.attempt and msg.attempt != st.attempts:
            return  # an older attempt's report
        kind = msg.kind if msg.kind in FAILURE_KINDS else "engine"
        role = "prefill" if msg.engine == st.pe else "decode"
        text = f"{role} engine {msg.engine}: {msg.message}"
        self.counters["failed"] += 1
        self.event("failed", request=st.id, engine=msg.engine, failure=kind, message=msg.message)
        log.warning("request %s failed (%s) on %s", st.id, kind, text)
        st.last_error, st.last_kind = text, kind
        self.cancel_on_engines(st, but=msg.engine)
        if kind == "transfer":
            # A peer vanished or stalled: retry; liveness checks retire a dead engine meanwhile.
            self.requeue([st])
            return
        self.end(st, text, kind)

    def cancel_on_engines(self, st: RequestState, but: int = -1) -> None:
        for e in {st.pe, st.de} - {but, -1}:
            info = self.engines.get(e)
            if info is not None and info.alive:
                self.server.send(info.ident, M.Cancel(request=st.id))

    def end(self, st: RequestState, message: str, kind: str) -> None:
        """Ends a round unfinished: it leaves every queue, its session is free again, and its
        client gets `Error(kind)`."""
        self.scheduler.withdraw([st.id])
        s = self.sessions.get(st.session)
        if s is not None:
            s.busy = False
        self.requests.pop(st.id, None)
        self.fail(st.client, st.id, message, kind=kind)

    def on_cancel(self, ident: bytes, msg: M.CancelRound) -> None:
        for i, (who, sub) in enumerate(self.held):
            if sub.request == msg.request and who == ident:
                del self.held[i]
                self.counters["cancelled"] += 1
                return self.fail(ident, msg.request, "cancelled by the client", kind="cancelled")
        st = self.requests.get(msg.request)
        if st is None or st.client != ident:
            return
        self.counters["cancelled"] += 1
        self.event("cancel", request=st.id)
        self.cancel_on_engines(st)
        self.end(st, "cancelled by the client", "cancelled")

    def requeue(self, states: list[RequestState]) -> None:
        """Puts requests back at the head of the queue as if never assigned; one that has used up
        `cluster.max_attempts` fails instead, with its last failure's kind and text."""
        limit = self.cfg.cluster.max_attempts
        for st in [x for x in states if x.attempts >= limit]:
            states.remove(st)
            last = st.last_error or "its engines stopped"
            self.end(
                st,
                f"gave up after {st.attempts} attempts; last failure: {last}",
                st.last_kind or "engine",
            )
        queued = {r.id for r in self.scheduler.queued_requests()}
        for st in states:
            st.pe = st.de = -1
            st.t_first = st.t_second = math.nan
            st.first_token = -1
            st.job = None
            self.counters["requeued"] += 1
            self.event("requeue", request=st.id, attempts=st.attempts)
        self.scheduler.requeue([st.request for st in states if st.id not in queued])

    # ------------------------------------------------------------------ liveness

    def check_liveness(self, now: float) -> None:
        timeout = self.cfg.cluster.heartbeat_timeout_s
        for e in list(self.engines.values()):
            if e.alive and now - e.last_seen > timeout:
                self.engine_died(e)
        missing = self.missing_role(now)  # also records which roles have a live engine now
        if missing and self.requests:
            log.warning("%s: failing %d rounds", missing, len(self.requests))
            for st in list(self.requests.values()):
                self.cancel_on_engines(st)
                self.end(st, missing, "engine")
        self.advance_update()
        self.check_update_timeout(now)

    def check_update_timeout(self, now: float) -> None:
        """Aborts an update whose engines have not all answered within
        `cluster.params_load_timeout_s` (the old params keep serving)."""
        u = self.update
        limit = self.cfg.cluster.params_load_timeout_s
        if u is None or not u.loading or not u.waiting or now - u.t_load <= limit:
            return
        u.errors += [f"engine {e}: no answer within {limit:g} s" for e in sorted(u.waiting)]
        u.waiting.clear()
        self.end_update_if_answered()

    def engine_died(self, e: EngineInfo) -> None:
        e.alive = False
        self.counters["engine_deaths"] += 1
        self.event("engine_dead", engine=e.engine, role=e.role, pid=e.pid)
        log.warning("engine %d (%s, pid %d) stopped heartbeating", e.engine, e.role, e.pid)
        self.scheduler.remove_engines([e.engine])
        if self.update is not None and e.engine in self.update.waiting:
            self.update.waiting.discard(e.engine)
            self.end_update_if_answered()
        back = []
        for st in self.requests.values():
            if e.engine not in (st.pe, st.de):
                continue
            # Even after the first token the DE may still be receiving the PE's layers, so a dead
            # PE's requests are retried too (the tokens come out the same).
            self.cancel_on_engines(st, but=e.engine)
            st.last_error = f"{e.role} engine {e.engine} (pid {e.pid}) stopped heartbeating"
            st.last_kind = "engine"
            back.append(st)
        self.requeue(back)

    def missing_role(self, now: float | None = None) -> str:
        """Why no round can run now ("" if they can): a role with no live engine for longer
        than `cluster.no_engine_timeout_s`."""
        now = self.clock() if now is None else now
        limit = self.cfg.cluster.no_engine_timeout_s
        for role, seen in self.role_seen.items():
            if any(e.alive and e.role == role for e in self.engines.values()):
                self.role_seen[role] = now  # e.g. one that registered since the last check
            elif now - seen > limit:
                return f"no live {role} engine for {now - seen:.0f} s (cluster.no_engine_timeout_s={limit:g})"
        return ""

    # ------------------------------------------------------------------ metrics

    def stats(self) -> dict:
        return {
            "counters": dict(self.counters),
            "queued": self.scheduler.queued(),
            "in_flight": len(self.requests),
            "params_version": self.params_version,
            "engines": {
                str(e.engine): {
                    "role": e.role,
                    "alive": e.alive,
                    "node": e.node,
                    "pid": e.pid,
                    "address": e.address,
                    "links": e.links,
                }
                for e in self.engines.values()
            },
            "read_path_counts": {p.value: self.counters[f"path_{p.value}"] for p in ReadPath},
        }
