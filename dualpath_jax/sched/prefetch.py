"""Tool-gap prefetch (beyond the paper): pure decisions over snapshots.

A round that ends with a tool call leaves its session idle for the tool's run (the trace's
think/tool gap, or a client's `tool_call(expected_s)` hint), yet the next turn's hit is already
known: the session's blocks. The scheduler may read that hit into a DE node's host memory during
the gap, on the DE read path, at the storage NIC's lowest priority (it only fills time the
critical reads leave idle), within a DRAM budget per engine; the next turn is then routed to
that node's DE group (phase 1 of the DE fetch, `honor_affinity`) and its read path finds the hit
in memory (`inter.assign_paths` with `held`).

Why the DE side: the next turn's DE group is chosen when it is routed (phase 1), which the
prefetch can fix in advance without breaking the FIFO order of the queues; its PE is whichever
PE leader fetches the waiting head first, unknown before the turn arrives.

Lifecycle of one prefetch (its shell is `sim.prefetch.SimPrefetcher`):
`plan_prefetch` (where, how many blocks, what to evict) -> reads while the gap lasts ->
`expired` (the gap ran long: cancel and free) or the next turn is submitted (reads stop; the
blocks read so far are `held`) -> the turn's assignment consumes them (or not, when it was not
routed to the node) and the memory is freed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from dualpath_jax.config import SchedulerConfig
from dualpath_jax.sched.inter import GroupTotals


@dataclasses.dataclass(frozen=True)
class PrefetchRule:
    """`budget_bytes`: DRAM one DE node holds for prefetched KV (engines x
    `scheduler.prefetch_bytes_per_engine`); `min_gap_s`: shorter expected gaps are not worth a
    read (the turn would arrive before much is read); `hold_factor`: a prefetch whose gap runs
    past `hold_factor` x its expected length is cancelled and its memory freed;
    `affinity_slack`: the next turn goes to the prefetch's group unless that group's tokens
    exceed `(1 + slack)` x the groups' mean plus the turn's own."""

    budget_bytes: float
    min_gap_s: float = 0.5
    hold_factor: float = 3.0
    affinity_slack: float = 0.5

    @classmethod
    def from_config(cls, cfg: SchedulerConfig, engines_per_node: int, dram_buffer_bytes: float):
        per_engine = cfg.prefetch_bytes_per_engine or dram_buffer_bytes
        return cls(
            budget_bytes=per_engine * engines_per_node,
            min_gap_s=cfg.prefetch_min_gap_s,
            hold_factor=cfg.prefetch_hold_factor,
            affinity_slack=cfg.prefetch_affinity_slack,
        )


@dataclasses.dataclass(frozen=True)
class Held:
    """One session's prefetch on a node: `nbytes` reserved from the node's budget, started at
    `started_s`, its next turn expected at `due_s`; `in_use`: that turn has arrived and waits
    for its assignment (never evicted)."""

    session: str
    node: int
    nbytes: int
    started_s: float
    due_s: float
    in_use: bool = False


@dataclasses.dataclass(frozen=True)
class PrefetchDecision:
    """Read the first `blocks` hit blocks of the session into `node` (DE group `group`), after
    evicting the prefetches of `evict` (sessions) from that node."""

    group: int
    node: int
    blocks: int
    evict: tuple[str, ...] = ()


def plan_prefetch(
    rule: PrefetchRule,
    *,
    hit_blocks: int,
    block_bytes: int,
    expected_s: float,
    now: float,
    group_tok: Mapping[int, int],
    group_node: Mapping[int, int],
    held: Sequence[Held],
) -> PrefetchDecision | None:
    """Whether and where to prefetch a session's hit during its tool call.

    None when there is no hit, no DE group, or the expected gap is shorter than `min_gap_s` (or
    not finite). The node is that of the group with the least total tokens (where phase 1 would
    route the turn now; ties to the lowest group id). As many leading blocks as the node's
    budget holds are read, after `make_room` frees what it may; None when nothing fits.
    """
    if hit_blocks <= 0 or not group_tok or not (rule.min_gap_s <= expected_s < math.inf):
        return None
    group = min(group_tok, key=lambda g: (group_tok[g], g))
    node = group_node.get(group)
    if node is None:
        return None
    blocks = min(hit_blocks, int(rule.budget_bytes // block_bytes))
    if blocks <= 0:
        return None
    on_node = [h for h in held if h.node == node]
    evict = make_room(on_node, blocks * block_bytes, rule.budget_bytes, now, now + expected_s)
    if evict is None:
        return None
    return PrefetchDecision(group, node, blocks, evict)


def make_room(
    held: Sequence[Held], need: int, budget: float, now: float, due_s: float
) -> tuple[str, ...] | None:
    """The sessions to evict from a node so that `need` more bytes fit its `budget`, or None
    when they cannot. Candidates go overdue first (their turn should have come: `due_s < now`),
    then the one needed last; an entry needed before the new one (`due_s`) is kept, and so is
    one in use."""
    free = budget - sum(h.nbytes for h in held)
    if need <= free:
        return ()
    if need > budget:
        return None
    candidates = [h for h in held if not h.in_use]
    order = sorted(candidates, key=lambda h: (h.due_s >= now, -h.due_s, h.session))
    out: list[str] = []
    for h in order:
        if h.due_s >= now and h.due_s <= due_s:
            break
        out.append(h.session)
        free += h.nbytes
        if need <= free:
            return tuple(out)
    return None


def hold_until(h: Held, rule: PrefetchRule) -> float:
    """When a prefetch whose turn has not come is given up: `hold_factor` x its expected gap
    (at least `min_gap_s`) after it started."""
    return h.started_s + rule.hold_factor * max(h.due_s - h.started_s, rule.min_gap_s)


def expired(h: Held, now: float, rule: PrefetchRule) -> bool:
    """The gap ran long: `hold_until` has passed and the turn has not come."""
    return not h.in_use and now >= hold_until(h, rule)


def honor_affinity(
    group: int, group_tok: Mapping[int, int] | GroupTotals, tokens: int, slack: float
) -> bool:
    """Route a turn to the group holding its prefetch unless that group is loaded beyond
    `(1 + slack)` x the mean total plus the turn's own tokens (then the prefetch is given up)."""
    if group not in group_tok:
        return False
    mean = sum(group_tok[g] for g in group_tok) / len(group_tok)
    return group_tok[group] <= (1 + slack) * mean + tokens
