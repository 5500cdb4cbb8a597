"""Inter-engine scheduling cores (paper section 6.1): pure functions over frozen loads.

- `pe_fetch`: Algorithm 1. PEs are classed by `tok_e` vs beta (C1: overloaded, never chosen) and
  the node's `read_q` vs alpha (C2: short read queue, preferred; C3: long). Requests are taken
  FIFO from the head of the waiting queue; each goes to the argmin-`tok_e` PE of C2, else of C3;
  `tok_e` is updated after every assignment; the fetch stops at the first request nothing can take.
  The classes are re-evaluated after every update: Algorithm 1's listing classifies once before
  its loop, but then a fetch could only end when the queue empties, and the text says overloaded
  PEs get no new requests. `read_q` comes from the snapshot (Algorithm 1 only updates `tok_e`).
- `de_route` (phase 1): drains the DE global queue, each request to the group with the minimum
  total `tok`, updated after each request.
- `de_fetch` (phase 2): inside one group; R = the longest head of the private queue that fits in
  the group's total free HBM; `Z = z_factor * (sum_{r in R} len_r + sum_e tok_e) / |E|`; the head
  goes to the DE (among those with room for it) with `tok_e + len_r <= Z` and minimum `seq_e`,
  else to the one with minimum `tok_e`; the fetch stops when no DE has room for the head.
- `choose_read_path` / `split_blocks` / `assign_paths`: the read side of each (PE, DE) pair,
  and whether to read the hit at all (`RecomputeRule`: load or recompute, per request).
- `rr_*`: the round-robin baseline (engine choice in turn, skipping engines that cannot admit).

Ties break towards the engine (or group) listed first, so every function is deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from dualpath_jax.sched.cost import summed_keys
from dualpath_jax.sched.types import Assignment, EngineLoad, FetchResult, ReadPath, Request

RECOMPUTE_MODES = ("never", "auto", "always")


@dataclasses.dataclass(frozen=True)
class RecomputeRule:
    """Load a request's hit KV, or recompute all or a leading part of it (`scheduler.recompute`).

    `mode`: "never" (always load), "always" (recompute every hit), or "auto": of the choices
    "recompute the first `k` hit blocks, read the other `n - k`" (`k` in `[0, n]`), the one that
    finishes first. Reading takes the reading node's queue ahead plus the blocks read, in tokens,
    over `read_tokens_per_s` (a node's storage NIC; a split read takes its slower side).
    Computing takes `prefill_s(hit, new)` after the reads, plus `prefill_s(0, lead)` for a lead
    (the PE computes it as a forward of its own before the new tokens, the loaded middle joining
    the two); `k == n` is one `prefill_s(0, hit + new)` and reads nothing, so it skips the queue
    too. `prefill_s(cached, new)` is the PE's cost model (`fitted_prefill` of a
    `FittedCostModel`'s coefficients; the simulator passes its own).

    A leading part, not a trailing one: recomputing block `j` costs its tokens' attention over
    the `j` blocks before it, which grows with `j`, while reading any block costs the same, so
    for `0 < k < n` the trade is convex in `k` and the early blocks are the cheap ones to
    recompute. `max_blocks` caps the lead ("always" recomputes exactly that many, or the whole
    hit when it is shorter). Without a read rate or a cost model "auto" loads.
    """

    mode: str = "never"
    read_tokens_per_s: float = 0.0
    prefill_s: Callable[[int, int], float] | None = None
    max_blocks: int = 0  # at most this many leading blocks are recomputed (0: no limit)

    def __post_init__(self) -> None:
        if self.mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {self.mode!r}")
        if self.max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {self.max_blocks}")

    def recompute(self, hit: int, new: int, read_tokens: int) -> bool:
        """Whether recomputing all `hit` tokens beats reading all of them (`read_tokens`: the
        reading node's queue ahead plus this hit; the slower side's for a split read)."""
        if self.mode != "auto":
            return self.mode == "always"
        if self.read_tokens_per_s <= 0 or self.prefill_s is None:
            return False
        load = read_tokens / self.read_tokens_per_s + self.prefill_s(hit, new)
        return self.prefill_s(0, hit + new) < load

    def lead_blocks(
        self,
        hit: int,
        new: int,
        blocks: int,
        block_tokens: int,
        read_tokens: Callable[[int], float],
    ) -> int:
        """How many leading blocks of a hit of `blocks` blocks (`hit` tokens) to recompute: 0
        loads it all, `blocks` recomputes it all. `read_tokens(m)`: what reading the hit's last
        `m` blocks waits for, in tokens (the reading node's queue ahead plus those blocks; the
        slower side's for a split read)."""
        cap = min(blocks, self.max_blocks) if self.max_blocks else blocks
        if self.mode != "auto" or cap <= 0:
            return cap if self.mode == "always" else 0
        cost, rate = self.prefill_s, self.read_tokens_per_s
        if rate <= 0 or cost is None:
            return 0
        after = cost(hit, new)

        def total(k: int) -> float:
            lead = cost(0, min(hit, k * block_tokens)) if k else 0.0
            return read_tokens(blocks - k) / rate + lead + after

        # The best lead in [1, min(cap, blocks - 1)]: the first whose next block does not gain
        # (`total` is convex there).
        lo, hi = 1, min(cap, blocks - 1)
        while lo < hi:
            mid = (lo + hi) // 2
            if total(mid + 1) < total(mid):
                lo = mid + 1
            else:
                hi = mid
        best, t = 0, total(0)
        if hi >= 1 and total(lo) < t:
            best, t = lo, total(lo)
        return blocks if cap == blocks and cost(0, hit + new) < t else best


def fitted_prefill(p0: float, p1: float, p2: float) -> Callable[[int, int], float]:
    """`prefill_s(cached, new)` of a fitted cost model: `p0 + p1 * new + p2 * pairs`."""
    return lambda cached, new: p0 + p1 * new + p2 * summed_keys(cached, new)


def _updated(loads: Sequence[EngineLoad], seq: list[int], tok: list[int], hbm: list[int] | None):
    out = []
    for i, x in enumerate(loads):
        free = x.free_hbm_tokens if hbm is None else hbm[i]
        if seq[i] != x.seq_e or tok[i] != x.tok_e or free != x.free_hbm_tokens:
            x = EngineLoad(x.engine, x.node, x.group, seq[i], tok[i], x.read_q, free)
        out.append(x)
    return tuple(out)


# --------------------------------------------------------------------------- PE (Algorithm 1)


def pe_class(load: EngineLoad, alpha: float, beta: float) -> int:
    """1: overloaded (`tok_e > beta`); 2: short read queue (`read_q <= alpha`); 3: long."""
    if load.tok_e > beta:
        return 1
    return 2 if load.read_q <= alpha else 3


def pe_fetch(
    queue: Iterable[Request], pes: Sequence[EngineLoad], *, alpha: float, beta: float
) -> FetchResult:
    """Algorithm 1 for one PE group fetch.

    `queue`: the waiting queue from its head (only the consumed head is iterated); `pes`: the
    group's loads. Returns the assigned head of the queue with each request's PE and the loads
    with `seq_e`/`tok_e` updated.
    """
    n = len(pes)
    tok = [x.tok_e for x in pes]
    seq = [x.seq_e for x in pes]
    short = [x.read_q <= alpha for x in pes]
    assigned: list[tuple[Request, int]] = []
    for r in queue:
        best = -1
        best_short = False
        best_tok = 0
        for i in range(n):
            t = tok[i]
            if t > beta:  # C1
                continue
            s = short[i]
            if best < 0 or (s and not best_short) or (s == best_short and t < best_tok):
                best, best_short, best_tok = i, s, t
        if best < 0:  # C2 and C3 empty: terminate the fetch
            break
        assigned.append((r, pes[best].engine))
        tok[best] += r.tokens
        seq[best] += 1
    return FetchResult(tuple(assigned), _updated(pes, seq, tok, None))


# --------------------------------------------------------------------------- DE phase 1 and 2


class GroupTotals:
    """DE phase 1's totals, group -> tokens, read like a mapping, that also give the group with
    the least total in O(log groups) (`least`): past `SCAN_GROUPS` groups every change pushes
    `(total, group)` on a heap whose stale entries are dropped when they reach its top (up to
    that, a scan is cheaper). `GlobalScheduler` keeps its totals in one; `de_routes` routes over
    it exactly as over a dict of the same totals."""

    SCAN_GROUPS = 16

    def __init__(self, totals: Mapping[int, int] | None = None) -> None:
        self._tok: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []
        self._heaped = False  # the heap is kept (more than SCAN_GROUPS groups were held)
        for g, t in (totals or {}).items():
            self[g] = t

    def __getitem__(self, group: int) -> int:
        return self._tok[group]

    def __setitem__(self, group: int, total: int) -> None:
        tok = self._tok
        tok[group] = total
        if self._heaped:
            heapq.heappush(self._heap, (total, group))
            if len(self._heap) > 4 * len(tok) + 64:  # mostly stale: start over
                self._rebuild()
        elif len(tok) > self.SCAN_GROUPS:
            self._heaped = True
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(t, g) for g, t in self._tok.items()]
        heapq.heapify(self._heap)

    def __delitem__(self, group: int) -> None:
        del self._tok[group]

    def __contains__(self, group: object) -> bool:
        return group in self._tok

    def __iter__(self) -> Iterator[int]:
        return iter(self._tok)

    def __len__(self) -> int:
        return len(self._tok)

    def __repr__(self) -> str:
        return f"GroupTotals({self._tok!r})"

    def keys(self) -> Iterable[int]:
        return self._tok.keys()

    def items(self) -> Iterable[tuple[int, int]]:
        return self._tok.items()

    def total(self, group: int) -> int:
        """The group's total, 0 for a group not held."""
        return self._tok.get(group, 0)

    def least(self) -> int:
        """The group with the least total, ties to the smallest group id (as `de_routes`)."""
        heap, tok = self._heap, self._tok
        if not tok:
            raise ValueError("de_route needs at least one DE group")
        if not self._heaped:
            return _least_group(tok.items())
        while True:
            t, g = heap[0]
            if g in tok and tok[g] == t:
                return g
            heapq.heappop(heap)


def _least_group(totals: Iterable[tuple[int, int]]) -> int:
    """The group of the least `(total, group)`: the least total, ties to the smallest id."""
    best, least = -1, 0
    for g, t in totals:
        if best < 0 or t < least or (t == least and g < best):
            best, least = g, t
    return best


def de_route(
    queue: Iterable[Request], group_tok: Mapping[int, int] | GroupTotals
) -> tuple[tuple[tuple[Request, int], ...], dict[int, int]]:
    """DE phase 1: every queued request to the group with the least total `tok`.

    `group_tok`: group id -> total tokens of the group (its engines' `tok_e` plus its private
    queue). Returns `(request, group)` in queue order and the updated totals.
    """
    routes = de_routes(queue, group_tok)
    out = dict(group_tok.items())
    for r, g in routes:
        out[g] += r.tokens
    return routes, out


def de_routes(
    queue: Iterable[Request], group_tok: Mapping[int, int] | GroupTotals
) -> tuple[tuple[Request, int], ...]:
    """`de_route`'s routes alone (a caller that keeps its own totals)."""
    if not len(group_tok):
        raise ValueError("de_route needs at least one DE group")
    queue = list(queue)
    if len(queue) == 1 and isinstance(group_tok, GroupTotals):  # the router's common case
        return ((queue[0], group_tok.least()),)
    if len(queue) == 1:  # one pass
        return ((queue[0], _least_group(group_tok.items())),)
    groups = sorted(group_tok)
    tot = [group_tok[g] for g in groups]
    routes: list[tuple[Request, int]] = []
    # A heap of (total, position): the least total, ties to the group listed first, as min().
    heap = [(t, i) for i, t in enumerate(tot)]
    heapq.heapify(heap)
    for r in queue:
        t, best = heap[0]
        routes.append((r, groups[best]))
        tot[best] = t + r.tokens
        heapq.heapreplace(heap, (tot[best], best))
    return tuple(routes)


def feasible_head(queue: Iterable[Request], free_hbm_total: int) -> list[Request]:
    """R: the longest head of the queue whose HBM needs fit in the group's total free HBM."""
    out: list[Request] = []
    used = 0
    for r in queue:
        used += r.hbm_tokens
        if used > free_hbm_total:
            break
        out.append(r)
    return out


def z_threshold(head: Sequence[Request], des: Sequence[EngineLoad], z_factor: float) -> float:
    """`Z = z_factor * (sum_{r in R} len_r + sum_e tok_e) / |E|`."""
    if not des:
        raise ValueError("Z is undefined for an empty DE group")
    return z_factor * (sum(r.tokens for r in head) + sum(x.tok_e for x in des)) / len(des)


def de_fetch(
    queue: Iterable[Request], des: Sequence[EngineLoad], *, z_factor: float, max_seqs: int = 0
) -> FetchResult:
    """DE phase 2 for one group: assign the head of its private queue to DEs, FIFO.

    `max_seqs` > 0 caps each DE's `seq_e` (a real engine's slots plus its bounded queue; the
    paper bounds DEs by HBM alone, which is `max_seqs=0`). Returns the assigned head
    (`(request, DE)`), the loads with `seq_e`, `tok_e` and `free_hbm_tokens` updated, and Z in
    `FetchResult.z`.
    """
    n = len(des)
    if n == 0:
        return FetchResult((), (), z=0.0)
    head = feasible_head(queue, sum(max(0, x.free_hbm_tokens) for x in des))
    z = z_threshold(head, des, z_factor)
    tok = [x.tok_e for x in des]
    seq = [x.seq_e for x in des]
    hbm = [x.free_hbm_tokens for x in des]
    assigned: list[tuple[Request, int]] = []
    for r in head:
        need, length = r.hbm_tokens, r.tokens
        low = high = -1
        for i in range(n):
            if hbm[i] < need or (max_seqs > 0 and seq[i] >= max_seqs):
                continue
            if tok[i] + length <= z:
                if low < 0 or seq[i] < seq[low] or (seq[i] == seq[low] and tok[i] < tok[low]):
                    low = i
            elif high < 0 or tok[i] < tok[high]:
                high = i
        best = low if low >= 0 else high
        if best < 0:  # no DE has room for the head: the fetch ends
            break
        assigned.append((r, des[best].engine))
        tok[best] += length
        seq[best] += 1
        hbm[best] -= need
    return FetchResult(tuple(assigned), _updated(des, seq, tok, hbm), z=z)


# --------------------------------------------------------------------------- read path


def choose_read_path(pe_read_q: float, de_read_q: float) -> ReadPath:
    """The side whose node has the shorter read queue; a tie reads on the PE side."""
    return ReadPath.PE if pe_read_q <= de_read_q else ReadPath.DE


def split_blocks(
    n_blocks: int,
    pe_read_q: float,
    de_read_q: float,
    *,
    block_tokens: int,
    pe_read_rate: float = 1.0,
    de_read_rate: float = 1.0,
) -> tuple[int, int]:
    """Divides `n_blocks` hit blocks so both read queues drain at the same time.

    With `x` blocks on the PE side: `(q_pe + x*bt)/r_pe == (q_de + (n-x)*bt)/r_de`, solved for x,
    rounded to whole blocks and clamped to `[0, n]`. Returns `(pe_blocks, de_blocks)`.
    """
    if n_blocks <= 0:
        return 0, 0
    if pe_read_rate <= 0 or de_read_rate <= 0:
        raise ValueError("read rates must be positive")
    x = (pe_read_rate * (de_read_q + n_blocks * block_tokens) - de_read_rate * pe_read_q) / (
        block_tokens * (pe_read_rate + de_read_rate)
    )
    pe_blocks = min(n_blocks, max(0, int(x + 0.5)))
    return pe_blocks, n_blocks - pe_blocks


def _split_tokens(r: Request, pe_blocks: int, block_tokens: int, lead: int = 0) -> tuple[int, int]:
    """The hit tokens each side reads: the PE side the first `pe_blocks` after `lead`
    recomputed blocks, the DE side the rest."""
    read = r.cached_tokens - lead * block_tokens
    pe_tok = min(read, pe_blocks * block_tokens)
    return pe_tok, read - pe_tok


def _split(n, qp, qd, block_tokens, pe_read_rate, de_read_rate) -> tuple[int, int]:
    return split_blocks(
        n, qp, qd, block_tokens=block_tokens, pe_read_rate=pe_read_rate, de_read_rate=de_read_rate
    )


def _read_tokens(
    r: Request,
    n: int,
    side: str,
    qp: int,
    qd: int,
    block_tokens: int,
    pe_read_rate: float,
    de_read_rate: float,
    m: int,
) -> float:
    """What reading the last `m` of a request's `n` hit blocks waits for, in tokens: the reading
    node's queue ahead plus the blocks (a split read: its slower side, split as `split_blocks`
    would)."""
    if m <= 0:
        return 0.0
    tok = r.cached_tokens - (n - m) * block_tokens
    if side == "pe":
        return qp + tok
    if side == "de":
        return qd + tok
    pb, db = _split(m, qp, qd, block_tokens, pe_read_rate, de_read_rate)
    pt = min(tok, pb * block_tokens)
    return max(qp + pt if pb else 0, qd + tok - pt if db else 0)


def assign_paths(
    pairs: Iterable[tuple[Request, int, int]],
    pe_node: Mapping[int, int],
    de_node: Mapping[int, int],
    read_q: Mapping[int, int],
    *,
    mode: str,
    block_tokens: int,
    pe_read_rate: float = 1.0,
    de_read_rate: float = 1.0,
    turns: Mapping[int, int] | None = None,
    recompute: RecomputeRule | None = None,
    held: Mapping[str, tuple[int, int, ReadPath]] | None = None,
) -> tuple[tuple[Assignment, ...], dict[int, int]]:
    """Chooses the read side of each `(request, PE, DE)` in order, then how much of the hit to
    recompute rather than read (`recompute`: `recompute_blocks` leading blocks are computed and
    the rest is read on the side chosen, re-split for "split"; a wholly recomputed hit reads
    nothing: `ReadPath.NONE`).

    `mode`: "shorter" (the paper), "pe" (always the PE side), "alternate" (round robin, one turn
    per DE so the sides do not move in lockstep with a round-robin DE choice: a request with hits
    reads on the PE side when its DE's turn count, `turns[de]` plus the earlier requests of this
    call with that DE, is even, else on the DE side; the caller keeps `turns`), "split", or
    "none" (Oracle).
    `read_q`: node -> read queue in tokens; each decision adds the request's hit tokens to the
    queue of the node that reads them, so later requests see it. Returns the assignments and the
    updated queues.
    `held`: trajectory -> `(node, blocks, side)` of its hit already in a node's memory (a
    tool-gap prefetch on the DE or the PE side). A request whose engine of that side is on that
    node reads its whole hit on that side, the first `blocks` of it from memory (`held_blocks`;
    only the rest joins the read queue), and recomputes none of it. A DE-side hold counts under
    every mode that reads on the DE side (not "pe"), a PE-side one under every mode that reads.
    """
    if mode not in ("shorter", "pe", "alternate", "split", "none"):
        raise ValueError(f"unknown read path mode {mode!r}")
    q = dict(read_q)
    taken: dict[int, int] = {}  # "alternate": turns taken per DE in this call
    out: list[Assignment] = []
    for r, pe, de in pairs:
        n = r.cached_blocks(block_tokens)
        pn, dn = pe_node[pe], de_node[de]
        if n == 0 or mode == "none":
            out.append(Assignment(r, pe, de, ReadPath.NONE))
            continue
        qp, qd = q.get(pn, 0), q.get(dn, 0)
        h = held.get(r.trajectory) if held else None
        if h is not None and h[1] > 0:
            hb = min(h[1], n)
            rest = max(0, r.cached_tokens - hb * block_tokens)
            if h[2] is ReadPath.PE and h[0] == pn:
                q[pn] = qp + rest
                out.append(Assignment(r, pe, de, ReadPath.PE, n, 0, held_blocks=hb))
                continue
            if h[2] is ReadPath.DE and h[0] == dn and mode != "pe":
                q[dn] = qd + rest
                out.append(Assignment(r, pe, de, ReadPath.DE, 0, n, held_blocks=hb))
                continue
        if mode == "pe":
            pb, db = n, 0
        elif mode == "alternate":
            turn = (turns or {}).get(de, 0) + taken.get(de, 0)
            taken[de] = taken.get(de, 0) + 1
            pb, db = (n, 0) if turn % 2 == 0 else (0, n)
        elif mode == "shorter":
            pb, db = (n, 0) if choose_read_path(qp, qd) is ReadPath.PE else (0, n)
        else:
            pb, db = split_blocks(
                n,
                qp,
                qd,
                block_tokens=block_tokens,
                pe_read_rate=pe_read_rate,
                de_read_rate=de_read_rate,
            )
        k = 0
        if recompute is not None:
            side = "split" if mode == "split" else "pe" if db == 0 else "de"
            read = functools.partial(
                _read_tokens, r, n, side, qp, qd, block_tokens, pe_read_rate, de_read_rate
            )
            k = recompute.lead_blocks(r.cached_tokens, r.new_tokens, n, block_tokens, read)
            if k >= n:  # recompute it all: nothing is read
                out.append(Assignment(r, pe, de, ReadPath.NONE, recompute_blocks=n))
                continue
            if k and mode == "split":
                pb, db = _split(n - k, qp, qd, block_tokens, pe_read_rate, de_read_rate)
            elif k:
                pb, db = (n - k, 0) if db == 0 else (0, n - k)
        path = ReadPath.PE if db == 0 else ReadPath.DE if pb == 0 else ReadPath.SPLIT
        pt, dt = _split_tokens(r, pb, block_tokens, k)
        q[pn] = qp + pt
        q[dn] = q.get(dn, 0) + dt
        out.append(Assignment(r, pe, de, path, pb, db, recompute_blocks=k))
    return tuple(out), q


# --------------------------------------------------------------------------- round robin


def rr_pe_fetch(
    queue: Iterable[Request], pes: Sequence[EngineLoad], *, beta: float, cursor: int = 0
) -> FetchResult:
    """Round robin over the group's PEs, skipping overloaded ones (`tok_e > beta`); FIFO."""
    n = len(pes)
    tok = [x.tok_e for x in pes]
    seq = [x.seq_e for x in pes]
    assigned: list[tuple[Request, int]] = []
    if n:
        for r in queue:
            for k in range(n):
                i = (cursor + k) % n
                if tok[i] <= beta:
                    break
            else:
                break
            assigned.append((r, pes[i].engine))
            tok[i] += r.tokens
            seq[i] += 1
            cursor = (i + 1) % n
    return FetchResult(tuple(assigned), _updated(pes, seq, tok, None), cursor=cursor)


def rr_de_route(
    queue: Iterable[Request], groups: Sequence[int], *, cursor: int = 0
) -> tuple[tuple[tuple[Request, int], ...], int]:
    """Round robin of the DE global queue over the groups. Returns routes and the next cursor."""
    if not groups:
        raise ValueError("rr_de_route needs at least one DE group")
    routes = []
    for r in queue:
        routes.append((r, groups[cursor % len(groups)]))
        cursor = (cursor + 1) % len(groups)
    return tuple(routes), cursor


def rr_de_fetch(
    queue: Iterable[Request], des: Sequence[EngineLoad], *, cursor: int = 0, max_seqs: int = 0
) -> FetchResult:
    """Round robin over the group's DEs that have room for the head (HBM, and `seq_e` below
    `max_seqs` when that is > 0); stops when none has."""
    n = len(des)
    tok = [x.tok_e for x in des]
    seq = [x.seq_e for x in des]
    hbm = [x.free_hbm_tokens for x in des]
    assigned: list[tuple[Request, int]] = []
    if n:
        for r in queue:
            need = r.hbm_tokens
            for k in range(n):
                i = (cursor + k) % n
                if hbm[i] >= need and not (max_seqs > 0 and seq[i] >= max_seqs):
                    break
            else:
                break
            assigned.append((r, des[i].engine))
            tok[i] += r.tokens
            seq[i] += 1
            hbm[i] -= need
            cursor = (i + 1) % n
    return FetchResult(tuple(assigned), _updated(des, seq, tok, hbm), cursor=cursor)
