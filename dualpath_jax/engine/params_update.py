"""The params a cluster serves, and the router's side of `UpdateParams` (engine/params.py).

`ParamsCoordinator` owns the served version (and so the block-key fingerprint) and the update
state machine:

    idle --UpdateParams--> draining --no round in flight--> loading --every live engine
    answered (or died, or params_load_timeout_s passed)--> idle (committed or refused)

While an update is in progress (draining or loading) new rounds are held here (`hold`); when it
ends they are handed back, in order, to `resubmit`, and run with whichever params are served
then. The coordinator sends the engines' `LoadParams` / `CommitParams` and answers the client
itself, through the `send` / `fail` / `event` it is given; it reads the live engines from the
registry. The router tells it how many rounds are in flight (`advance`), what the engines
answer (`on_loaded`), which engine died (`engine_gone`) and the time (`check_timeout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engine import messages as M
from dualpath_jax.engine.liveness import EngineRegistry
from dualpath_jax.engine.params import check_version, initial_params_version
from dualpath_jax.kvstore.identity import model_fingerprint


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
    with the rounds `held` meanwhile)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        engines: EngineRegistry,
        *,
        send: Callable[[bytes, M.Msg], None],
        fail: Callable[..., None],
        event: Callable[..., None],
        resubmit: Callable[[bytes, M.Submit], None],
        clock: Callable[[], float],
    ):
        self.model = cfg.model
        self.cluster = cfg.cluster
        self.engines = engines
        self.send, self.fail, self.event, self.resubmit = send, fail, event, resubmit
        self.clock = clock
        self.version = initial_params_version(cfg.cluster)
        self.path = cfg.cluster.params_path
        self.fingerprint = model_fingerprint(cfg.model, self.version)
        self.update: ParamsUpdate | None = None
        self.held: list[tuple[bytes, M.Submit]] = []  # rounds submitted during an update

    # ------------------------------------------------------------------ held rounds

    def hold(self, ident: bytes, msg: M.Submit) -> bool:
        """Holds a round submitted during an update (True), to run once it is over."""
        if self.update is None:
            return False
        self.held.append((ident, msg))
        return True

    def holds_round_of(self, ident: bytes, session: str) -> bool:
        return any(i == ident and m.session == session for i, m in self.held)

    def unhold(self, ident: bytes, request: str) -> bool:
        """Drops `ident`'s held round `request`; False if there is none."""
        for i, (who, sub) in enumerate(self.held):
            if sub.request == request and who == ident:
                del self.held[i]
                return True
        return False

    # ------------------------------------------------------------------ the update

    def start(self, ident: bytes, msg: M.UpdateParams, in_flight: int) -> None:
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
        if msg.version == self.version:
            return self.fail(
                ident,
                ref,
                f"params version {msg.version!r} is already served; name updates uniquely",
            )
        self.update = ParamsUpdate(ident, msg.version, msg.path)
        self.event("params_update", version=msg.version, path=msg.path, in_flight=in_flight)

    def advance(self, in_flight: int) -> None:
        """Moves an update on: once no round is in flight, every live engine loads the params."""
        u = self.update
        if u is None or u.loading or in_flight:
            return
        u.loading, u.t_load = True, self.clock()
        live = self.engines.live()
        u.waiting = {e.engine for e in live}
        for e in live:
            self.send(e.ident, M.LoadParams(version=u.version, path=u.path))
        self._end_if_answered()

    def on_loaded(self, msg: M.ParamsLoaded) -> None:
        u = self.update
        if u is None or not u.loading or msg.version != u.version or msg.engine not in u.waiting:
            return
        u.waiting.discard(msg.engine)
        if not msg.ok:
            u.errors.append(f"engine {msg.engine}: {msg.message}")
        self._end_if_answered()

    def engine_gone(self, engine: int) -> None:
        """A dead engine is not waited for."""
        if self.update is not None and engine in self.update.waiting:
            self.update.waiting.discard(engine)
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
        for e in self.engines.live():
            self.send(e.ident, M.CommitParams(version=u.version, commit=ok))
        self.update = None
        ref = f"params:{u.version}"
        if ok:
            self.version, self.path = u.version, u.path
            self.fingerprint = model_fingerprint(self.model, self.version)
            self.event("params_served", version=u.version)
            self.send(u.client, M.Ack(ref=ref))
        else:
            errors = "; ".join(u.errors)
            msg = f"params {u.version!r} refused, still serving {self.version!r}: {errors}"
            self.fail(u.client, ref, msg)
        held, self.held = self.held, []
        for ident, sub in held:
            self.resubmit(ident, sub)

    # ------------------------------------------------------------------ (re)started engines

    def bring_up_to_date(self, ident: bytes) -> None:
        """Sends a (re)started engine that serves other params the current ones, if they came
        from a checkpoint (else its jobs fail with a clear version mismatch)."""
        if self.path:
            self.send(ident, M.LoadParams(version=self.version, path=self.path))
            self.send(ident, M.CommitParams(version=self.version, commit=True))
