"""The router: one loop serving clients and engines, routing each message to the part that owns it.

One loop (`serve`) drives every part; nothing here is shared between threads. Clients submit
rounds of their sessions; leader engines fetch work (pull based) and report progress; the router
answers clients when a round's tokens are complete. Each part owns its state and handles its
own messages, and is given what it needs at construction (the outbox, router/outbox.py, for
sending, events and counters; the registry and the session table to read; the callables of the
parts it hands over to), never the router:

- sessions (router/rounds.py, `Rounds`, over the `SessionTable` of router/sessions.py):
  `OpenSession`, `CloseSession`, `Submit` (admission), `CancelRound`, `FinishRound`, and the
  engines' `PrefillDone` / `TokensOut` / `DecodeDone` on a round's way to its `RoundResult`.
- dispatch (router/dispatch.py, `Dispatch`): `Fetch` (the GlobalScheduler's assignments turned
  into jobs), `DeReady`, `ReadsDone`, `Failed` (retries), requeues, and the rounds of an engine
  that died; the scheduler's beta from the PEs' cost models.
- liveness (router/liveness.py, `Liveness` over the `EngineRegistry`): `Register`, `Heartbeat`,
  and declaring silent engines dead on the loop's tick.
- params (router/params_update.py, `ParamsCoordinator`): `UpdateParams`, `ParamsLoaded`; the
  rounds submitted during an update wait there, and the router hands them to the sessions part
  once it is over. Which engines are in rotation (serve the cluster's params, and so get work)
  is its doing: an engine with other params is caught up before it gets any.
- pause (router/pause.py, `PauseGate`): `Pause` / `Resume`; the rounds submitted while
  paused wait there. `AbortRounds` ends rounds wherever they are: held (here or in the params
  part) or in flight (the sessions part).
- retention (router/retention.py, `Retention`): which sessions' blocks the stores keep.
- prefetch (router/prefetch.py, `Prefetches`): `ToolCall`, `Prefetched`; the tool-gap
  prefetches the decode engines hold for sessions between turns.
- KV events (router/kv_publisher.py, `KVEventRelay`, docs/kv_events.md): the engines'
  `KVEvents` and the router's own store's, published on one PUB socket as soon as the router
  handles them: a round's `BlockStored` before its `RoundResult`, a release's `BlockRemoved` before
  its `Ack`.

The router itself authenticates each message's sender, routes it, answers `Ping`, `GetStats`
(`stats()`) and `Shutdown`, and after every message and tick lets the parts move on (a params
update drains; KV events are published). Roles: frames carry the engine or the client secret
(wire/credentials.py); engine messages (`messages.ENGINE_ONLY`) from a client are refused, and
so is a message that names an engine from a connection other than the one that registered it.
With no live engine of a role for `cluster.no_engine_timeout_s`, rounds fail with kind `engine`
(docs/failures.md).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.kvstore.store import BlockStore
from dualpath_jax.metrics.events import EventLog
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.router.dispatch import Dispatch
from dualpath_jax.router.kv_publisher import KVEventPublisher, KVEventRelay
from dualpath_jax.router.liveness import EngineRegistry, Liveness
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.router.params_update import ParamsCoordinator
from dualpath_jax.router.pause import PauseGate
from dualpath_jax.router.prefetch import Prefetches
from dualpath_jax.router.retention import Retention
from dualpath_jax.router.rounds import QUICK_WAIT_S, Rounds
from dualpath_jax.router.sessions import SessionTable
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import ReadPath
from dualpath_jax.wire import frames, messages
from dualpath_jax.wire.rpc import RpcServer

log = logging.getLogger(__name__)

TICK_S = 0.1  # how often the loop checks liveness and params timeouts
EXPIRY_EVERY_S = 1.0  # how often the tick looks for idle sessions to expire


class Router:
    """Serves clients and engines on one `RpcServer`. Clocks are injected (`clock`);
    `store_wait_s` is how long the loop waits in line for the store (router/rounds.py).
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
        store_wait_s: float = QUICK_WAIT_S,
        served_file: str = "",
        resume: bool = False,
    ):
        self.cfg = cfg
        # This router's incarnation, in every ping's answer: a client that hears another one
        # learns that the router restarted and fails the calls the old one took (wire/client.py).
        self.epoch = uuid.uuid4().hex[:16]
        self.server = server
        self.store = store
        self.scheduler = scheduler
        self.clock = clock
        self._last_expiry = clock()
        self._kept_update = False  # a params update with pause="keep" halted decoding
        self.stopping = False
        self.out = Outbox(server, events, clock)
        # the engines in rotation are those serving the params part's version
        registry = EngineRegistry(cfg.cluster, clock, served=lambda: self.params.version)
        table = SessionTable(
            cfg.model.vocab_size, min(cfg.model.max_seq_len, cfg.cluster.decode_max_len), clock
        )
        self.kv = KVEventRelay(kv_events, registry)
        self.retention = Retention(store, cfg.store.retention_ttl_s, registry, self.out, clock)
        self.params = params = ParamsCoordinator(
            cfg,
            registry,
            self.out,
            clock,
            in_flight=lambda: len(table.requests) + len(table.admitting),
            queued=lambda: len(scheduler),  # held rounds count against max_queue too
            max_queue=scheduler.max_queue,
            left_rotation=lambda e: self.dispatch.engine_left(e),
            served_file=served_file,
            resume=resume,
        )
        self.pause = PauseGate(
            self.out,
            in_flight=lambda: len(table.requests) + len(table.admitting),
            queued=lambda: len(scheduler),
            max_queue=scheduler.max_queue,
        )
        self.rounds = Rounds(
            cfg,
            table,
            store,
            scheduler,
            registry,
            self.retention,
            self.params,
            self.out,
            clock,
            publish_kv=self.kv.publish,
            quick_wait_s=store_wait_s,
        )
        self.dispatch = Dispatch(
            cfg,
            scheduler,
            registry,
            table,
            self.out,
            clock,
            params_version=lambda: params.version,
            end=self.rounds.end,
            cancel=self.rounds.cancel_on_engines,
            stale=params.engine_stale,
            assigned=lambda a: self.prefetches.assigned(a),
            followers=self.rounds.waiting_followers,
        )
        self.prefetches = Prefetches(
            cfg,
            scheduler,
            registry,
            table,
            store,
            self.out,
            clock,
            after_store=self.rounds.after_store,
            fingerprint=lambda: params.fingerprint,
        )
        self.liveness = Liveness(
            registry,
            self.out,
            # in this order, after the engine's Ack: beta, a DE's Retains, an engine's LoadParams
            joined=[
                self.halt_if_kept,
                self.dispatch.engine_joined,
                self.retention.engine_joined,
                self.params.engine_joined,
            ],
            died=[self.dispatch.engine_died, self.params.engine_gone, self.prefetches.engine_gone],
            no_engine=self.rounds.end_all,
        )
        self.block_bytes = BlockLayout.for_model(cfg.model, cfg.store.block_tokens).nbytes
        self.routes: dict[type, Callable[[bytes, Any], None]] = {
            messages.OpenSession: self.rounds.on_open,
            messages.CloseSession: self.rounds.on_close,
            messages.Submit: self.on_submit,
            messages.CancelRound: self.on_cancel,
            messages.FinishRound: self.rounds.on_finish,
            messages.PrefillDone: self.rounds.on_prefill_done,
            messages.TokensOut: self.rounds.on_tokens,
            messages.DecodeDone: self.rounds.on_decode_done,
            messages.Fetch: self.dispatch.on_fetch,
            messages.DeReady: self.dispatch.on_de_ready,
            messages.ReadsDone: self.dispatch.on_reads_done,
            messages.Failed: self.dispatch.on_failed,
            messages.Register: self.liveness.on_register,
            messages.Heartbeat: self.liveness.on_heartbeat,
            messages.UpdateParams: self.on_update_params,
            messages.Pause: self.on_pause,
            messages.Resume: self.on_resume,
            messages.AbortRounds: self.on_abort,
            messages.ParamsLoaded: self.params.on_loaded,
            messages.KVEvents: self.kv.on_kv_events,
            messages.ToolCall: self.prefetches.on_tool_call,
            messages.Prefetched: self.prefetches.on_prefetched,
            messages.Ping: self.on_ping,
            messages.GetStats: self.on_get_stats,
            messages.Shutdown: self.on_shutdown,
        }

    # ------------------------------------------------------------------ loop

    def serve(self, until: Callable[[], bool] | None = None) -> None:
        """Runs until a `Shutdown` arrives (or `until()` is true)."""
        last_tick = self.clock()
        while not self.stopping and not (until and until()):
            # while the store owes answers, look for them often (rounds wait on them)
            got = self.server.recv(timeout_ms=2 if self.rounds.waiting else 20)
            if got is not None:
                ident, msg, role = got
                try:
                    self.handle(ident, msg, role)
                except Exception as e:  # noqa: BLE001 - one bad message must not stop the router
                    log.exception("handling %s failed", type(msg).__name__)
                    ref = getattr(msg, "request", "")
                    self.out.send(ident, messages.Error(ref=ref, message=str(e)))
                self.kv.publish()  # also what a failed handler's store calls reported
            if self.rounds.waiting:
                self.rounds.poll_store()
                self.move_on()
                self.kv.publish()
            now = self.clock()
            if now - last_tick >= TICK_S:
                self.tick(now)
                last_tick = now
        self.liveness.stop_all()

    def handle(self, ident: bytes, msg: messages.Msg, role: str = frames.ENGINE) -> None:
        """Authenticates `msg`'s sender (`role`: the secret its frame carried) and routes it."""
        self.out.count("messages")
        if role != frames.ENGINE and type(msg) in messages.ENGINE_ONLY:
            return self.refuse(ident, msg, f"{type(msg).__name__} needs the engine secret")
        why = self.liveness.registry.heard_from(ident, msg)
        if why:
            return self.refuse(ident, msg, why)
        route = self.routes.get(type(msg))
        if route is None:
            why = f"unexpected {type(msg).__name__}"
            self.out.send(ident, messages.Error(ref="", message=why))
        else:
            route(ident, msg)
        self.move_on()
        self.kv.publish()  # e.g. a lookup that found a corrupt block removed it

    def tick(self, now: float) -> None:
        """The loop's periodic step: silent engines die, rounds fail while a role has no live
        engine, a params update moves on or times out, engines out of rotation are asked again
        to load the served params."""
        self.liveness.check(now)
        self.move_on()
        self.params.check_timeout(now)
        self.params.check_catch_ups(now)
        self.resume_held()
        self.prefetches.tick(now)
        if now - self._last_expiry >= EXPIRY_EVERY_S:
            self.rounds.expire_idle()
            self._last_expiry = now

    def move_on(self) -> None:
        """A params update drains, loads or ends; rounds held during one (or a pause) run once
        it is over; a pause is answered once no round is in flight; decoding halted for a
        `pause="keep"` update goes on once it ended (unless generation is paused so)."""
        self.params.advance()
        self.pause.advance()
        if self._kept_update and self.params.update is None:
            self._kept_update = False
            if self.pause.mode != "keep":
                self.halt_decode(False)
        self.resume_held()

    def halt_decode(self, paused: bool) -> None:
        """Tells every live DE to halt decoding (`paused`) or go on."""
        for e in self.liveness.registry.live("decode"):
            self.out.send(e.ident, messages.PauseDecode(paused=paused))

    def halt_if_kept(self, e, msg: messages.Register) -> None:
        """A DE that registers while decoding is halted halts too."""
        if e.role == "decode" and (self.pause.mode == "keep" or self._kept_update):
            self.out.send(e.ident, messages.PauseDecode(paused=True))

    def resume_held(self) -> None:
        for ident, msg in self.params.take_released() + self.pause.take_released():
            self.on_submit(ident, msg)  # (held again if paused or updating meanwhile)

    def refuse(self, ident: bytes, msg: messages.Msg, why: str) -> None:
        """Drops a message its sender may not send (wrong role, another engine's id)."""
        self.out.count("refused_frames")
        log.warning("refused %s: %s", type(msg).__name__, why)
        self.out.send(ident, messages.Error(ref="", message=why, kind="auth"))

    # ------------------------------------------------------------------ routes of its own

    def on_submit(self, ident: bytes, msg: messages.Submit) -> None:
        """A round runs now, or waits while generation is paused or a params update is in
        progress."""
        if not self.pause.hold(ident, msg) and not self.params.hold(ident, msg):
            if self.rounds.on_submit(ident, msg):
                self.prefetches.turn_submitted(msg.session)

    def on_cancel(self, ident: bytes, msg: messages.CancelRound) -> None:
        if not self.pause.held.cancel(ident, msg) and not self.params.cancel_held(ident, msg):
            self.rounds.on_cancel(ident, msg)

    def on_pause(self, ident: bytes, msg: messages.Pause) -> None:
        was = self.pause.mode
        if not self.pause.on_pause(ident, msg):
            return
        if msg.mode == "abort":
            self.rounds.on_abort(ident, messages.AbortRounds(ref="", all=True))
        if (msg.mode == "keep") != (was == "keep") and not self._kept_update:
            self.halt_decode(msg.mode == "keep")

    def on_resume(self, ident: bytes, msg: messages.Resume) -> None:
        if self.pause.mode == "keep" and not self._kept_update:
            self.halt_decode(False)
        self.pause.on_resume(ident, msg)

    def on_update_params(self, ident: bytes, msg: messages.UpdateParams) -> None:
        """A params update; with `pause="abort"` the rounds in flight end now."""
        if msg.pause not in messages.PAUSE_MODES:
            why = f"pause must be one of {messages.PAUSE_MODES}, got {msg.pause!r}"
            return self.out.fail(ident, f"params:{msg.version}", why)
        self.params.on_update(ident, msg)
        u = self.params.update
        if u is None or (u.client, u.version) != (ident, msg.version):
            return  # refused
        if msg.pause == "abort":
            self.rounds.on_abort(ident, messages.AbortRounds(ref="", all=True))
        elif msg.pause == "keep":  # the rounds stay, halted, and decode on with the new params
            u.keep = True
            if self.pause.mode != "keep":
                self.halt_decode(True)
            self._kept_update = True

    def on_abort(self, ident: bytes, msg: messages.AbortRounds) -> None:
        """Ends the rounds `msg` names (router/rounds.py `Rounds.abort`); held ones are
        admitted to end at once with no token (their append joins the session's context, as
        any aborted round's does)."""
        named, sessions = set(msg.requests), set(msg.sessions)

        def chosen(sub: messages.Submit) -> bool:
            return msg.all or sub.request in named or sub.session in sessions

        ended = []
        for who, sub in self.pause.held.take(chosen) + self.params.held.take(chosen):
            self.rounds.abort_asked.add(sub.request)
            if self.rounds.on_submit(who, sub):
                ended.append(sub.request)
            else:  # refused (e.g. its session closed meanwhile)
                self.rounds.abort_asked.discard(sub.request)
        ended = list(dict.fromkeys(ended + self.rounds.on_abort(ident, msg)))
        if msg.ref:
            self.out.send(ident, messages.Aborted(ref=msg.ref, requests=ended))

    def on_ping(self, ident: bytes, msg: messages.Ping) -> None:
        self.out.send(ident, messages.Ack(ref="ping", epoch=self.epoch))

    def on_get_stats(self, ident: bytes, msg: messages.GetStats) -> None:
        self.out.send(ident, messages.Stats(json=json.dumps(self.stats())))

    def on_shutdown(self, ident: bytes, msg: messages.Shutdown) -> None:
        self.stopping = True
        self.out.send(ident, messages.Ack(ref="shutdown"))

    # ------------------------------------------------------------------ metrics

    def stats(self) -> dict:
        """Counters, queues and each live engine's load, as JSON-ready data (`GetStats`; the HTTP
        server exports them to Prometheus, serving/metrics.py)."""
        counters = self.out.counters
        table = self.rounds.table
        return {
            "counters": dict(counters),
            "queued": self.scheduler.queued(),
            "in_flight": len(table.requests),
            "sessions": len(table.sessions),
            "block_tokens": self.cfg.store.block_tokens,
            "block_bytes": self.block_bytes,
            "read_queue_tokens": self.dispatch.read_queues(),
            # what the storage reads carried (0 until one finished; load or recompute uses it
            # where the storage NIC is not emulated)
            "read_tokens_per_s": self.dispatch.read_rate.tokens_per_s,
            "loads": self.dispatch.loads(),
            "params_version": self.params.version,
            "epoch": self.epoch,
            "params_pullers": self.params.pullers(),
            "alpha": self.scheduler.alpha,
            "beta": self.scheduler.beta,
            "prefill_costs": {
                str(e): list(c.prefill) for e, c in self.dispatch.prefill_costs().items()
            },
            "engines": self.liveness.registry.stats(),
            "read_path_counts": {p.value: counters[f"path_{p.value}"] for p in ReadPath},
            "kv_events": self.kv.stats(),
            "prefetch": self.prefetches.stats(),
        }
