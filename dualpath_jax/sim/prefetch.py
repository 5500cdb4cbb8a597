"""Tool-gap prefetch in the simulator: the shell around `sched.prefetch`'s pure decisions.

When an agent's round ends with a tool call (`Round.gap_s > 0`; the trace says so, as a client's
`tool_call` hint would), `SimPrefetcher.tool_call` asks `plan_prefetch` where to read the next
turn's hit (a DE node from the scheduler's group totals, or a PE node from its PE nodes' tokens,
on the side the policy reads: `prefetch_sides`), evicts what it says, tells the scheduler to
`hold` the session there (the turn is pinned to that node's engines) and starts a `Background`
read on that node's storage NIC. The read advances the scheduler's `held` blocks as it goes. The
gap running past `hold_factor` x its expected length cancels it and frees the memory; the next
turn's submission stops it (the blocks read so far stay held); that turn's assignment consumes
them (`SimCluster._assign`: that side's store read shrinks by them) and frees the memory.

`Background`: bytes below LOW on one one-class (FIFO) link, the storage NICs of the simulated
cluster. They move in slices (`slice_s` of the link) only while no critical bytes are on the
wire or queued (`SimLink._free_at` has passed); critical bytes granted while a slice is on the
wire cut it at once (`SimLink.serve_now` calls `yield_to`: the bytes it moved so far count), so
a round's reads start exactly when they would without any prefetch. The node's DRAM (ten times
the storage NIC on the paper's nodes) counts the bytes without pacing them. Counted per link
(`bytes`, `yields`) and in the run's counters (`prefetch_*`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from dualpath_jax.sched.prefetch import (
    Held,
    PrefetchRule,
    expired,
    hold_until,
    plan_prefetch,
    prefetch_sides,
)
from dualpath_jax.sched.types import Assignment, ReadPath
from dualpath_jax.sim.core import Event, EventLoop
from dualpath_jax.sim.network import SimLink
from dualpath_jax.transfer import paths


@dataclasses.dataclass(eq=False)
class BackgroundJob:
    """`left` bytes to read; `on_bytes(n)` after each `n` moved, `on_done()` after the last."""

    left: int
    on_bytes: Callable[[int], object]
    on_done: Callable[[], object]
    cancelled: bool = False


class Background:
    """Background reads on one FIFO link (module docstring). `bytes`: moved so far; `yields`:
    slices cut short by critical bytes."""

    def __init__(self, link: SimLink, loop: EventLoop, *, slice_s: float, counted=()):
        if not link.fifo or link.rate <= 0:
            raise ValueError(f"background reads need a paced one-class link, not {link.id.name}")
        self.link, self.loop, self.rate = link, loop, link.rate
        self.counted = tuple(counted)
        self.slice_bytes = max(1, int(link.rate * slice_s))
        self.jobs: collections.deque[BackgroundJob] = collections.deque()
        self._ev: Event | None = None  # the next start, or the end of the slice on the wire
        self._wire: tuple[BackgroundJob, float, int] | None = None  # job, start, bytes
        self.bytes = 0
        self.yields = 0
        link.background = self

    def add(self, job: BackgroundJob) -> None:
        self.jobs.append(job)
        if self._ev is None:
            self._start()

    def cancel(self, job: BackgroundJob) -> None:
        """Stops `job` now (the bytes of its slice on the wire so far count)."""
        job.cancelled = True
        w = self._wire
        if w is not None and w[0] is job:
            self._cut(self.loop.now)
            self._start()

    def _start(self) -> None:
        self._ev = None
        now, free_at = self.loop.now, self.link._free_at
        if free_at > now:
            self._ev = self.loop.at(free_at, self._start)
            return
        jobs = self.jobs
        while jobs and (jobs[0].cancelled or jobs[0].left <= 0):
            jobs.popleft()
        if not jobs:
            return
        job = jobs[0]
        n = min(job.left, self.slice_bytes)
        self._wire = (job, now, n)
        self._ev = self.loop.at(now + n / self.rate, self._slice_end)

    def _slice_end(self) -> None:
        w = self._wire
        assert w is not None
        self._wire = None
        self._credit(w[0], w[2], w[1], self.loop.now)
        self._start()

    def _cut(self, now: float) -> None:
        w = self._wire
        assert w is not None and self._ev is not None
        self._wire = None
        self._ev.cancel()
        self._ev = None
        job, start, n = w
        self._credit(job, min(n, int((now - start) * self.rate)), start, now)

    def _credit(self, job: BackgroundJob, n: int, start: float, end: float) -> None:
        if n > 0:
            self.bytes += n
            for ln in (self.link, *self.counted):
                ln._account(1, n, start, end)
            job.left -= n
            if not job.cancelled:
                job.on_bytes(n)
        if job.left <= 0 and not job.cancelled:
            job.cancelled = True
            job.on_done()

    def yield_to(self, now: float, free_at: float) -> None:
        """Critical bytes hold the link from `now` until `free_at`: the slice on the wire stops
        and background resumes at `free_at`."""
        if self._wire is not None:
            self.yields += 1
            self._cut(now)
        elif self._ev is not None:
            if self._ev.time >= free_at:
                return
            self._ev.cancel()
            self._ev = None
        if self.jobs:
            self._ev = self.loop.at(free_at, self._start)


@dataclasses.dataclass(eq=False)
class _Entry:
    session: str
    side: ReadPath
    group: int  # its DE group (-1 on the PE side)
    node: int
    nbytes: int  # reserved from the node's budget
    started_s: float
    due_s: float
    job: BackgroundJob | None = None
    timer: Event | None = None
    read: int = 0  # bytes read so far
    in_use: bool = False  # its turn arrived (waits for its assignment)

    def held(self) -> Held:
        return Held(self.session, self.node, self.nbytes, self.started_s, self.due_s, self.in_use)


class SimPrefetcher:
    """Built by `SimCluster` when `scheduler.prefetch` is on (and the policy reads); one per run."""

    def __init__(self, cluster, rule: PrefetchRule, *, slice_s: float = 0.001):
        self.c = cluster
        self.rule = rule
        self.slice_s = slice_s
        self.block_bytes = cluster.bt * cluster.kvb
        self.entries: dict[str, _Entry] = {}
        self.background: dict[int, Background] = {}
        self.counters = cluster.counters
        self.sides = prefetch_sides(cluster.policy.spec.path_mode.value)
        cluster.scheduler.affinity_slack = rule.affinity_slack

    def tool_call(self, session: str, hit_tokens: int, expected_s: float) -> None:
        """A round of `session` ended with a tool call expected to last `expected_s`; its next
        turn's hit is `hit_tokens`."""
        c, now = self.c, self.c.loop.now
        if session in self.entries:
            self._free(session)
        held = [e.held() for e in self.entries.values()]
        sched = c.scheduler
        d = plan_prefetch(
            self.rule,
            hit_blocks=hit_tokens // c.bt,
            block_bytes=self.block_bytes,
            expected_s=expected_s,
            now=now,
            group_tok=sched.group_totals(),
            group_node=sched.de_group_nodes(),
            held=held,
            pe_node_tok=sched.pe_node_totals(),
            read_q=sched.read_queues(),
            sides=self.sides,
        )
        if d is None:
            self.counters["prefetch_skipped"] += 1
            return
        for s in d.evict:
            self.counters["prefetch_evicted"] += 1
            self._free(s)
        nbytes = d.blocks * self.block_bytes
        e = _Entry(session, d.side, d.group, d.node, nbytes, now, now + expected_s)
        self.entries[session] = e
        sched.hold(session, d.group, d.node, 0, d.side)
        e.job = BackgroundJob(e.nbytes, lambda n: self._read(e, n), lambda: None)
        self._link(d.node).add(e.job)
        e.timer = c.loop.at(hold_until(e.held(), self.rule), self._expire, session)
        self.counters["prefetch_started"] += 1

    def turn_submitted(self, session: str) -> None:
        """The next turn arrived: reads stop; what was read stays held for its assignment."""
        e = self.entries.get(session)
        if e is None:
            return
        e.in_use = True
        if e.job is not None and not e.job.cancelled:
            self._link(e.node).cancel(e.job)
        if e.timer is not None:
            e.timer.cancel()

    def assigned(self, a: Assignment) -> None:
        """The turn is assigned: its held blocks (if its engine of that side is on the node) are
        consumed; the memory is freed either way."""
        session = a.request.trajectory
        e = self.entries.get(session)
        if e is None:
            return
        if a.held_blocks:
            self.counters["prefetch_hit_tokens"] += a.held_blocks * self.c.bt
            self.counters[f"prefetch_used_{e.side.value}"] += 1
        else:
            self.counters["prefetch_unused"] += 1
        self._free(session)

    def _read(self, e: _Entry, n: int) -> None:
        e.read += n
        self.counters["prefetch_bytes"] += n
        self.c.scheduler.hold(e.session, e.group, e.node, e.read // self.block_bytes, e.side)

    def _expire(self, session: str) -> None:
        e = self.entries.get(session)
        if e is not None and expired(e.held(), self.c.loop.now, self.rule):
            self.counters["prefetch_cancelled"] += 1
            self._free(session)

    def _free(self, session: str) -> None:
        e = self.entries.pop(session)
        if e.job is not None and not e.job.cancelled:
            self._link(e.node).cancel(e.job)
        if e.timer is not None:
            e.timer.cancel()
        self.c.scheduler.drop(session)

    def _link(self, node: int) -> Background:
        bg = self.background.get(node)
        if bg is None:
            snic, dram = self.c.net.resolve(paths.store_read_path(f"node{node}"))
            bg = self.background[node] = Background(
                snic, self.c.loop, slice_s=self.slice_s, counted=(dram,)
            )
        return bg
