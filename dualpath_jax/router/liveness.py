"""Engine liveness, the router's part: who registered, from which connection, when each was last
heard from, which died, and whether a role has had no live engine for too long (docs/failures.md).

`EngineRegistry` is the bookkeeping, read by every part that looks engines up (live engines,
their nodes, capacities and connections); it sends nothing:

- `heard_from` authenticates a message that names an engine (it must come from the connection
  that registered it; heartbeats come from their own socket) and refreshes its `last_seen`.
- `silent(now)`: live engines quiet for longer than `cluster.heartbeat_timeout_s`.
- `serving(role, group)`: the live engines *in rotation*, those whose params version (as they
  registered, or as the params part brought them to) is the one the cluster serves (`served()`);
  only they are given work (docs/rl.md).
- `missing_role(now)`: why no round can run ("" if one can), a role with no engine in rotation
  for longer than `cluster.no_engine_timeout_s`. An engine that registers counts at once.

`Liveness` is the part that changes it: it answers `Register` and `Heartbeat`, and on the
router's tick (`check`) declares silent engines dead. The other parts learn of it through the
callables it is given, in order: `joined` after an engine registered (and was answered),
`died` after one was declared dead, `no_engine` while a role has had none for too long.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence

import msgspec

from dualpath_jax.config import ClusterConfig
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.wire import messages

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


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
    batch: int = 0  # requests in its latest forward, as it reported
    links: dict = dataclasses.field(default_factory=dict)
    devices: tuple[str, ...] = ()  # the devices it runs the model on, as it registered them
    mesh: str = ""  # their mesh ("data=2,tensor=2"; "": one device)
    kv_pieces: int = 1  # a PE: the column pieces of its KV rows (messages.Register)
    kv_piece_addresses: tuple[str, ...] = ()  # a spanning PE: where each new-row piece is offered
    kv_piece_holders: tuple[tuple[int, ...], ...] = ()  # ... and which processes hold each piece
    prefill_cost: messages.PrefillCost | None = None  # a PE: its cost model, if usable
    # The params version it serves: as it registered, then as the params part committed it
    # (None: unknown, it refused a job of the served version). Work goes only to engines whose
    # version is the served one.
    params_version: str | None = ""


class EngineRegistry:
    """Engines by id, in registration order (a re-registered id keeps its place). `served()` is
    the params version the cluster serves (the params part's)."""

    def __init__(
        self,
        cluster: ClusterConfig,
        clock: Callable[[], float],
        served: Callable[[], str] = lambda: "",
    ):
        self.cluster = cluster
        self.clock = clock
        self.served = served
        self._engines: dict[int, EngineInfo] = {}
        # When a live engine of each role was last known: rounds fail once one role has had
        # none for `cluster.no_engine_timeout_s`.
        self.role_seen = {"prefill": clock(), "decode": clock()}

    # ------------------------------------------------------------------ lookup

    def __getitem__(self, engine: int) -> EngineInfo:
        return self._engines[engine]

    def __contains__(self, engine: object) -> bool:
        return engine in self._engines

    def get(self, engine: int) -> EngineInfo | None:
        return self._engines.get(engine)

    def live(self, role: str | None = None, group: int | None = None) -> list[EngineInfo]:
        """The live engines (of `role`, in `group`), in registration order."""
        return [
            e
            for e in self._engines.values()
            if e.alive and (role is None or e.role == role) and (group is None or e.group == group)
        ]

    def serving(self, role: str | None = None, group: int | None = None) -> list[EngineInfo]:
        """The live engines in rotation (of `role`, in `group`): those serving the cluster's
        params version. Only they are given work."""
        version = self.served()
        return [e for e in self.live(role, group) if e.params_version == version]

    def live_one(self, engine: int) -> EngineInfo | None:
        """Engine `engine` if it is registered and alive."""
        e = self._engines.get(engine)
        return e if e is not None and e.alive else None

    # ------------------------------------------------------------------ registration

    def heard_from(self, ident: bytes, msg: messages.Msg) -> str:
        """Authenticates a message naming a registered engine and refreshes its `last_seen`.
        Returns why it is refused ("" if it is not): it came from a connection other than the
        one that registered the engine (heartbeats, from their own socket, excepted)."""
        engine = getattr(msg, "engine", None)
        e = self._engines.get(engine) if isinstance(engine, int) else None
        if e is None or isinstance(msg, messages.Register):
            return ""
        if e.ident != ident and not isinstance(msg, messages.Heartbeat):
            return f"engine {engine} is registered from another connection"
        e.last_seen = self.clock()
        return ""

    def takeover(self, ident: bytes, msg: messages.Register) -> str:
        """Why `msg` may not register its id ("" if it may): a live engine holds it from another
        connection or process."""
        old = self._engines.get(msg.engine)
        if old is not None and old.alive and (old.ident != ident or old.pid != msg.pid):
            return (
                f"engine id {msg.engine} is already registered by pid {old.pid}; "
                f"refused the second one (pid {msg.pid})"
            )
        return ""

    def add(self, ident: bytes, msg: messages.Register) -> EngineInfo:
        """Registers (or re-registers) an engine; it is live at once. A PE's cost model is kept
        if its terms are finite and not negative."""
        cost = msg.prefill_cost if msg.role == "prefill" else None
        if cost is not None and not all(math.isfinite(v) and v >= 0 for v in cost.prefill):
            log.warning("engine %d reported an unusable cost model %s", msg.engine, cost.prefill)
            cost = None
        e = EngineInfo(
            msg.role,
            msg.engine,
            msg.node,
            msg.group,
            msg.address,
            ident,
            msg.pid,
            self.clock(),
            devices=tuple(msg.devices),
            mesh=msg.mesh,
            kv_pieces=max(1, msg.kv_pieces),
            kv_piece_addresses=tuple(msg.kv_piece_addresses),
            kv_piece_holders=tuple(tuple(h) for h in msg.kv_piece_holders),
            prefill_cost=cost,
            params_version=msg.params_version,
        )
        self._engines[msg.engine] = e
        return e

    def report(self, e: EngineInfo, load: messages.Load, links: str) -> None:
        """Takes the capacity an engine reports with each `Fetch` (and its links, if any)."""
        e.hbm_tokens = load.hbm_capacity_tokens
        e.slots = load.slots
        e.batch = load.batch
        if links:
            e.links = json.loads(links)

    def decode_capacity(self) -> int:
        """The largest KV capacity (tokens) a live DE has reported; 0 before any has."""
        return max(
            (e.hbm_tokens for e in self._engines.values() if e.alive and e.role == "decode"),
            default=0,
        )

    # ------------------------------------------------------------------ liveness

    def silent(self, now: float) -> list[EngineInfo]:
        """Live engines not heard from for longer than `cluster.heartbeat_timeout_s`."""
        timeout = self.cluster.heartbeat_timeout_s
        return [e for e in self._engines.values() if e.alive and now - e.last_seen > timeout]

    def mark_dead(self, e: EngineInfo) -> None:
        e.alive = False

    def missing_role(self, now: float | None = None) -> str:
        """Why no round can run now ("" if they can): a role with no engine in rotation (live
        and serving the cluster's params) for longer than `cluster.no_engine_timeout_s`."""
        now = self.clock() if now is None else now
        limit = self.cluster.no_engine_timeout_s
        for role, seen in self.role_seen.items():
            if self.serving(role):
                self.role_seen[role] = now  # e.g. one that registered since the last check
            elif now - seen > limit:
                since = f"for {now - seen:.0f} s (cluster.no_engine_timeout_s={limit:g})"
                others = len(self.live(role))
                if not others:
                    return f"no live {role} engine {since}"
                return (
                    f"no live {role} engine has served params {self.served()!r} {since}; "
                    f"{others} serve other params and have not loaded them"
                )
        return ""

    # ------------------------------------------------------------------ metrics

    def stats(self) -> dict:
        return {
            str(e.engine): {
                "role": e.role,
                "alive": e.alive,
                "node": e.node,
                "pid": e.pid,
                "address": e.address,
                "devices": list(e.devices),
                "mesh": e.mesh,
                "kv_pieces": e.kv_pieces,
                "kv_piece_addresses": list(e.kv_piece_addresses),
                "kv_piece_holders": [list(h) for h in e.kv_piece_holders],
                "links": e.links,
                "params_version": e.params_version,
                # in rotation: live and serving the cluster's params (only these get work)
                "serving": e.alive and e.params_version == self.served(),
            }
            for e in self._engines.values()
        }


class Liveness:
    """Registers engines into `registry` and declares them dead. `joined(e, msg)` and `died(e)`
    are called in the order given; `no_engine(why)` on each tick while no round can run."""

    def __init__(
        self,
        registry: EngineRegistry,
        out: Outbox,
        *,
        joined: Sequence[Callable[[EngineInfo, messages.Register], None]],
        died: Sequence[Callable[[EngineInfo], None]],
        no_engine: Callable[[str], None],
    ):
        self.registry = registry
        self.out = out
        self.joined = tuple(joined)
        self.died = tuple(died)
        self.no_engine = no_engine

    def on_register(self, ident: bytes, msg: messages.Register) -> None:
        why = self.registry.takeover(ident, msg)
        if why:
            self.out.count("refused_frames")
            log.warning("%s", why)
            self.out.event("register_refused", engine=msg.engine, pid=msg.pid, message=why)
            return self.out.send(
                ident, messages.Error(ref=str(msg.engine), message=why, kind="stop")
            )
        if msg.role not in ROLES:
            why = f"unknown role {msg.role!r}"
            return self.out.send(
                ident, messages.Error(ref=str(msg.engine), message=why, kind="stop")
            )
        e = self.registry.add(ident, msg)
        cost = e.prefill_cost
        self.out.event(
            "register",
            engine=msg.engine,
            role=msg.role,
            node=msg.node,
            pid=msg.pid,
            devices=list(msg.devices),
            mesh=msg.mesh,
            **({"prefill_cost": msgspec.structs.asdict(cost)} if cost is not None else {}),
        )
        self.out.send(ident, messages.Ack(ref=str(msg.engine)))
        for joined in self.joined:
            joined(e, msg)

    def on_heartbeat(self, ident: bytes, msg: messages.Heartbeat) -> None:
        self.out.send(ident, messages.Ack(ref="hb"))  # last_seen was updated by `heard_from`

    def check(self, now: float) -> None:
        """Declares engines silent for too long dead; fails rounds while a role has none."""
        for e in self.registry.silent(now):
            self.declare_dead(e)
        missing = self.registry.missing_role(now)  # also records which roles have a live engine
        if missing:
            self.no_engine(missing)

    def declare_dead(self, e: EngineInfo) -> None:
        self.registry.mark_dead(e)
        self.out.count("engine_deaths")
        self.out.event("engine_dead", engine=e.engine, role=e.role, pid=e.pid)
        log.warning("engine %d (%s, pid %d) stopped heartbeating", e.engine, e.role, e.pid)
        for died in self.died:
            died(e)

    def stop_all(self) -> None:
        """Tells every live engine to stop (the router is shutting down)."""
        for e in self.registry.live():
            self.out.send(e.ident, messages.Stop())
