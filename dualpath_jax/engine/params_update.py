"""The params a cluster serves, and the router's side of `UpdateParams` (engine/params.py).

`ParamsCoordinator` is the router's params part. It owns the served version (and so the block-key
fingerprint) and the update state machine:

    idle --UpdateParams--> draining --no round in flight--> loading --every live engine
    answered (or died, or params_load_timeout_s passed)--> idle (committed or refused)

While an update is in progress (draining or loading) the router hands new rounds to it (`hold`)
instead of the sessions part; a held round the client cancels ends here (`cancel_held`). When
the update ends they are released, in order (`take_released`), for the router to hand to the
sessions part: they run with whichever params are served then. The coordinator handles
`UpdateParams` and `ParamsLoaded`, sends the engines' `LoadParams` / `CommitParams` and answers
the client itself, through its outbox; it reads the live engines from the registry and the rounds
in flight from `in_flight()`. The router's loop moves it on after every message and tick
(`advance`, `check_timeout`); liveness tells it which engine registered (`engine_joined`: one
that serves other params is brought up to date) or died (`engine_gone`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engine import messages
from dualpath_jax.engine.liveness import EngineInfo, EngineRegistry
from dualpath_jax.engine.outbox import Outbox
from dualpath_jax.engine.params import check_version, initial_params_version
from dualpath_jax.kvstore.identity import model_fingerprint

log = logging.getLogger(__name__)


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


class ParamsCoordinator:
    """Served params (`version`, `path`, `fingerprint`) and the update in progress (`update`,
    with the rounds `held` meanwhile and those `released` at its end)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        registry: EngineRegistry,
        out: Outbox,
        clock: Callable[[], float],
        in_flight: Callable[[], int],
    ):
        self.model = cfg.model
        self.cluster = cfg.cluster
        self.registry = registry
        self.out = out
        self.clock = clock
        self.in_flight = in_flight
        self.version = initial_params_version(cfg.cluster)
        self.path = cfg.cluster.params_path
        self.fingerprint = model_fingerprint(cfg.model, self.version)
        self.update: ParamsUpdate | None = None
        self.held: list[tuple[bytes, messages.Submit]] = []  # rounds submitted during an update
        self.released: list[tuple[bytes, messages.Submit]] = []  # held ones, the update over

    # ------------------------------------------------------------------ held rounds

    def hold(self, ident: bytes, msg: messages.Submit) -> bool:
        """Holds a round submitted during an update (True), to run once it is over."""
        if self.update is None:
            return False
        self.held.append((ident, msg))
        return True

    def holds_round_of(self, ident: bytes, session: str) -> bool:
        return any(i == ident and m.session == session for i, m in self.held)

    def holds_session(self, session: str) -> bool:
        """Whether a round of `session` waits for the update to end."""
        return any(m.session == session for _, m in self.held)

    def cancel_held(self, ident: bytes, msg: messages.CancelRound) -> bool:
        """Ends `ident`'s held round `msg.request` as cancelled; False if there is none."""
        for i, (who, sub) in enumerate(self.held):
            if sub.request == msg.request and who == ident:
                del self.held[i]
                self.out.count("cancelled")
                self.out.fail(ident, msg.request, "cancelled by the client", kind="cancelled")
                return True
        return False

    def take_released(self) -> list[tuple[bytes, messages.Submit]]:
        """The rounds held during the update that just ended, in order (once)."""
        released, self.released = self.released, []
        return released

    # ------------------------------------------------------------------ the update

    def on_update(self, ident: bytes, msg: messages.UpdateParams) -> None:
        """Starts an update (engine/params.py): new rounds are held, running ones drain."""
        ref = f"params:{msg.version}"
        try:
            check_version(msg.version)
        except ValueError as e:
            return self.out.fail(ident, ref, str(e))
        if not msg.path:
            return self.out.fail(
                ident, ref, "UpdateParams needs the path of a parameter checkpoint"
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
        self.update = ParamsUpdate(ident, msg.version, msg.path)
        self.out.event(
            "params_update", version=msg.version, path=msg.path, in_flight=self.in_flight()
        )

    def advance(self) -> None:
        """Moves an update on: once no round is in flight, every live engine loads the params."""
        u = self.update
        if u is None or u.loading or self.in_flight():
            return
        u.loading, u.t_load = True, self.clock()
        live = self.registry.live()
        u.waiting = {e.engine for e in live}
        for e in live:
            self.out.send(e.ident, messages.LoadParams(version=u.version, path=u.path))
        self._end_if_answered()

    def on_loaded(self, ident: bytes, msg: messages.ParamsLoaded) -> None:
        u = self.update
        if u is None or not u.loading or msg.version != u.version or msg.engine not in u.waiting:
            return
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
            self.out.send(e.ident, messages.CommitParams(version=u.version, commit=ok))
        self.update = None
        ref = f"params:{u.version}"
        if ok:
            self.version, self.path = u.version, u.path
            self.fingerprint = model_fingerprint(self.model, self.version)
            self.out.event("params_served", version=u.version)
            self.out.send(u.client, messages.Ack(ref=ref))
        else:
            errors = "; ".join(u.errors)
            why = f"params {u.version!r} refused, still serving {self.version!r}: {errors}"
            self.out.fail(u.client, ref, why)
        self.released += self.held
        self.held = []

    # ------------------------------------------------------------------ engines

    def engine_joined(self, e: EngineInfo, msg: messages.Register) -> None:
        """An engine that (re)started after an update is brought to the current params, if they
        came from a checkpoint; if it cannot load them, its jobs fail with a clear version
        mismatch."""
        if msg.params_version == self.version:
            return
        log.warning(
            "engine %d serves params %r, the cluster %r", e.engine, msg.params_version, self.version
        )
        if self.path:
            self.out.send(e.ident, messages.LoadParams(version=self.version, path=self.path))
            self.out.send(e.ident, messages.CommitParams(version=self.version, commit=True))

    def engine_gone(self, e: EngineInfo) -> None:
        """A dead engine is not waited for."""
        if self.update is not None and e.engine in self.update.waiting:
            self.update.waiting.discard(e.engine)
            self._end_if_answered()
