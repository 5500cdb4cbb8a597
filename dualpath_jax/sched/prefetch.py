"""Tool-gap prefetch (beyond the paper): pure decisions over snapshots.

A round that ends with a tool call leaves its session idle for the tool's run (the trace's
think/tool gap, or a client's `tool_call(expected_s)` hint), yet the next turn's hit is already
known: the session's blocks. The scheduler may read that hit into a node's host memory during the
gap, on the read path it would choose for the next turn, at the storage NIC's lowest priority (it
only fills time the critical reads leave idle), within a DRAM budget per engine; the next turn is
then pinned to the engines of that node and its read path finds the hit in memory
(`inter.assign_paths` with `held`).

Which side (`prefetch_sides`): a policy that reads on the PE side only (Basic) prefetches into a
PE node; one that chooses per request (DualPath and its variants) prefetches where the shorter
read queue is now, as it would choose the turn's read side, ties to the DE side (the NICs the
paper's Basic leaves idle); Oracle reads nothing and prefetches nothing. When the chosen node
has no room, the other side is tried.

How the turn is pinned: on the DE side, DE phase 1 routes it to the prefetch's DE group
(`honor_affinity` over the groups' totals), which fixes its DE in advance without breaking the
FIFO order of the queues. On the PE side, the turn leaves the shared PE waiting queue for the
held node's own queue once its DE is placed (when `pe_pin_wins`: the pin does not lengthen its
read, and `honor_affinity` over the PE nodes' tokens), and the PEs of that node take it first
(`GlobalScheduler.fetch_pe`).

Lifecycle of one prefetch (its shells are `sim.prefetch.SimPrefetcher` and the router's
`router.prefetch.Prefetches`): `plan_prefetch` (side, node, how many blocks, what to evict) ->
reads while the gap lasts -> `expired` (the gap ran long: cancel and free) or the next turn is
submitted (reads stop; the blocks read so far are `held`) -> the turn's assignment consumes them
(or not, when it was not placed on the node) and the memory is freed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from dualpath_jax.config import SchedulerConfig
from dualpath_jax.sched.inter import GroupTotals
from dualpath_jax.sched.types import ReadPath

SIDES = ("pe", "de", "shorter")


@dataclasses.dataclass(frozen=True)
class PrefetchRule:
    """`budget_bytes`: DRAM one node (or engine) holds for prefetched KV (engines x
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
    """Read the first `blocks` hit blocks of the session into `node`, after evicting the
    prefetches of `evict` (sessions) from that node. `side`: `ReadPath.DE` (the node of DE
    group `group`) or `ReadPath.PE` (a PE node; `group` is -1)."""

    group: int
    node: int
    blocks: int
    evict: tuple[str, ...] = ()
    side: ReadPath = ReadPath.DE


def prefetch_sides(path_mode: str) -> str:
    """The sides a policy's read-path mode prefetches on: "pe" (it reads on the PE side only),
    "shorter" (it chooses per request: the side with the shorter read queue now), "" (Oracle:
    it reads nothing)."""
    if path_mode == "none":
        return ""
    return "pe" if path_mode == "pe" else "shorter"


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
    pe_node_tok: Mapping[int, int] | None = None,
    read_q: Mapping[int, int] | None = None,
    sides: str = "de",
) -> PrefetchDecision | None:
    """Whether and where to prefetch a session's hit during its tool call.

    None when there is no hit, no candidate node, or the expected gap is shorter than
    `min_gap_s` (or not finite). The DE candidate is the node of the DE group with the least
    total tokens (`group_tok`; where phase 1 would route the turn now; ties to the lowest group
    id), the PE candidate the PE node with the shortest read queue, then the least tokens
    (`pe_node_tok`: node -> its PEs' tokens, only nodes whose PEs can take a turn; Algorithm 1
    too prefers PEs whose node's read queue is short). `sides` ("de", "pe" or "shorter") says which
    are tried: "shorter" tries the one whose node has the shorter read queue first (`read_q`:
    node -> queued read tokens), ties to the DE side, then the other. On a node, as many leading
    blocks as its budget holds are read, after `make_room` frees what it may; None when nothing
    fits anywhere.
    """
    if sides not in SIDES:
        raise ValueError(f"sides must be one of {SIDES}, got {sides!r}")
    if hit_blocks <= 0 or not (rule.min_gap_s <= expected_s < math.inf):
        return None
    blocks = min(hit_blocks, int(rule.budget_bytes // block_bytes))
    if blocks <= 0:
        return None
    cands: list[tuple[ReadPath, int, int]] = []  # (side, DE group or -1, node)
    if sides != "pe" and group_tok:
        group = min(group_tok, key=lambda g: (group_tok[g], g))
        node = group_node.get(group)
        if node is not None:
            cands.append((ReadPath.DE, group, node))
    if sides != "de" and pe_node_tok:
        q = read_q or {}
        node = min(pe_node_tok, key=lambda n: (q.get(n, 0), pe_node_tok[n], n))
        cands.append((ReadPath.PE, -1, node))
    if len(cands) == 2 and read_q is not None:
        q = read_q
        if q.get(cands[1][2], 0) < q.get(cands[0][2], 0):  # the PE side's queue is shorter
            cands.reverse()
    for side, group, node in cands:
        on_node = [h for h in held if h.node == node]
        evict = make_room(on_node, blocks * block_bytes, rule.budget_bytes, now, now + expected_s)
        if evict is not None:
            return PrefetchDecision(group, node, blocks, evict, side)
    return None


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


def pe_pin_wins(
    node: int,
    pe_nodes: Mapping[int, int],
    read_q: Mapping[int, int],
    hit_tokens: int,
    held_blocks: int,
    block_tokens: int,
) -> bool:
    """Whether pinning a turn to PE `node`, which holds its first `held_blocks` hit blocks,
    keeps its read no longer than elsewhere: `node`'s read queue plus the hit not held is at
    most the shortest queue of the other PE nodes (`pe_nodes`' keys) plus the whole hit. A
    prefetch that read little while the NICs were busy then does not pull its turn to a node
    whose storage NIC is behind the others'."""
    rest = max(0, hit_tokens - held_blocks * block_tokens)
    others = [read_q.get(n, 0) for n in pe_nodes if n != node]
    return not others or read_q.get(node, 0) + rest <= min(others) + hit_tokens


def honor_affinity(
    group: int, group_tok: Mapping[int, int] | GroupTotals, tokens: int, slack: float
) -> bool:
    """Route a turn to the group (or PE node) holding its prefetch unless that one is loaded
    beyond `(1 + slack)` x the mean total plus the turn's own tokens (then the prefetch is
    given up)."""
    if group not in group_tok:
        return False
    mean = sum(group_tok[g] for g in group_tok) / len(group_tok)
    return group_tok[group] <= (1 + slack) * mean + tokens
