"""The simulated router: the real `GlobalScheduler` fed with the router's own loads, and the group
leaders' fetches on the virtual clock (the `router/router.py` side of `sim.cluster`).

Every new round is routed to a DE group when submitted (`route_de`, phase 1). Each group leader
fetches when the real engine loops do (`sim.leaders`): between its forward batches (PE) or decode
steps (DE), at most once per `fetch_interval_s`, and on its own timer while idle; a fetch that
could find nothing is not simulated (it would only record loads the scheduler has). A DE fetch is
`fetch_de`, a PE fetch `fetch_pe`. `SimOptions.leader_phases=False` keeps the earlier model: one
synchronous pass per interval in which every DE group, then every PE group fetches (the first PE
group then takes everything that waits, which at tens of groups sends each pass's rounds to one
node).

Loads are the router's own in-flight counts, current at every fetch: a PE counts a request until
its first token, a DE until it is done; `read_q` of a node is the hit tokens assigned to be read
on it whose reads have not finished; `free_hbm_tokens` is what the DE has not promised to
in-flight requests (0 when its decode slots are all promised). The cluster tells the router what
the real engines' messages would: `assigned`, `reads_done`, `prefilled`, `done`, and a PE's
batch starts and ends.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable

from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import Assignment, EngineLoad, ReadPath, Request
from dualpath_jax.sim.core import Event, EventLoop
from dualpath_jax.sim.decode import DecodeSteps
from dualpath_jax.sim.leaders import Leader
from dualpath_jax.sim.state import SimEngine


class SimRouter:
    """Lifecycle: built by `SimCluster` with its engines; lives as long as the run.

    `assign(a)` is the cluster's: it starts the data paths of an `Assignment` a PE fetch made;
    `place(request, de)` records the DE a DE fetch chose for a request. `decode` (the cluster's
    `DecodeSteps`, which needs the leaders made here) is set after construction.
    """

    def __init__(
        self,
        loop: EventLoop,
        scheduler: GlobalScheduler,
        pes: list[SimEngine],
        des: list[SimEngine],
        *,
        fetch_interval_s: float,
        leader_phases: bool,
        seed: int,
        assign: Callable[[Assignment], object],
        place: Callable[[Request, SimEngine], object],
        counters: collections.Counter[str],
    ):
        self.loop, self.scheduler = loop, scheduler
        self.fetch_interval_s = fetch_interval_s
        self.phases = leader_phases
        self._assign, self._place = assign, place
        self.decode: DecodeSteps | None = None  # the cluster's, set once it is built
        self.counters = counters
        self.engines = {e.id: e for e in (*pes, *des)}
        self._de_groups = _groups(des)
        self._pe_groups = list(_groups(pes).items())
        self._node_des: dict[int, list[SimEngine]] = {}
        for e in des:
            self._node_des.setdefault(e.node, []).append(e)
        # prefill node -> its PE groups' indices (in `_pe_groups`), each once, in engine order
        self._node_pe_groups: dict[int, list[int]] = {}
        # DEs whose load changed since the scheduler last saw it (all of them before the first
        # dispatch): reporting only these is what reporting every DE would record.
        self._de_dirty: dict[int, SimEngine] = {e.id: e for e in des}
        self._de_loads: dict[int, EngineLoad] = {}  # DE id -> its load as last reported
        self._unassigned = 0  # submitted rounds without an Assignment (== len(self.scheduler))
        self._pe_index = {gid: i for i, (gid, _) in enumerate(self._pe_groups)}
        for e in pes:
            at = self._node_pe_groups.setdefault(e.node, [])
            if self._pe_index[e.group] not in at:
                at.append(self._pe_index[e.group])
        self._pe_live = set(range(len(self._pe_groups)))  # PE groups not known to fetch nothing
        # each PE group's nodes (a fetch of the group takes the turns pinned to them)
        self._pe_group_nodes = [tuple({e.node: 0 for e in g}) for _, g in self._pe_groups]
        self._de_first = next(iter(self._de_groups))
        self._de_stuck: set[int] = set()  # DE groups whose last fetch assigned nothing
        self.read_q: dict[int, int] = collections.defaultdict(int)
        self._dispatch_at: float | None = None
        # Leaders' fetches (`leader_phases`; `sim.leaders`): while idle a leader polls every
        # interval plus its loop's overhead, a period of 1-1.05 intervals fixed per leader,
        # from a random phase (both seeded by the workload's seed); leaders polling at one
        # common period would keep one order for ever (the same PE leader first after every DE
        # fetch), which the real loops' jitter does not. A new round is routed to a DE group
        # (phase 1) when submitted: the real router routes it at the next DE fetch of any
        # group, and the group's own fetch, which places it, comes no earlier in either case.
        # Pending fetches: one event per DE group; one for the PE leader due first.
        rng = random.Random(seed)
        self._de_leaders = self._leaders(rng, self._de_groups)
        self._pe_leaders = list(self._leaders(rng, dict(self._pe_groups)).values())
        self._pe_lead = {group[0].id: i for i, (_, group) in enumerate(self._pe_groups)}
        self._pe_lead_engine = [group[0] for _, group in self._pe_groups]  # by group index
        self._de_polls: dict[int, Event] = {}
        self._pe_poll: Event | None = None

    def de_leaders(self) -> dict[int, Leader]:
        """DE group leader's engine id -> its fetch timing (`DecodeSteps` times its checks)."""
        return {self._de_groups[g][0].id: lead for g, lead in self._de_leaders.items()}

    # ------------------------------------------------------------ what the engines report

    def submit(self, request: Request) -> None:
        """A client submits one round now (the router's `on_submit` after the store lookup)."""
        self.scheduler.submit(request)
        self._unassigned += 1
        if self.phases:
            self._route()
        else:
            self._wake_router()

    def assigned(self, a: Assignment, pe: SimEngine, pe_read: int, de_read: int) -> None:
        """A PE fetch assigned `a`; `pe_read` / `de_read` hit tokens are to be read on the PE's
        / DE's node."""
        self._unassigned -= 1
        pe.seq += 1
        pe.tok += a.request.tokens
        self._touch_pe(pe)
        self.counters[_PATH_COUNTER[a.path]] += 1
        if a.recompute_blocks:  # load or recompute chose to recompute the hit or its lead
            self.counters["recompute_hits"] += 1
            if a.path is not ReadPath.NONE:
                self.counters["recompute_lead_hits"] += 1
            self.counters["recompute_hit_blocks"] += a.recompute_blocks
        de_node = self.engines[a.de].node
        # Both read queues grow before either node is touched (a touch may schedule a fetch).
        if pe_read:
            self.read_q[pe.node] += pe_read
        if de_read:
            self.read_q[de_node] += de_read
        if pe_read:
            self._touch_node(pe.node)
        if de_read:
            self._touch_node(de_node)

    def reads_done(self, node: int, tokens: int) -> None:
        """`tokens` of hit KV queued on `node` are read (the real engines send `ReadsDone`)."""
        self.read_q[node] -= tokens
        self._touch_node(node)
        self._wake_router()

    def prefilled(self, pe: SimEngine, request: Request) -> None:
        """The request's first token is out: the PE no longer counts it (`wake` follows)."""
        pe.seq -= 1
        pe.tok -= request.tokens
        self._touch_pe(pe)

    def wake(self) -> None:
        """Loads changed: the one-pass model's next pass is due an interval from now."""
        self._wake_router()

    def done(self, de: SimEngine, request: Request) -> None:
        """The request is decoded and persisted: the DE no longer counts it."""
        de.seq -= 1
        de.tok -= request.tokens
        de.hbm_promised -= request.hbm_tokens
        self._de_dirty[de.id] = de
        self._de_stuck.discard(de.group)
        if self.phases and self.scheduler.de_queued(de.group):
            self._want_de(de.group)
        self._wake_router()

    def batch_started(self, pe: SimEngine, now: float) -> None:
        """A PE started a forward batch: a leader cannot fetch until it ends."""
        if self.phases and pe.id in self._pe_lead:
            self._pe_leaders[self._pe_lead[pe.id]].went_busy(now)

    def batch_ended(self, pe: SimEngine) -> int | None:
        """A PE's forward batch ended: its group's leader fetches if an interval has passed.
        Returns the leader's group index (for `idle`), None if `pe` leads no group."""
        lead = self._pe_lead.get(pe.id) if self.phases else None
        if lead is not None and self._pe_leaders[lead].loop_check(
            self.loop.now, self.fetch_interval_s
        ):
            self._pe_fetch(lead)
        return lead

    def idle(self, lead: int) -> None:
        """Leader `lead` started no new batch: it polls on its own timer again."""
        self._want_pe(lead)

    # ------------------------------------------------------------ leaders' fetches (phases)

    def _route(self) -> None:
        """Phase 1 for the rounds in the DE global queue; their groups fetch when due."""
        self._report_des()
        for _, gid in self.scheduler.route_de():
            self._want_de(gid)

    def _want_de(self, gid: int) -> None:
        """Group `gid` fetches when its leader next does (unless a fetch is already due, or no
        DE of the group can hold its private queue's head)."""
        if gid not in self._de_polls and gid not in self._de_stuck:
            self._de_polls[gid] = self.loop.at(self._de_fetch_at(gid), self._de_leader_fetch, gid)

    def _leaders(self, rng: random.Random, groups: dict) -> dict[int, Leader]:
        """One `Leader` per group: idle periods of 1-1.05 fetch intervals, then random phases."""
        interval = self.fetch_interval_s
        periods = {g: interval * (1 + 0.05 * rng.random()) for g in groups}
        return {g: Leader(p, interval * rng.random()) for g, p in periods.items()}

    def _de_fetch_at(self, gid: int) -> float:
        """When DE group `gid`'s leader fetches next: the first step end an interval after its
        last fetch while it decodes (steps as its current span times them), else its next
        idle poll."""
        lead = self._de_groups[gid][0]
        leader = self._de_leaders[gid]
        if lead.stepping:
            t = max(self.loop.now, leader.last + self.fetch_interval_s)
            assert self.decode is not None
            return self.decode.step_end_after(lead, t)
        return leader.next_idle(self.loop.now)

    def _de_leader_fetch(self, gid: int) -> None:
        del self._de_polls[gid]
        self._de_leaders[gid].last = self.loop.now
        if not self.scheduler.de_queued(gid):
            return
        self.counters["fetches_de"] += 1
        self._report_des()
        self._fetch_de(gid)
        self._want_pe()

    def _want_pe(self, i: int | None = None) -> None:
        """Rounds may wait for a PE: keeps the pending PE fetch at the idle live leader due
        first (`i`: only group `i` changed, became live or idle; None: look at every group).
        Busy leaders fetch at their batch ends (`batch_ended`)."""
        sched = self.scheduler
        if not sched.pe_queued():
            return
        live = self._pe_live
        leads = self._pe_lead_engine
        now = self.loop.now
        nodes = self._pe_group_nodes
        if i is None:
            best_t, best = math.inf, -1
            leaders = self._pe_leaders
            for j in live:
                if not leads[j].busy and sched.pe_takeable(nodes[j]):
                    t = leaders[j].next_idle(now)
                    if t < best_t or (t == best_t and j < best):
                        best_t, best = t, j
            if best < 0:
                return
        else:
            if i not in live or leads[i].busy or not sched.pe_takeable(nodes[i]):
                return
            best, best_t = i, self._pe_leaders[i].next_idle(now)
        ev = self._pe_poll
        if ev is not None:
            if not ev.cancelled and ev.time <= best_t:
                return
            ev.cancel()
        self._pe_poll = self.loop.at(best_t, self._pe_leader_fetch, best)

    def _pe_leader_fetch(self, i: int) -> None:
        """Idle leader `i`'s periodic fetch (skipped if it started a batch meanwhile)."""
        self._pe_poll = None
        if not self._pe_groups[i][1][0].busy:
            self._pe_leaders[i].last = self.loop.now
            self._pe_fetch(i)
        self._want_pe()

    def _pe_fetch(self, i: int) -> None:
        sched = self.scheduler
        if i not in self._pe_live or not sched.pe_takeable(self._pe_group_nodes[i]):
            return
        self.counters["fetches_pe"] += 1
        self._report_des()  # the DE nodes' read queues as of now (the read-side choice)
        gid, group = self._pe_groups[i]
        out = sched.fetch_pe(gid, [self._load(e) for e in group])
        if not out:
            self._pe_live.discard(i)
        for a in out:
            self._assign(a)

    # ------------------------------------------------------------ one pass per interval

    def _wake_router(self) -> None:
        if self.phases:
            return
        t = self.loop.now + self.fetch_interval_s
        if self._dispatch_at is None:
            self._dispatch_at = t
            self.loop.at(t, self._dispatch)

    def _dispatch(self) -> None:
        """One fetch round: every DE group, then every PE group (leaders pull for their groups)."""
        self._dispatch_at = None
        if not self._unassigned:
            return
        sched = self.scheduler
        self.counters["dispatches"] += 1
        self._report_des()
        # A fetch that finds no request only records the group's loads, which the scheduler
        # already has (unchanged since the report above): such fetches are skipped.
        # Groups in id order: the first one routes the global queue (phase 1), then every group
        # whose private queue holds requests.
        first = self._de_first
        # A DE fetch assigns nothing exactly when no DE of the group has room for the head of
        # its private queue; until a DE of the group frees HBM or a slot (`done`), or the head
        # changes (only by an assignment), another fetch of that group would assign nothing
        # too, so such a group is skipped (its DEs' loads are reported above all the same).
        if sched.de_queued(first):
            self._fetch_de(first)
        stuck = self._de_stuck
        for gid in sched.de_groups_queued():
            if gid != first and gid not in stuck:
                self._fetch_de(gid)
        # Leaders fetch asynchronously in the real cluster; rotating who goes first keeps one
        # group from always seeing the queue's head.
        # A PE fetch that assigned nothing is not repeated until a load of its group changes:
        # given a request it can take (the shared queue, or a turn pinned to one of its nodes
        # by a PE-side prefetch: `pe_takeable`), both PE fetches (Algorithm 1, round robin)
        # assign nothing exactly when every PE of the group is over beta, whatever request heads
        # the queue, and then leave their cursor.
        groups = self._pe_groups
        n = len(groups)
        k = self.counters["dispatches"] % n
        for i in sorted(self._pe_live, key=lambda j: (j - k) % n):
            if not sched.pe_queued():
                break
            if not sched.pe_takeable(self._pe_group_nodes[i]):
                continue
            gid, group = groups[i]
            out = sched.fetch_pe(gid, [self._load(e) for e in group])
            if not out:
                self._pe_live.discard(i)
                continue
            for a in out:
                self._assign(a)

    # ------------------------------------------------------------ loads and fetches

    def _load(self, e: SimEngine) -> EngineLoad:
        free = 0
        if e.role == "decode":
            free = 0 if e.seq >= e.slots else max(0, e.hbm_tokens - e.hbm_promised)
        return EngineLoad(e.id, e.node, e.group, e.seq, e.tok, self.read_q[e.node], free)

    def _touch_node(self, node: int) -> None:
        """`read_q[node]` changed: a decode node reports again (through its first DE: the
        scheduler keeps one read queue per node, and re-reporting the others would record the
        same), a prefill node's PE groups may fetch again."""
        des = self._node_des.get(node)
        if des:
            self._de_dirty[des[0].id] = des[0]
        groups = self._node_pe_groups.get(node)
        if groups:
            for i in groups:
                self._pe_live.add(i)
                if self.phases and self._pe_lead_engine[i].node == node:
                    self._want_pe(i)

    def _touch_pe(self, e: SimEngine) -> None:
        """A PE's load changed: its group may fetch again."""
        i = self._pe_index[e.group]
        self._pe_live.add(i)
        if self.phases:
            self._want_pe(i)

    def _report_des(self) -> None:
        """Reports the DEs whose load changed since the scheduler last saw them."""
        if self._de_dirty:
            fresh = [self._load(e) for e in self._de_dirty.values()]
            for x in fresh:
                self._de_loads[x.engine] = x
            self.scheduler.report(fresh, "de")
            self._de_dirty.clear()

    def _fetch_de(self, gid: int) -> None:
        # The group's loads as last reported: no DE load changes between that report and the
        # group's fetch (a fetch reports first; a pass fetches each group once).
        loads = [self._de_loads[e.id] for e in self._de_groups[gid]]
        sched = self.scheduler
        got = sched.fetch_de(gid, loads) if sched.fetch_de_would_place(gid, loads) else ()
        if not got and sched.de_queued(gid):
            self._de_stuck.add(gid)
        for r, de in got:
            e = self.engines[de]
            self._place(r, e)
            e.seq += 1
            e.tok += r.tokens
            e.hbm_promised += r.hbm_tokens
            self._de_dirty[e.id] = e


_PATH_COUNTER = {p: f"path_{p.value}" for p in ReadPath}


def _groups(engines: list[SimEngine]) -> dict[int, list[SimEngine]]:
    out: dict[int, list[SimEngine]] = {}
    for e in engines:
        out.setdefault(e.group, []).append(e)
    return out
