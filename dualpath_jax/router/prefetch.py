"""Tool-gap prefetch in the real cluster, the router's part: `sched.prefetch`'s decisions over
the live engines, orders to the engines (`transfer.prefetch_memory` does their reads).

A client's `tool_call` hint (`ToolCall`; `run_trajectories(tool_calls=True)` sends one before
each gap of a trace) says that a session's round ended with a tool call expected to last
`expected_s`. With `scheduler.prefetch` on, the router looks up the session's stored blocks
(its context's whole blocks: the next turn's hit, whatever it appends) and asks `plan_prefetch`
where to read them, on the side the policy reads (`prefetch_sides`): the DE group phase 1 would
route the turn to now (the least total tokens; that group's DE with the fewest rounds), or the
PE node with the least tokens (its PE with the fewest rounds); as many leading blocks as that
engine's prefetch memory holds after evicting what `make_room` allows. The engine gets
`Prefetch(keys)`; the scheduler `hold`s the session there (the turn is pinned to that DE group
or PE node unless it is loaded beyond the affinity slack) and, once the engine reports
`Prefetched(blocks)`, counts those blocks as in memory: the turn's assignment reads its whole
hit on that side, those blocks from memory (`held_blocks`), the rest from the store.

Lifecycle of one prefetch, as in the simulator (`sim.prefetch`): started -> read (the engine's
reader, a block at a time, only while no round of that engine reads the store) -> the next turn
is submitted (`turn_submitted`: never evicted nor expired from then on) -> assigned
(`assigned`: consumed by its engine's load; a turn assigned to another engine tells the
prefetch's engine to drop it) | expired (the gap ran past `prefetch_hold_factor` x its expected
length) | evicted (room for another) | its engine died | its session closed. Correctness never
depends on it: a load takes only the blocks whose keys it wants from memory and reads the rest
from the store.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.kvstore.identity import block_keys
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.router.liveness import EngineInfo, EngineRegistry
from dualpath_jax.router.outbox import Outbox
from dualpath_jax.router.sessions import SessionTable
from dualpath_jax.sched.prefetch import (
    Held,
    PrefetchRule,
    expired,
    plan_prefetch,
    prefetch_sides,
)
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import Assignment, ReadPath
from dualpath_jax.transfer.prefetch_memory import prefetch_budget_bytes
from dualpath_jax.wire import messages

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Entry:
    session: str
    epoch: int
    engine: int  # the engine reading it
    side: ReadPath  # DE: `engine` is a DE of group `group`; PE: a PE (`group` -1)
    group: int
    node: int
    blocks: int  # asked for (reserved from the engine's budget)
    started_s: float
    due_s: float
    held: int = 0  # reported in memory (`Prefetched`)
    in_use: bool = False  # its turn was submitted

    def as_held(self, block_bytes: int) -> Held:
        # `Held.node` is the budget's owner: in the real cluster, one engine's memory
        return Held(
            self.session,
            self.engine,
            self.blocks * block_bytes,
            self.started_s,
            self.due_s,
            self.in_use,
        )


class Prefetches:
    """The router's tool-gap prefetches (module docstring). `after_store(future, done, failed)`
    goes on once a store call answers (the sessions part's); `fingerprint()` is the served
    params' block-key fingerprint."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        scheduler: GlobalScheduler,
        registry: EngineRegistry,
        table: SessionTable,
        store: Any,
        out: Outbox,
        clock: Callable[[], float],
        *,
        after_store: Callable[..., None],
        fingerprint: Callable[[], str],
    ):
        s = cfg.scheduler
        self.sides = prefetch_sides(scheduler.policy.spec.path_mode.value)
        self.enabled = bool(s.prefetch) and bool(self.sides)
        self.bt = cfg.store.block_tokens
        layout = BlockLayout.for_model(cfg.model, self.bt)
        self.block_bytes = layout.nbytes
        self.rule = PrefetchRule(
            budget_bytes=prefetch_budget_bytes(cfg, layout),
            min_gap_s=s.prefetch_min_gap_s,
            hold_factor=s.prefetch_hold_factor,
            affinity_slack=s.prefetch_affinity_slack,
        )
        if self.enabled:
            scheduler.affinity_slack = self.rule.affinity_slack
        self.scheduler, self.registry, self.table = scheduler, registry, table
        self.store, self.out, self.clock = store, out, clock
        self.after_store, self.fingerprint = after_store, fingerprint
        self.entries: dict[str, _Entry] = {}
        self._epoch = 0

    # ------------------------------------------------------------------ messages

    def on_tool_call(self, ident: bytes, msg: messages.ToolCall) -> None:
        """Acknowledges a tool call at once; a prefetch may start once the store answers."""
        if not (math.isfinite(msg.expected_s) and msg.expected_s >= 0):
            why = f"expected_s must be a finite number of seconds >= 0, got {msg.expected_s!r}"
            return self.out.fail(ident, msg.session, why, kind="bad_request")
        s = self.table.get(msg.session)
        if s is None:
            return self.out.fail(ident, msg.session, f"unknown session {msg.session!r}")
        self.out.send(ident, messages.Ack(ref=msg.session))
        if not self.enabled or s.busy:
            return
        full = len(s.context) // self.bt
        keys = block_keys(s.context[: full * self.bt], self.bt, self.fingerprint())
        if not keys:
            return self.out.count("prefetch_skipped")

        def looked_up(hit: int) -> None:
            self.plan(msg.session, keys[:hit], msg.expected_s)

        def failed(e: Exception) -> None:
            log.warning("prefetch of %s: the store lookup failed: %s", msg.session, e)

        self.after_store(self.store.lookup(keys), looked_up, failed)

    def on_prefetched(self, ident: bytes, msg: messages.Prefetched) -> None:
        e = self.entries.get(msg.session)
        if e is None or e.epoch != msg.epoch or e.engine != msg.engine:
            return  # dropped meanwhile (the engine was told)
        e.held = min(msg.blocks, e.blocks)
        self.scheduler.hold(e.session, e.group, e.node, e.held, e.side)
        self.out.count("prefetch_blocks", e.held)
        self.out.event(
            "prefetched", session=e.session, engine=e.engine, blocks=e.held, read_s=msg.read_s
        )

    # ------------------------------------------------------------------ decisions

    def plan(self, session: str, keys: list[str], expected_s: float) -> None:
        """Starts a prefetch of `keys` (the session's stored hit) if `plan_prefetch` says so."""
        s = self.table.get(session)
        if s is None or s.busy or not keys:  # closed, or its next turn came meanwhile
            return self.out.count("prefetch_skipped")
        now = self.clock()
        if session in self.entries:
            self.drop(session, "replaced")
        busy = self._rounds_by_engine()

        def idlest(role: str, key) -> dict[int, EngineInfo]:
            out: dict[int, EngineInfo] = {}
            for e in self.registry.serving(role):
                best = out.get(key(e))
                if best is None or busy.get(e.engine, 0) < busy.get(best.engine, 0):
                    out[key(e)] = e
            return out

        des = idlest("decode", lambda e: e.group)  # DE group -> its DE with the fewest rounds
        pes = idlest("prefill", lambda e: e.node)  # PE node -> its PE with the fewest rounds
        totals = self.scheduler.group_totals()
        pe_tok = self.scheduler.pe_node_totals()
        read_q = self.scheduler.read_queues()
        # candidates by engine (each engine's memory is its own budget)
        by_engine = {e.engine: e for e in (*des.values(), *pes.values())}
        d = plan_prefetch(
            self.rule,
            hit_blocks=len(keys),
            block_bytes=self.block_bytes,
            expected_s=expected_s,
            now=now,
            group_tok={g: totals.get(g, 0) for g in des},
            group_node={g: e.engine for g, e in des.items()},
            held=[x.as_held(self.block_bytes) for x in self.entries.values()],
            pe_node_tok={e.engine: pe_tok[n] for n, e in pes.items() if n in pe_tok},
            read_q={x: read_q.get(e.node, 0) for x, e in by_engine.items()},
            sides=self.sides,
        )
        if d is None:
            return self.out.count("prefetch_skipped")
        for other in d.evict:
            self.drop(other, "evicted")
        eng = by_engine[d.node]
        self._epoch += 1
        e = _Entry(
            session, self._epoch, eng.engine, d.side, d.group, eng.node, d.blocks, now,
            now + expected_s,
        )  # fmt: skip
        self.entries[session] = e
        self.scheduler.hold(session, e.group, e.node, 0, e.side)
        self.out.send(
            eng.ident, messages.Prefetch(session=session, keys=keys[: d.blocks], epoch=e.epoch)
        )
        self.out.count("prefetch_started")
        self.out.event(
            "prefetch",
            session=session,
            engine=eng.engine,
            side=d.side.value,
            blocks=d.blocks,
            expected_s=expected_s,
        )

    def _rounds_by_engine(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self.table.requests.values():
            for e in (r.pe, r.de):
                if e >= 0:
                    out[e] = out.get(e, 0) + 1
        return out

    def drop(self, session: str, why: str) -> None:
        """Forgets `session`'s prefetch; its engine frees the memory."""
        e = self.entries.pop(session, None)
        if e is None:
            return
        self.scheduler.drop(session)
        eng = self.registry.live_one(e.engine)
        if eng is not None:
            self.out.send(eng.ident, messages.DropPrefetch(session=session, epoch=e.epoch))
        self.out.count(f"prefetch_{why}")
        self.out.event("prefetch_drop", session=session, engine=e.engine, why=why)

    # ------------------------------------------------------------------ the rounds' progress

    def turn_submitted(self, session: str) -> None:
        """The session's next turn arrived: its prefetch waits for the turn's assignment."""
        e = self.entries.get(session)
        if e is not None:
            e.in_use = True

    def assigned(self, a: Assignment) -> None:
        """A turn is assigned: its engine's load takes the prefetched blocks (if it is the engine
        that holds them, on the side that reads them); the prefetch is over either way."""
        e = self.entries.get(a.request.trajectory)
        if e is None:
            return
        if e.side is ReadPath.PE:
            used = a.pe == e.engine and a.pe_read_blocks > 0
        else:
            used = a.de == e.engine and a.de_read_blocks > 0
        if not used:  # its engine's load would not take the blocks: freed now
            return self.drop(e.session, "unused")
        del self.entries[e.session]  # the engine frees it when its load takes the blocks
        self.scheduler.drop(e.session)
        self.out.count("prefetch_used")
        self.out.count("prefetch_used_blocks", a.held_blocks)

    def tick(self, now: float) -> None:
        """Expires prefetches whose gap ran long, and those of closed sessions."""
        for e in list(self.entries.values()):
            if e.session not in self.table:
                self.drop(e.session, "closed")
            elif expired(e.as_held(self.block_bytes), now, self.rule):
                self.drop(e.session, "cancelled")

    def engine_gone(self, e: EngineInfo) -> None:
        """An engine died (or left rotation): what it held is gone."""
        for x in [x for x in self.entries.values() if x.engine == e.engine]:
            self.entries.pop(x.session)
            self.scheduler.drop(x.session)
            self.out.count("prefetch_lost")

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "held": {
                s: {
                    "engine": e.engine,
                    "side": e.side.value,
                    "blocks": e.blocks,
                    "held": e.held,
                    "in_use": e.in_use,
                }
                for s, e in self.entries.items()
            },
        }
