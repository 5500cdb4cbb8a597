"""The router: one loop serving clients and engines, the GlobalScheduler and the dispatch of work.

One loop (`serve`) owns every piece of state; nothing here is shared between threads. Clients
submit rounds of their sessions; leader engines fetch work (pull based) and report progress;
the router answers clients when a round's tokens are complete. The state lives in three
collaborators the router composes, each with its own contract:

- `sessions.SessionTable`: sessions (their context) and the rounds in flight (`RequestState`).
- `liveness.EngineRegistry`: registered engines, their connections and last heartbeats, and
  whether a role has had no live engine for too long.
- `params_update.ParamsCoordinator`: the served params (version, block-key fingerprint) and the
  `UpdateParams` state machine, which holds rounds submitted while an update runs.

The router itself validates messages' senders, turns rounds into scheduler requests (store
lookup), hands the scheduler's assignments to engines, and handles failures: retries, cancels,
engine deaths.

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

KV events (docs/kv_events.md): with a `KVEventPublisher`, what every store of the cluster did
(the engines' `KVEvents`, the router's own store) is published on one PUB socket as soon as the
router handles it: a round's `BlockStored` before its `RoundResult`, a release's `BlockRemoved`
before its `Ack`.

Roles: frames carry the engine or the client secret (engine/credentials.py); engine messages
(`messages.ENGINE_ONLY`) from a client are refused, and so is a message that names an engine
from a connection other than the one that registered it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable

import msgspec

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engine import messages as M
from dualpath_jax.engine.kv_publisher import KVEventPublisher
from dualpath_jax.engine.liveness import ROLES, EngineInfo, EngineRegistry
from dualpath_jax.engine.params_update import ParamsCoordinator
from dualpath_jax.engine.rpc import RpcServer
from dualpath_jax.engine.sessions import RequestState, SessionTable, retention_problem
from dualpath_jax.kvstore.identity import block_keys
from dualpath_jax.kvstore.store import BlockStore
from dualpath_jax.metrics.events import EventLog
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.sched.cost import FittedCostModel, engines_beta
from dualpath_jax.sched.scheduler import GlobalScheduler, QueueFull
from dualpath_jax.sched.types import EngineLoad, ReadPath, Request

log = logging.getLogger(__name__)

FAILURE_KINDS = ("transfer", "store", "engine")


class Router:
    """Serves clients and engines on one `RpcServer`. Clocks are injected (`clock`).
    `kv_events` publishes the cluster's KV events (None: they are not published); the router's
    own store posts to it as `router`."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        server: RpcServer,
        store: BlockStore,
        scheduler: GlobalScheduler,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_events: KVEventPublisher | None = None,
    ):
        self.cfg = cfg
        self.server = server
        self.store = store
        self.scheduler = scheduler
        self.events = events
        self.kv_events = kv_events
        self.clock = clock
        self.bt = cfg.store.block_tokens
        self.block_bytes = BlockLayout.for_model(cfg.model, self.bt).nbytes
        self.engines = EngineRegistry(cfg.cluster, clock)
        self.sessions = SessionTable(
            cfg.model.vocab_size, min(cfg.model.max_seq_len, cfg.cluster.decode_max_len)
        )
        self.params = ParamsCoordinator(
            cfg,
            self.engines,
            send=self.send,
            fail=self.fail,
            event=self.event,
            resubmit=self.on_submit,
            clock=clock,
        )
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
            "finished_early": 0,
            "read_blocks_pe": 0,  # hit blocks assigned to be read on each path
            "read_blocks_de": 0,
            # rounds whose hit was recomputed, all or a leading part, not read (load or
            # recompute); of those, rounds that read the rest of it
            "recompute_hits": 0,
            "recompute_lead_hits": 0,
            "recompute_hit_blocks": 0,
        }
        self.stopping = False
        # Live PEs' reported prefill cost models; beta is derived from them (update_beta).
        self.prefill_costs: dict[int, FittedCostModel] = {}

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
                    self.send(ident, M.Error(ref=getattr(msg, "request", ""), message=str(e)))
                self.publish_kv_events()  # also what a failed handler's store calls reported
            now = self.clock()
            if now - last_tick >= 0.1:
                self.check_liveness(now)
                last_tick = now
        for e in self.engines.live():
            self.send(e.ident, M.Stop())

    def send(self, ident: bytes, msg: M.Msg) -> None:
        self.server.send(ident, msg)

    def event(self, kind: str, /, **fields) -> None:
        if self.events is not None:
            self.events.write(kind, t=self.clock(), **fields)

    def fail(self, ident: bytes, ref: str, message: str, kind: str = "bad_request") -> None:
        """Refuses or ends what `ref` names: counted, recorded, answered with `Error(kind)`."""
        self.counters["errors"] += 1
        self.event("error", request=ref, message=message)
        self.send(ident, M.Error(ref=ref, message=message, kind=kind))

    def refuse(self, ident: bytes, msg: M.Msg, why: str) -> None:
        """Drops a message its sender may not send (wrong role, another engine's id)."""
        self.counters["refused_frames"] += 1
        log.warning("refused %s: %s", type(msg).__name__, why)
        self.send(ident, M.Error(ref="", message=why, kind="auth"))

    def handle(self, ident: bytes, msg: M.Msg, role: str = M.ENGINE) -> None:
        if role != M.ENGINE and type(msg) in M.ENGINE_ONLY:
            return self.refuse(ident, msg, f"{type(msg).__name__} needs the engine secret")
        why = self.engines.heard_from(ident, msg)
        if why:
            return self.refuse(ident, msg, why)
        match msg:
            case M.OpenSession(session=s, resume=resume):
                problem = retention_problem(msg.priority, msg.ttl_s)
                if problem:
                    return self.fail(ident, s, problem)
                if not self.sessions.open(s, resume, msg.priority, msg.ttl_s):
                    return self.fail(
                        ident, s, f"session {s!r} exists; pass resume=True to continue it"
                    )
                if resume:  # its blocks' retention takes the session's new settings
                    self.retain(s, "current")
                self.send(ident, M.Ack(ref=s))
            case M.CancelRound():
                self.on_cancel(ident, msg)
            case M.FinishRound():
                self.on_finish(ident, msg)
            case M.Ping():
                self.send(ident, M.Ack(ref="ping"))
            case M.CloseSession():
                self.on_close(ident, msg)
            case M.UpdateParams():
                self.params.start(ident, msg, in_flight=len(self.sessions.requests))
            case M.ParamsLoaded():
                self.params.on_loaded(msg)
            case M.Submit():
                self.on_submit(ident, msg)
            case M.Register():
                self.on_register(ident, msg)
            case M.Heartbeat():
                self.send(ident, M.Ack(ref="hb"))  # last_seen was updated above
            case M.Fetch():
                self.on_fetch(ident, msg)
            case M.DeReady():
                self.on_de_ready(msg)
            case M.PrefillDone():
                self.on_prefill_done(msg)
            case M.ReadsDone():
                self.on_reads_done(msg)
            case M.TokensOut():
                self.on_tokens(msg)
            case M.DecodeDone():
                self.on_decode_done(msg)
            case M.Failed():
                self.on_failed(msg)
            case M.KVEvents():
                self.on_kv_events(msg)
            case M.GetStats():
                self.send(ident, M.Stats(json=json.dumps(self.stats())))
            case M.Shutdown():
                self.stopping = True
                self.send(ident, M.Ack(ref="shutdown"))
            case _:
                self.send(ident, M.Error(ref="", message=f"unexpected {type(msg).__name__}"))
        self.params.advance(len(self.sessions.requests))
        self.publish_kv_events()  # e.g. a lookup that found a corrupt block removed it

    # ------------------------------------------------------------------ clients

    def on_close(self, ident: bytes, msg: M.CloseSession) -> None:
        """Ends a session; `release` also deletes its stored blocks that no live session claims."""
        s = self.sessions.get(msg.session)
        if s is None:
            return self.send(
                ident, M.Error(ref=msg.session, message=f"unknown session {msg.session!r}")
            )
        if msg.release and (s.busy or self.params.holds_round_of(ident, s.id)):
            return self.fail(
                ident,
                msg.session,
                f"session {s.id!r} has a round running; close it when it is done",
            )
        self.retain(msg.session, "ended")
        self.sessions.close(msg.session)
        if msg.release:
            try:
                n = self.store.release(msg.session).result(self.cfg.store.timeout_s)
            except Exception as e:  # noqa: BLE001 - the session is closed either way
                return self.fail(
                    ident, msg.session, f"releasing the session's blocks failed: {e}", kind="store"
                )
            self.event("release", session=msg.session, blocks=n)
            self.publish_kv_events()
        self.send(ident, M.Ack(ref=msg.session))

    def on_submit(self, ident: bytes, msg: M.Submit) -> None:
        if self.params.hold(ident, msg):  # runs with the new params once the update is over
            return
        problem = self.sessions.session_problem(msg)
        if problem:
            return self.fail(ident, msg.request, problem)
        missing = self.engines.missing_role()
        if missing:
            return self.fail(ident, msg.request, missing, kind="engine")
        problem = self.sessions.round_problem(msg) or retention_problem(msg.priority, msg.ttl_s)
        if problem:
            return self.fail(ident, msg.request, problem)
        prompt = self.sessions.prompt(msg)
        room = self.engines.decode_capacity()
        if room and len(prompt) + msg.gen > room:  # no DE's KV pool could ever admit it
            return self.fail(
                ident,
                msg.request,
                f"context of {len(prompt)} + {msg.gen} tokens exceeds the decode engines'"
                f" KV budget of {room} tokens",
            )
        keys = block_keys(prompt, self.bt, self.params.fingerprint)
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
        self.sessions.start_round(ident, msg, req, prompt, keys[:hit], self.clock())
        self.retain(msg.session, "active")
        self.event(
            "submit", request=msg.request, prompt=len(prompt), cached=hit * self.bt, gen=msg.gen
        )

    def finish(
        self,
        st: RequestState,
        tokens: list[int],
        persist_error: str = "",
        finish_reason: str = "length",
    ) -> None:
        now = self.clock()
        self.sessions.complete(st, tokens)
        self.retain(st.session, "idle")
        # The session claims the blocks its DE persisted (and the hit it read), so closing it
        # with release=True can delete them (a session closed meanwhile claims nothing).
        if st.session in self.sessions.sessions:
            self.store.claim(
                st.session, block_keys(st.prompt + tokens[:-1], self.bt, self.params.fingerprint)
            )
        res = st.result(tokens, now, self.bt, persist_error, finish_reason)
        if persist_error:
            self.counters["persist_errors"] += 1
            log.warning("request %s: its blocks were not persisted: %s", st.id, persist_error)
            self.event("persist_failed", request=st.id, engine=st.de, message=persist_error)
        self.counters["requests_done"] += 1
        self.event(
            "done", **{k: v for k, v in msgspec.structs.asdict(res).items() if k != "tokens"}
        )
        self.send(st.client, res)

    def retain(self, session: str, state: str, ident: bytes | None = None) -> None:
        """Session retention (docs/kv_events.md): the router's store and every live DE's (or
        only engine `ident`'s) learn that `session` is now active, idle or ended (`state`, or
        "current": where it stands, `SessionTable.retain`)."""
        msg = self.sessions.retain(session, state, self.cfg.store.retention_ttl_s, self.clock())
        if msg is None:
            return
        if ident is None:
            self.store.retain(msg.session, msg.state, msg.priority, msg.ttl_s)
        for e in self.engines.live("decode"):
            if ident in (None, e.ident):
                self.send(e.ident, msg)

    # ------------------------------------------------------------------ engines

    def on_register(self, ident: bytes, msg: M.Register) -> None:
        why = self.engines.takeover(ident, msg)
        if why:
            self.counters["refused_frames"] += 1
            log.warning("%s", why)
            self.event("register_refused", engine=msg.engine, pid=msg.pid, message=why)
            return self.send(ident, M.Error(ref=str(msg.engine), message=why, kind="stop"))
        if msg.role not in ROLES:
            return self.send(
                ident,
                M.Error(ref=str(msg.engine), message=f"unknown role {msg.role!r}", kind="stop"),
            )
        self.engines.add(ident, msg)
        cost = msg.prefill_cost if msg.role == "prefill" else None
        if cost is not None and not all(math.isfinite(v) and v >= 0 for v in cost.prefill):
            log.warning("engine %d reported an unusable cost model %s", msg.engine, cost.prefill)
            cost = None
        self.event(
            "register",
            engine=msg.engine,
            role=msg.role,
            node=msg.node,
            pid=msg.pid,
            devices=list(msg.devices),
            mesh=msg.mesh,
            **({"prefill_cost": msgspec.structs.asdict(cost)} if cost is not None else {}),
        )
        if msg.role == "prefill":
            self.prefill_costs.pop(msg.engine, None)
            if cost is not None:
                self.prefill_costs[msg.engine] = FittedCostModel(prefill=cost.prefill)
            self.update_beta()
        self.send(ident, M.Ack(ref=str(msg.engine)))
        if msg.role == "decode":  # a (re)started DE learns which sessions to retain
            for s in list(self.sessions.sessions.values()):
                self.retain(s.id, "current", ident)
        if msg.params_version != self.params.version:
            # An engine that (re)started after an update: bring it to the current params. If it
            # cannot load them, its jobs fail with a clear version mismatch.
            log.warning(
                "engine %d serves params %r, the cluster %r",
                msg.engine,
                msg.params_version,
                self.params.version,
            )
            self.params.bring_up_to_date(ident)

    def update_beta(self) -> None:
        """Sets the scheduler's beta from the live PEs' cost models (the slowest PE's beta,
        `sched.cost.engines_beta`); with none reported, `scheduler.beta_tokens` or infinite.
        Runs when a PE registers or dies; until the first one registers, the scheduler keeps the
        beta it was built with (`run_router`: the same fallback)."""
        cl = self.cfg.cluster
        beta = engines_beta(
            self.cfg.scheduler, self.prefill_costs.values(), max_batch=cl.prefill_max_batch or 256
        )
        if self.prefill_costs:  # load or recompute: by the slowest PE's cost model
            slowest = tuple(
                max(c.prefill[i] for c in self.prefill_costs.values()) for i in range(3)
            )
            self.scheduler.set_prefill_cost(slowest)
        if beta != self.scheduler.beta:
            self.scheduler.beta = beta
            self.event("beta", beta=beta, engines=sorted(self.prefill_costs))
            log.info(
                "beta %.6g tokens (from the cost models of PEs %s)",
                beta,
                sorted(self.prefill_costs),
            )

    # ------------------------------------------------------------------ dispatch

    def node_read_q(self, node: int) -> int:
        """Hit tokens assigned to be read on `node` whose reads have not finished: the router's
        own view of the node's storage read queue, exact up to one `ReadsDone` message in flight
        (requests waiting for compute after their reads no longer count against the NIC)."""
        q = 0
        for r in self.sessions.requests.values():
            if r.pe < 0 or not math.isnan(r.t_first):
                continue
            if not r.pe_reads_done and self.engines[r.pe].node == node:
                q += r.pe_read_tokens
            if not r.de_reads_done and r.de >= 0 and self.engines[r.de].node == node:
                q += r.de_read_tokens
        return q

    def on_reads_done(self, msg: M.ReadsDone) -> None:
        st = self.sessions.requests.get(msg.request)
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
            for r in self.sessions.requests.values()
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
        e = self.engines.live_one(msg.engine)
        if e is None:
            self.send(
                ident, M.Error(ref=str(msg.engine), message="engine not registered", kind="stop")
            )
            return
        self.engines.report(e, msg.load, msg.links)
        loads = [self.engine_load(x) for x in self.engines.live(e.role, e.group)]
        if e.role == "prefill":  # every DE node's read queue as of now, for the read-path choice
            self.scheduler.report([self.engine_load(x) for x in self.engines.live("decode")], "de")
        if e.role == "decode":
            for r, de in self.scheduler.fetch_de(e.group, loads):
                self.sessions.requests[r.id].de = de
            return
        for a in self.scheduler.fetch_pe(e.group, loads):
            st = self.sessions.requests[a.request.id]
            st.assign(a, self.clock(), self.bt)
            self.counters[f"path_{a.path.value}"] += 1
            if a.recompute_blocks:
                self.counters["recompute_hits"] += 1
                self.counters["recompute_lead_hits"] += a.path is not ReadPath.NONE
                self.counters["recompute_hit_blocks"] += a.recompute_blocks
            if self.scheduler.policy.reads:
                self.counters["read_blocks_pe"] += a.pe_read_blocks
                self.counters["read_blocks_de"] += a.de_read_blocks
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
                params_version=self.params.version,
                attempt=st.attempts,
                sampling=st.sampling,
                stop_tokens=st.stop_tokens,
                stream=st.stream,
                session=st.session,
                pe_pieces=pe.kv_pieces,
                lead_blocks=0 if oracle else a.recompute_blocks,  # the PE computes these first
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
            self.send(de.ident, M.Work(jobs=[job]))  # the PE's part waits for DeReady
            if st.finish_requested:
                self.send(de.ident, M.Finish(request=st.id))

    def on_de_ready(self, msg: M.DeReady) -> None:
        """The DE half of a job runs: now the PE may start (it never waits on a DE that is not
        ready, e.g. one whose buffer is full)."""
        st = self.sessions.requests.get(msg.request)
        if st is None or st.de != msg.engine or msg.attempt != st.attempts or st.job is None:
            return
        pe = self.engines.live_one(st.pe)
        if pe is not None:
            self.send(pe.ident, M.Work(jobs=[st.job]))
        st.job = None

    def on_prefill_done(self, msg: M.PrefillDone) -> None:
        st = self.sessions.requests.get(msg.request)
        if st is None or st.pe != msg.engine:
            return  # a cancelled attempt
        st.t_first = self.clock()
        st.first_token = msg.first_token
        st.hit_blocks = msg.hit_blocks
        st.recomputed_blocks += msg.recomputed_blocks + msg.lead_blocks  # unreadable or chosen
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
        de = self.engines.live_one(st.de)
        if de is not None:
            self.send(
                de.ident,
                # the prompt's blocks the store holds (the DE persists those after them)
                M.FirstToken(
                    request=st.id,
                    token=msg.first_token,
                    hit_blocks=msg.lead_blocks + msg.hit_blocks,
                ),
            )
        if st.stream:
            self.send(st.client, M.Partial(request=st.id, start=0, tokens=[msg.first_token]))

    def on_tokens(self, msg: M.TokensOut) -> None:
        """A DE's new tokens: the second one times TTST; a streamed round's go to its client."""
        st = self.sessions.requests.get(msg.request)
        if st is None:
            return
        if math.isnan(st.t_second) and msg.start + len(msg.tokens) >= 2:
            st.t_second = self.clock()
        if st.stream:
            self.send(st.client, M.Partial(request=st.id, start=msg.start, tokens=msg.tokens))

    def on_decode_done(self, msg: M.DecodeDone) -> None:
        st = self.sessions.requests.get(msg.request)
        if st is None or st.de != msg.engine:
            return
        self.event("decoded", request=st.id, persisted_blocks=msg.persisted_blocks)
        self.finish(st, list(msg.tokens), msg.persist_error, msg.finish_reason)

    def on_kv_events(self, msg: M.KVEvents) -> None:
        """An engine's store events: published at once, named after the engine."""
        e = self.engines.get(msg.engine)
        if self.kv_events is None or e is None:
            return
        self.kv_events.post(f"{'pe' if e.role == 'prefill' else 'de'}{e.engine}", msg.events)
        self.publish_kv_events()

    def publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.flush()

    # ------------------------------------------------------------------ failures

    def on_failed(self, msg: M.Failed) -> None:
        """An engine's part of a request failed: `transfer` is retried (bounded by
        `cluster.max_attempts`), anything else ends the round with the engine's text."""
        st = self.sessions.requests.get(msg.request)
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
            info = self.engines.live_one(e)
            if info is not None:
                self.send(info.ident, M.Cancel(request=st.id))

    def end(self, st: RequestState, message: str, kind: str) -> None:
        """Ends a round unfinished: it leaves every queue, its session is free again, and its
        client gets `Error(kind)`."""
        self.scheduler.withdraw([st.id])
        self.sessions.drop(st)
        self.retain(st.session, "idle")
        self.fail(st.client, st.id, message, kind=kind)

    def on_cancel(self, ident: bytes, msg: M.CancelRound) -> None:
        if self.params.unhold(ident, msg.request):
            self.counters["cancelled"] += 1
            return self.fail(ident, msg.request, "cancelled by the client", kind="cancelled")
        st = self.sessions.requests.get(msg.request)
        if st is None or st.client != ident:
            return
        self.counters["cancelled"] += 1
        self.event("cancel", request=st.id)
        self.cancel_on_engines(st)
        self.end(st, "cancelled by the client", "cancelled")

    def on_finish(self, ident: bytes, msg: M.FinishRound) -> None:
        """Completes a round now with the tokens it has; a round not yet at a DE finishes as
        soon as its first token is there (the request is remembered for every attempt)."""
        st = self.sessions.requests.get(msg.request)
        if st is None or st.client != ident or st.finish_requested:
            return
        st.finish_requested = True
        self.counters["finished_early"] += 1
        self.event("finish_early", request=st.id)
        de = self.engines.live_one(st.de) if st.de >= 0 else None
        if de is not None:
            self.send(de.ident, M.Finish(request=st.id))

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
            st.unassign()
            self.counters["requeued"] += 1
            self.event("requeue", request=st.id, attempts=st.attempts)
        self.scheduler.requeue([st.request for st in states if st.id not in queued])

    # ------------------------------------------------------------------ liveness

    def check_liveness(self, now: float) -> None:
        for e in self.engines.silent(now):
            self.engine_died(e)
        missing = self.engines.missing_role(now)  # also records which roles have a live engine
        if missing and self.sessions.requests:
            log.warning("%s: failing %d rounds", missing, len(self.sessions.requests))
            for st in list(self.sessions.requests.values()):
                self.cancel_on_engines(st)
                self.end(st, missing, "engine")
        self.params.advance(len(self.sessions.requests))
        self.params.check_timeout(now)

    def engine_died(self, e: EngineInfo) -> None:
        self.engines.mark_dead(e)
        self.counters["engine_deaths"] += 1
        self.event("engine_dead", engine=e.engine, role=e.role, pid=e.pid)
        log.warning("engine %d (%s, pid %d) stopped heartbeating", e.engine, e.role, e.pid)
        self.scheduler.remove_engines([e.engine])
        if self.prefill_costs.pop(e.engine, None) is not None:
            self.update_beta()
        self.params.engine_gone(e.engine)
        back = self.sessions.on_engine(e.engine)
        for st in back:
            # Even after the first token the DE may still be receiving the PE's layers, so a dead
            # PE's requests are retried too (the tokens come out the same).
            self.cancel_on_engines(st, but=e.engine)
            st.last_error = f"{e.role} engine {e.engine} (pid {e.pid}) stopped heartbeating"
            st.last_kind = "engine"
        self.requeue(back)

    # ------------------------------------------------------------------ metrics

    def stats(self) -> dict:
        """Counters, queues and each live engine's load, as JSON-ready data (`GetStats`; the HTTP
        server exports them to Prometheus, serving/metrics.py)."""
        live = self.engines.live()
        loads = {}
        for e in live:
            ld = self.engine_load(e)
            loads[str(e.engine)] = {
                "role": e.role,
                "node": e.node,
                "requests": ld.seq_e,
                "tokens": ld.tok_e,
                "batch": e.batch,
                "free_hbm_tokens": ld.free_hbm_tokens if e.role == "decode" else 0,
            }
        return {
            "counters": dict(self.counters),
            "queued": self.scheduler.queued(),
            "in_flight": len(self.sessions.requests),
            "sessions": len(self.sessions.sessions),
            "block_tokens": self.bt,
            "block_bytes": self.block_bytes,
            "read_queue_tokens": {
                str(n): self.node_read_q(n) for n in sorted({e.node for e in live})
            },
            "loads": loads,
            "params_version": self.params.version,
            "alpha": self.scheduler.alpha,
            "beta": self.scheduler.beta,
            "prefill_costs": {str(e): list(c.prefill) for e, c in self.prefill_costs.items()},
            "engines": self.engines.stats(),
            "read_path_counts": {p.value: self.counters[f"path_{p.value}"] for p in ReadPath},
            "kv_events": (
                {"address": self.kv_events.address, "batches": self.kv_events.seq}
                if self.kv_events is not None
                else {}
            ),
        }
