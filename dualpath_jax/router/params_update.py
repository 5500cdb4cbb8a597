"""The params a cluster serves, and the router's side of `UpdateParams` (engines/params.py).

`ParamsCoordinator` is the router's params part. It owns the served version (and so the block-key
fingerprint), the update state machine and which engines are in rotation:

    idle --UpdateParams--> draining --no round in flight--> loading --every engine asked
    answered (or died, or params_load_timeout_s passed)--> idle (committed or refused)

While an update is in progress (draining or loading) the router hands new rounds to it (`hold`)
instead of the sessions part; they count against `scheduler.max_queue` with the rounds queued
(one over it is refused as `overloaded`, as any submission would be), and a held round the client
cancels ends here (`cancel_held`). When the update ends they are released, in order
(`take_released`), for the router to hand to the sessions part: they run with whichever params
are served then. The coordinator handles `UpdateParams` and `ParamsLoaded`, sends the engines'
`LoadParams` / `CommitParams` and answers the client itself, through its outbox; it reads the
live engines from the registry and the rounds in flight from `in_flight()`. The router's loop
moves it on after every message and tick (`advance`, `check_timeout`, `check_catch_ups`).

Rotation: an engine gets work only while the params version it serves (`EngineInfo.
params_version`) is the served one (`EngineRegistry.serving`). An update asks the engines in
rotation when its loading begins, and commits to exactly those (never `CommitParams` without the
`LoadParams` before it). Any other engine, one that registered with other params (a restart
after an update), registered during an update, or refused a job of the served version
(`engine_stale`), is out of rotation and *caught up*: told to load the served params
(`LoadParams`, then `CommitParams` once it answered ok), outside any update (one in progress
first ends). One that cannot load them stays out and is asked again every
`cluster.params_retry_s`. An engine that leaves rotation is handed to `left_rotation` (the
dispatch part forgets it in the scheduler). Liveness tells the coordinator which engine
registered (`engine_joined`) or died (`engine_gone`).

`served_file` (the workdir's `served_params.json`) records each committed version and its
checkpoint path, so a router restarted over a running cluster (`resume`) serves what its engines
serve instead of going back to the configured params; a router that is not resuming removes an
earlier cluster's record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
from collections.abc import Callable

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.kvstore.identity import model_fingerprint
from dualpath_jax.router.held import HeldRounds
from dualpath_jax.router.liveness import EngineInfo, EngineRegistry
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.transfer.params_offer import ParamsOffer
from dualpath_jax.wire import messages
from dualpath_jax.wire.params_protocol import check_version, initial_params_version

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ParamsUpdate:
    """An `UpdateParams` in progress (see engines/params.py): draining, then loading."""

    client: bytes
    version: str
    path: str
    offer: ParamsOffer | None = None  # a streamed update (transfer/params_sync.py)
    loading: bool = False
    keep: bool = False  # pause="keep": the rounds in flight stay (halted), no drain
    t_load: float = 0.0  # when the engines were told to load
    asked: set[int] = dataclasses.field(default_factory=set)  # engines told to load (the commit's)
    waiting: set[int] = dataclasses.field(default_factory=set)  # engines yet to answer
    errors: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CatchUp:
    """An engine out of rotation being brought to the served params: told to load `version` at
    `t_sent` (NaN: no load pending; after a failed one, asked again at `retry_at`)."""

    version: str
    t_sent: float
    retry_at: float = 0.0

    @property
    def pending(self) -> bool:
        return not math.isnan(self.t_sent)


class ParamsCoordinator:
    """Served params (`version`, `path`, `fingerprint`), the update in progress (`update`, with
    the rounds `held` meanwhile and those `released` at its end) and the engines being brought
    to the served params (`catching_up`). `queued()` is how many rounds wait in the scheduler,
    which holds at most `max_queue` (default `scheduler.max_queue`)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        registry: EngineRegistry,
        out: Outbox,
        clock: Callable[[], float],
        in_flight: Callable[[], int],
        *,
        queued: Callable[[], int] = lambda: 0,
        max_queue: int | None = None,
        left_rotation: Callable[[EngineInfo], None] = lambda e: None,
        served_file: str | os.PathLike = "",
        resume: bool = False,
    ):
        self.model = cfg.model
        self.cluster = cfg.cluster
        self.registry = registry
        self.out = out
        self.clock = clock
        self.in_flight = in_flight
        self.queued = queued
        self.max_queue = cfg.scheduler.max_queue if max_queue is None else max_queue
        self.left_rotation = left_rotation
        self.version = initial_params_version(cfg.cluster)
        self.path = cfg.cluster.params_path
        self.served_file = pathlib.Path(served_file) if served_file else None
        if self.served_file is not None and not resume:
            self.served_file.unlink(missing_ok=True)  # an earlier cluster's record
        elif self.served_file is not None and self.served_file.exists():
            served = json.loads(self.served_file.read_text())
            self.version, self.path = check_version(served["version"]), served["path"]
            log.info("resuming with the served params %r", self.version)
        self.fingerprint = model_fingerprint(cfg.model, self.version)
        self.update: ParamsUpdate | None = None
        self.held = HeldRounds(out, queued, self.max_queue)  # rounds submitted during an update
        self.released: list[tuple[bytes, messages.Submit]] = []  # held ones, the update over
        self.catching_up: dict[int, CatchUp] = {}  # engine -> its catch-up

    # ------------------------------------------------------------------ held rounds

    def hold(self, ident: bytes, msg: messages.Submit) -> bool:
        """Holds a round submitted during an update (True), to run once it is over; one beyond
        `max_queue` (held and queued rounds together) is refused as `overloaded` (True too)."""
        if self.update is None:
            return False
        self.held.hold(ident, msg, f"for params update {self.update.version!r}")
        return True

    def holds_round_of(self, ident: bytes, session: str) -> bool:
        return self.held.holds(session, ident)

    def holds_session(self, session: str) -> bool:
        """Whether a round of `session` waits for the update to end."""
        return self.held.holds(session)

    def cancel_held(self, ident: bytes, msg: messages.CancelRound) -> bool:
        """Ends `ident`'s held round `msg.request` as cancelled; False if there is none."""
        return self.held.cancel(ident, msg)

    def take_released(self) -> list[tuple[bytes, messages.Submit]]:
        """The rounds held during the update that just ended, in order (once)."""
        released, self.released = self.released, []
        return released

    # ------------------------------------------------------------------ the update

    def on_update(self, ident: bytes, msg: messages.UpdateParams) -> None:
        """Starts an update (engines/params.py): new rounds are held, running ones drain."""
        ref = f"params:{msg.version}"
        try:
            check_version(msg.version)
        except ValueError as e:
            return self.out.fail(ident, ref, str(e))
        if bool(msg.path) == (msg.offer is not None):
            return self.out.fail(
                ident,
                ref,
                "UpdateParams needs the path of a parameter checkpoint or a transfer offer "
                "(one of them)",
            )
        if self.update is not None:
            return self.out.fail(
                ident,
                ref,
                f"params update {self.update.version!r} is still in progress",
                kind="busy",
            )
        if msg.version == self.version:
            return self.out.fail(
                ident,
                ref,
                f"params version {msg.version!r} is already served; name updates uniquely",
            )
        self.update = ParamsUpdate(ident, msg.version, msg.path, msg.offer)
        self.out.event(
            "params_update",
            version=msg.version,
            path=msg.path,
            offer_bytes=0 if msg.offer is None else msg.offer.nbytes,
            in_flight=self.in_flight(),
        )

    def advance(self) -> None:
        """Moves an update on: once no round is in flight, every engine in rotation loads the
        params (the others are caught up once it ends)."""
        u = self.update
        if u is None or u.loading or (self.in_flight() and not u.keep):
            return
        u.loading, u.t_load = True, self.clock()
        asked = self.registry.serving()
        copies = self._copies(asked)
        if u.offer is not None and copies[-1] > u.offer.copies:
            u.errors.append(
                f"the offer holds {u.offer.copies} copies of the params, the {len(asked)} "
                f"engines in rotation pull {copies[-1]} (engines joined meanwhile?): "
                "offer again"
            )
            return self._end_if_answered()
        u.asked = {e.engine for e in asked}
        u.waiting = set(u.asked)
        for e, copy in zip(asked, copies):
            self.out.send(
                e.ident,
                messages.LoadParams(
                    version=u.version,
                    path=u.path,
                    offer=u.offer,
                    copy=copy if u.offer is not None else 0,
                ),
            )
        self._end_if_answered()

    def _processes(self, e: EngineInfo) -> int:
        """How many processes engine `e` spans (each pulls its own copy of a streamed update)."""
        c = self.cluster
        return c.prefill_processes if e.role == "prefill" else c.decode_processes

    def _copies(self, engines: list[EngineInfo]) -> list[int]:
        """The first copy of a streamed update each of `engines` pulls, then the copies all of
        them pull."""
        out = [0]
        for e in engines:
            out.append(out[-1] + self._processes(e))
        return out

    def pullers(self) -> int:
        """The copies of a streamed update the engines in rotation pull now: how many a client
        offers (`Client.update_params`, in `GetStats` as `params_pullers`)."""
        return self._copies(self.registry.serving())[-1]

    def on_loaded(self, ident: bytes, msg: messages.ParamsLoaded) -> None:
        u = self.update
        if u is None or not u.loading or msg.version != u.version or msg.engine not in u.waiting:
            return self._caught_up(msg)
        u.waiting.discard(msg.engine)
        if not msg.ok:
            u.errors.append(f"engine {msg.engine}: {msg.message}")
        self._end_if_answered()

    def check_timeout(self, now: float) -> None:
        """Aborts an update whose engines have not all answered within
        `cluster.params_load_timeout_s` (the old params keep serving)."""
        u = self.update
        limit = self.cluster.params_load_timeout_s
        if u is None or not u.loading or not u.waiting or now - u.t_load <= limit:
            return
        u.errors += [f"engine {e}: no answer within {limit:g} s" for e in sorted(u.waiting)]
        u.waiting.clear()
        self._end_if_answered()

    def _end_if_answered(self) -> None:
        u = self.update
        if u is None or u.waiting:
            return
        ok = not u.errors
        for e in self.registry.live():
            if e.engine in u.asked:  # only those that loaded it: never a commit without a load
                self.out.send(e.ident, messages.CommitParams(version=u.version, commit=ok))
                if ok:
                    e.params_version = u.version
        self.update = None
        ref = f"params:{u.version}"
        if ok:
            self.version, self.path = u.version, u.path
            self.fingerprint = model_fingerprint(self.model, self.version)
            self._record_served()
            self.out.event("params_served", version=u.version)
            self.out.send(u.client, messages.Ack(ref=ref))
        else:
            errors = "; ".join(u.errors)
            why = f"params {u.version!r} refused, still serving {self.version!r}: {errors}"
            self.out.fail(u.client, ref, why)
        self.released += self.held.take_all()
        for e in self.registry.live():  # those the update did not reach: out, caught up
            if e.params_version != self.version:
                self.left_rotation(e)
                self._catch_up(e)

    def _record_served(self) -> None:
        if self.served_file is None:
            return
        tmp = self.served_file.with_name(self.served_file.name + ".tmp")
        tmp.write_text(json.dumps({"version": self.version, "path": self.path}))
        os.replace(tmp, self.served_file)

    # ------------------------------------------------------------------ catching up

    def _catch_up(self, e: EngineInfo, now: float | None = None) -> None:
        """Tells engine `e`, out of rotation, to load the served params; not during an update
        (its end catches up every engine), while a load of it is pending, or before the retry
        time of a failed one. Served params with no checkpoint to load leave it out."""
        if e.params_version == self.version:
            self.catching_up.pop(e.engine, None)
            return
        c = self.catching_up.get(e.engine)
        now = self.clock() if now is None else now
        if self.update is not None or (c is not None and c.pending):
            return
        if c is not None and c.version == self.version and now < c.retry_at:
            return
        if not self.path:
            log.warning(
                "engine %d serves params %r and there is no checkpoint of the served %r to load:"
                " it gets no work",
                e.engine,
                e.params_version,
                self.version,
            )
            self.out.event("params_mismatch", engine=e.engine, serves=e.params_version)
            return
        log.warning(
            "engine %d serves params %r, the cluster %r: it loads them before it gets work",
            e.engine,
            e.params_version,
            self.version,
        )
        self.catching_up[e.engine] = CatchUp(self.version, now)
        self.out.event(
            "params_catch_up", engine=e.engine, version=self.version, serves=e.params_version
        )
        self.out.send(e.ident, messages.LoadParams(version=self.version, path=self.path))

    def _caught_up(self, msg: messages.ParamsLoaded) -> None:
        """An engine out of rotation answered the load of its catch-up: it commits and is in
        rotation, or it stays out until the retry."""
        c = self.catching_up.get(msg.engine)
        e = self.registry.live_one(msg.engine)
        if c is None or e is None or not c.pending or msg.version != c.version:
            return  # not asked (a stale answer of an earlier registration or update)
        if not msg.ok:
            return self._catch_up_failed(e, c, msg.message)
        if msg.version != self.version:  # an update changed the served params meanwhile
            self.out.send(e.ident, messages.CommitParams(version=msg.version, commit=False))
            del self.catching_up[e.engine]
            return self._catch_up(e)
        self.out.send(e.ident, messages.CommitParams(version=msg.version, commit=True))
        e.params_version = msg.version
        del self.catching_up[e.engine]
        self.out.event("params_caught_up", engine=e.engine, version=msg.version)
        log.info("engine %d serves params %r: in rotation", e.engine, msg.version)

    def _catch_up_failed(
        self, e: EngineInfo, c: CatchUp, why: str, now: float | None = None
    ) -> None:
        retry = self.cluster.params_retry_s
        now = self.clock() if now is None else now
        c.t_sent, c.retry_at = math.nan, now + retry
        log.warning(
            "engine %d could not load params %r (%s); it gets no work, asked again in %g s",
            e.engine,
            c.version,
            why,
            retry,
        )
        self.out.event("params_catch_up_failed", engine=e.engine, version=c.version, message=why)

    def check_catch_ups(self, now: float) -> None:
        """A catch-up load unanswered for `cluster.params_load_timeout_s` failed; a failed one
        is retried once `cluster.params_retry_s` has passed."""
        limit = self.cluster.params_load_timeout_s
        for engine, c in list(self.catching_up.items()):
            e = self.registry.live_one(engine)
            if e is None:
                del self.catching_up[engine]
            elif c.pending and now - c.t_sent > limit:
                self._catch_up_failed(e, c, f"no answer within {limit:g} s", now)
            elif not c.pending and now >= c.retry_at:
                self._catch_up(e, now)

    # ------------------------------------------------------------------ engines

    def engine_joined(self, e: EngineInfo, msg: messages.Register) -> None:
        """A (re)registered engine: in rotation if it serves the served params, else caught up
        (once the update in progress, if any, has ended). Whatever an earlier registration of
        its id was asked to load is forgotten."""
        self.catching_up.pop(e.engine, None)
        u = self.update
        if u is not None:
            u.asked.discard(e.engine)
            if e.engine in u.waiting:
                u.waiting.discard(e.engine)
                if u.offer is not None:  # restarted mid-pull: as engine_gone
                    u.errors.append(f"engine {e.engine}: restarted while pulling the params")
                self._end_if_answered()
        self._catch_up(e)

    def engine_stale(self, e: EngineInfo) -> None:
        """Engine `e` refused a job of the served params (it serves others): out of rotation,
        caught up."""
        if e.params_version != self.version:
            return
        log.warning("engine %d does not serve params %r: out of rotation", e.engine, self.version)
        self.out.event("params_stale", engine=e.engine, version=self.version)
        e.params_version = None
        self.left_rotation(e)
        self._catch_up(e)

    def engine_gone(self, e: EngineInfo) -> None:
        """A dead engine is not waited for (nor committed to, nor caught up). A streamed update
        fails if it dies before it answered: it could not catch up (no checkpoint), so no
        engine serves the new params (fail-stop)."""
        self.catching_up.pop(e.engine, None)
        u = self.update
        if u is None:
            return
        u.asked.discard(e.engine)
        if e.engine in u.waiting:
            u.waiting.discard(e.engine)
            if u.offer is not None:
                u.errors.append(f"engine {e.engine}: died while pulling the params")
            self._end_if_answered()
