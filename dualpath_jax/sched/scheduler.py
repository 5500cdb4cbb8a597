"""`GlobalScheduler`: the thin stateful shell around the inter-engine cores.

The router and the simulator both own one. It holds the queues and the last load report of every
engine; every decision is delegated to an `InterEnginePolicy` (pure functions).

Request flow (pull based, leaders fetch for their groups):

1. `submit(r)`: `r` enters the DE global queue.
2. `fetch_de(group, loads)`: DE phase 1 drains the global queue into the groups' private queues;
   phase 2 gives the head of this group's private queue to its DEs (by free HBM). Each request so
   placed waits, with its DE, in the PE waiting queue (FIFO in the order DEs took them).
3. `fetch_pe(group, loads)`: Algorithm 1 gives the head of the PE waiting queue to this group's
   PEs; with both ends known, the read side is chosen by the nodes' read queues. Returns the
   finished `Assignment`s. (A turn whose hit a tool-gap prefetch holds in a PE node's memory
   waits in that node's own queue instead, which its PEs take first: `sched.prefetch`.)

The DE is chosen first because it must reserve HBM for the whole request before any KV moves,
and once the PE is known the request can start at once (both read paths need both ends).

Read queues: a load report sets its node's `read_q`; each read decision then adds the hit
tokens to the reading node's queue until that node reports again, so one fetch does not send
every request to the same side. A report the scheduler already holds (the same object given
again) changes nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Sequence

from dualpath_jax._compiled import mypyc_attr
from dualpath_jax.config import Policy, SchedulerConfig
from dualpath_jax.sched.errors import QueueFull
from dualpath_jax.sched.inter import GroupTotals, RecomputeRule, fitted_prefill
from dualpath_jax.sched.policy import InterEnginePolicy, make_policy
from dualpath_jax.sched.prefetch import honor_affinity, pe_pin_wins
from dualpath_jax.sched.types import Assignment, ClusterView, EngineLoad, ReadPath, Request


@mypyc_attr(allow_interpreted_subclasses=True)  # tests and users subclass it
class GlobalScheduler:
    """Queues + last-known loads + an `InterEnginePolicy`. Not thread safe (one router loop)."""

    def __init__(
        self,
        policy: Policy | InterEnginePolicy,
        *,
        alpha: float = math.inf,
        beta: float = math.inf,
        z_factor: float = 1.05,
        block_tokens: int = 64,
        pe_read_rate: float = 1.0,
        de_read_rate: float = 1.0,
        max_queue: int = 100_000,
        de_max_seqs: int = 0,
        recompute: RecomputeRule | None = None,
    ) -> None:
        self.policy = policy if isinstance(policy, InterEnginePolicy) else make_policy(policy)
        self.alpha = alpha
        self.beta = beta
        self.z_factor = z_factor
        self.block_tokens = block_tokens
        self.pe_read_rate = pe_read_rate
        self.de_read_rate = de_read_rate
        self.max_queue = max_queue
        self.de_max_seqs = de_max_seqs  # > 0: no DE holds more requests (see inter.de_fetch)
        # Load or recompute each hit (None: always load). The router replaces it as PEs report
        # their cost models (`set_prefill_cost`).
        self.recompute = recompute
        self._de_global: collections.deque[Request] = collections.deque()
        self._de_private: dict[int, collections.deque[Request]] = {}
        self._n_private = 0  # requests in all private queues (len() stays O(1) at 1,000 groups)
        self._private_tok: dict[int, int] = {}
        self._pe_wait: collections.deque[tuple[Request, int]] = collections.deque()
        self._pe: dict[int, EngineLoad] = {}
        self._de: dict[int, EngineLoad] = {}
        # group -> its DEs' `tok_e` plus its private queue's tokens (DE phase 1's totals)
        self._group_tok = GroupTotals()
        self._read_q: dict[int, int] = {}
        self._cursor: dict[tuple[str, int], int] = {}
        self._path_turns: dict[int, int] = {}  # DE -> read-side turns taken (round robin)
        # Tool-gap prefetch (`sched.prefetch`): trajectory -> (DE group or -1, node, blocks
        # held, on the PE side), and the slack of `honor_affinity`. Empty unless a prefetcher
        # holds something. PE node -> the turns pinned to it (with their DEs), waiting for its PEs.
        self._held: dict[str, tuple[int, int, int, bool]] = {}
        self._pe_pinned: dict[int, collections.deque[tuple[Request, int]]] = {}
        self._n_pinned = 0
        self.affinity_slack = 0.5

    @classmethod
    def from_config(
        cls,
        cfg: SchedulerConfig,
        *,
        alpha: float,
        beta: float,
        block_tokens: int = 64,
        pe_read_rate: float = 1.0,
        de_read_rate: float = 1.0,
        de_max_seqs: int = 0,
        read_tokens_per_s: float = 0.0,
        prefill_s: Callable[[int, int], float] | None = None,
    ) -> GlobalScheduler:
        """`alpha`/`beta` already resolved (see `sched.cost.derive_alpha_beta`);
        `read_tokens_per_s` (a node's storage NIC in hit tokens per second) and `prefill_s`
        (the PEs' prefill time of `(cached, new)` tokens) feed `scheduler.recompute`."""
        rule = RecomputeRule(cfg.recompute, read_tokens_per_s, prefill_s, cfg.recompute_max_blocks)
        return cls(
            cfg.policy,
            alpha=alpha,
            beta=beta,
            z_factor=cfg.z_factor,
            block_tokens=block_tokens,
            max_queue=cfg.max_queue,
            pe_read_rate=pe_read_rate,
            de_read_rate=de_read_rate,
            de_max_seqs=de_max_seqs,
            recompute=None if cfg.recompute == "never" else rule,
        )

    def set_prefill_cost(self, prefill: tuple[float, float, float]) -> None:
        """The PEs' fitted prefill cost model changed (a PE registered or died): recompute
        decisions use `p0, p1, p2` from now on."""
        if self.recompute is not None:
            self.recompute = dataclasses.replace(self.recompute, prefill_s=fitted_prefill(*prefill))

    def set_read_rate(self, tokens_per_s: float) -> None:
        """A node's storage reads carry `tokens_per_s` hit tokens per second (the router's
        measure, where the storage NIC is not emulated): recompute decisions price reads by it
        from now on."""
        if self.recompute is not None:
            self.recompute = dataclasses.replace(self.recompute, read_tokens_per_s=tokens_per_s)

    # ------------------------------------------------------------------ queues

    def __len__(self) -> int:
        """Requests not yet fully assigned (global + private + PE waiting queues)."""
        return len(self._de_global) + self._n_private + len(self._pe_wait) + self._n_pinned

    def submit(self, request: Request) -> None:
        """Adds a new request at the tail of the DE global queue."""
        if len(self) >= self.max_queue:
            raise QueueFull(f"{len(self)} requests queued (max_queue={self.max_queue})")
        self._de_global.append(request)

    def requeue(self, requests: Iterable[Request]) -> None:
        """Puts requests back at the head of the DE global queue, in the given order (used when
        an engine died before finishing them). Never refused."""
        self._de_global.extendleft(reversed(list(requests)))

    def queued_requests(self) -> list[Request]:
        """Every request not yet fully assigned, in no particular order."""
        out = list(self._de_global)
        for q in self._de_private.values():
            out.extend(q)
        out.extend(r for r, _ in self._pe_wait)
        for pq in self._pe_pinned.values():
            out.extend(r for r, _ in pq)
        return out

    def withdraw(self, request_ids: Iterable[str]) -> list[Request]:
        """Removes queued requests (cancelled, or failed before assignment) from every queue;
        returns those found. Requests already assigned are not here (the caller owns them)."""
        ids = set(request_ids)
        out: list[Request] = []
        if not ids:
            return out
        keep: collections.deque[Request] = collections.deque()
        for r in self._de_global:
            (out if r.id in ids else keep).append(r)
        self._de_global = keep
        for g, q in self._de_private.items():
            gone = [r for r in q if r.id in ids]
            if not gone:
                continue
            self._de_private[g] = collections.deque(r for r in q if r.id not in ids)
            tok = sum(r.tokens for r in gone)
            self._n_private -= len(gone)
            self._private_tok[g] -= tok
            self._group_tok[g] -= tok
            out.extend(gone)
        if any(r.id in ids for r, _ in self._pe_wait):
            out.extend(r for r, _ in self._pe_wait if r.id in ids)
            self._pe_wait = collections.deque((r, de) for r, de in self._pe_wait if r.id not in ids)
        for node, pq in self._pe_pinned.items():
            if any(r.id in ids for r, _ in pq):
                out.extend(r for r, _ in pq if r.id in ids)
                self._pe_pinned[node] = collections.deque(
                    (r, de) for r, de in pq if r.id not in ids
                )
                self._n_pinned -= len(pq) - len(self._pe_pinned[node])
        return out

    def de_global_queued(self) -> int:
        """Requests in the DE global queue (the next `fetch_de`, of any group, routes them)."""
        return len(self._de_global)

    def de_queued(self, group: int) -> int:
        """Requests a `fetch_de(group)` could act on now (global queue + the group's private
        queue); a caller may skip a fetch that finds none (it would only record loads)."""
        q = self._de_private.get(group)
        return len(self._de_global) + (len(q) if q else 0)

    def fetch_de_would_place(self, group: int, loads: Sequence[EngineLoad]) -> bool:
        """False when `fetch_de(group, loads)` would route and place nothing: the global queue is
        empty and no DE in `loads` has room (`free_hbm_tokens`) for the head of the group's
        private queue (both phase-2 fetches stop at a head no DE can hold). A caller whose
        `loads` are already reported may skip such a fetch: it would only record them."""
        if self._de_global:
            return True
        q = self._de_private.get(group)
        if not q:
            return False
        need = q[0].hbm_tokens
        return any(x.free_hbm_tokens >= need for x in loads)

    def de_groups_queued(self) -> list[int]:
        """DE groups whose private queue holds requests, in the order groups were first seen."""
        return [g for g, q in self._de_private.items() if q]

    def pe_queued(self) -> int:
        """Requests waiting for a PE (a `fetch_pe` finding none only records loads)."""
        return len(self._pe_wait) + self._n_pinned

    def pe_takeable(self, nodes: Iterable[int]) -> int:
        """Requests a `fetch_pe` by PEs on `nodes` could take: the shared PE waiting queue and
        the turns pinned to those nodes (a fetch finding none only records loads)."""
        n = len(self._pe_wait)
        if self._n_pinned:
            for node in nodes:
                pq = self._pe_pinned.get(node)
                if pq:
                    n += len(pq)
        return n

    def queued(self) -> dict[str, int]:
        return {
            "de_global": len(self._de_global),
            "de_private": sum(len(q) for q in self._de_private.values()),
            "pe_waiting": len(self._pe_wait),
            "pe_pinned": self._n_pinned,
        }

    # ------------------------------------------------------------------ loads

    def report(self, loads: Iterable[EngineLoad], role: str) -> None:
        """Records load reports ("pe" or "de") without fetching."""
        if role not in ("pe", "de"):
            raise ValueError(f"role must be 'pe' or 'de', got {role!r}")
        table = self._pe if role == "pe" else self._de
        for x in loads:
            # The same report again (a caller that keeps loads): nothing new, and its read queue
            # is no newer than the estimate read decisions have raised since.
            if table.get(x.engine) is x:
                continue
            self._read_q[x.node] = x.read_q
            if role == "de":
                self._set_de(x)
                if x.group not in self._private_tok:  # a group first seen
                    self._de_private.setdefault(x.group, collections.deque())
                    self._private_tok[x.group] = 0
            else:
                table[x.engine] = x

    def remove_engines(self, engines: Iterable[int]) -> list[Request]:
        """Forgets dead engines. Requests waiting for a PE with a dead DE, and the private queue
        of a DE group left with no engine, go back to the head of the global queue; they are
        also returned. Requests already assigned are the caller's to `requeue`."""
        dead = set(engines)
        for e in dead:
            self._pe.pop(e, None)
            x = self._de.pop(e, None)
            if x is not None:
                self._group_tok[x.group] -= x.tok_e
        back = [r for r, de in self._pe_wait if de in dead]
        self._pe_wait = collections.deque((r, de) for r, de in self._pe_wait if de not in dead)
        if self._pe_pinned:  # a dead DE's turns go back; a node left with no PE unpins its own
            pe_nodes = {x.node for x in self._pe.values()}
            unpinned: list[tuple[Request, int]] = []
            for node in list(self._pe_pinned):
                pq = self._pe_pinned[node]
                back.extend(r for r, de in pq if de in dead)
                keep = [(r, de) for r, de in pq if de not in dead]
                if node in pe_nodes:
                    self._pe_pinned[node] = collections.deque(keep)
                else:
                    del self._pe_pinned[node]
                    unpinned.extend(keep)
                self._n_pinned -= len(pq) - (len(keep) if node in pe_nodes else 0)
            self._pe_wait.extendleft(reversed(unpinned))
        live_groups = {x.group for x in self._de.values()}
        for g in [g for g in self._group_tok if g not in live_groups]:
            del self._group_tok[g]
        for g in [g for g in self._de_private if g not in live_groups]:
            q = self._de_private.pop(g)
            self._n_private -= len(q)
            back.extend(q)
            self._private_tok.pop(g, None)
        self.requeue(back)
        return back

    def view(self) -> ClusterView:
        """A frozen snapshot of the last-known loads (read queues as currently estimated)."""

        def patched(x: EngineLoad) -> EngineLoad:
            q = self._read_q.get(x.node, x.read_q)
            return x if q == x.read_q else _with_read_q(x, q)

        return ClusterView(
            pe=tuple(patched(x) for x in self._pe.values()),
            de=tuple(patched(x) for x in self._de.values()),
            alpha=self.alpha,
            beta=self.beta,
            z_factor=self.z_factor,
            pe_read_rate=self.pe_read_rate,
            de_read_rate=self.de_read_rate,
        )

    # ------------------------------------------------------------------ fetches

    def fetch_de(self, group: int, loads: Sequence[EngineLoad]) -> tuple[tuple[Request, int], ...]:
        """A DE group leader fetches: phase 1 over all known groups, then phase 2 in `group`.

        `loads`: the group's fresh reports. Returns `(request, DE engine)` for the requests this
        group took; they now wait for a PE.
        """
        self.report(loads, "de")
        self.route_de()
        queue = self._de_private.get(group)
        if not queue:
            return ()
        key = ("de", group)
        res = self.policy.de_fetch(
            queue,
            loads,
            z_factor=self.z_factor,
            cursor=self._cursor.get(key, 0),
            max_seqs=self.de_max_seqs,
        )
        self._cursor[key] = res.cursor
        for r, de in res.assigned:
            queue.popleft()
            self._n_private -= 1
            self._private_tok[group] -= r.tokens
            self._group_tok[group] -= r.tokens
            h = self._held.get(r.trajectory) if self._held else None
            if h is not None and h[3] and self._pin_pe(h[1], r, de, h[2]):
                continue
            self._pe_wait.append((r, de))
        for x in res.loads:
            self._set_de(x)
        return res.assigned

    def route_de(self) -> tuple[tuple[Request, int], ...]:
        """DE phase 1 alone (every `fetch_de` starts with it): drains the global queue into the
        private queues of the groups known from DE reports. Returns `(request, group)`. A turn
        whose session holds a prefetch goes to the prefetch's group when `honor_affinity` says so
        (routed first; the others follow the policy)."""
        if not (self._de_global and self._private_tok):
            return ()
        pinned: list[tuple[Request, int]] = []
        if self._held:
            rest: collections.deque[Request] = collections.deque()
            for r in self._de_global:
                h = self._held.get(r.trajectory)
                tot = self._group_tok
                if (
                    h is not None
                    and not h[3]
                    and honor_affinity(h[0], tot, r.tokens, self.affinity_slack)
                ):
                    pinned.append((r, h[0]))
                    self._private_tok[h[0]] += r.tokens
                    self._group_tok[h[0]] += r.tokens
                    self._de_private[h[0]].append(r)
                else:
                    rest.append(r)
            self._de_global = rest
            self._n_private += len(pinned)
            if not rest:
                return tuple(pinned)
        key = ("de_route", 0)
        routes, self._cursor[key] = self.policy.de_route(
            self._de_global, self._group_tok, cursor=self._cursor.get(key, 0)
        )
        self._de_global.clear()
        for r, g in routes:
            self._de_private[g].append(r)
            self._private_tok[g] += r.tokens
            self._group_tok[g] += r.tokens
        self._n_private += len(routes)
        return (*pinned, *routes) if pinned else routes

    # ------------------------------------------------------------------ tool-gap prefetch

    def group_totals(self) -> dict[int, int]:
        """DE group -> its DEs' `tok_e` plus its private queue's tokens (phase 1's totals)."""
        return dict(self._group_tok.items())

    def de_group_nodes(self) -> dict[int, int]:
        """DE group -> the node of its first reported DE."""
        out: dict[int, int] = {}
        for x in self._de.values():
            out.setdefault(x.group, x.node)
        return out

    def pe_node_totals(self) -> dict[int, int]:
        """PE node -> its PEs' `tok_e` plus the tokens of the turns pinned to it, for the nodes
        with a PE that can take a turn (`tok_e <= beta`)."""
        out: dict[int, int] = {}
        open_nodes: set[int] = set()
        for x in self._pe.values():
            out[x.node] = out.get(x.node, 0) + x.tok_e
            if x.tok_e <= self.beta:
                open_nodes.add(x.node)
        for node, pq in self._pe_pinned.items():
            if node in out:
                out[node] += sum(r.tokens for r, _ in pq)
        return {n: t for n, t in out.items() if n in open_nodes}

    def read_queues(self) -> dict[int, int]:
        """Node -> its storage reads queued, in tokens (as read decisions estimate them)."""
        return dict(self._read_q)

    def hold(
        self, trajectory: str, group: int, node: int, blocks: int, side: ReadPath = ReadPath.DE
    ) -> None:
        """`trajectory`'s first `blocks` hit blocks are (being) prefetched into `node`: on the
        DE side (`node` of DE group `group`) its next turn is routed to that group; on the PE
        side (`side=ReadPath.PE`) it is taken by a PE of that node (both when `honor_affinity`
        says so); either way it reads them from memory (`assign_paths`' `held`)."""
        self._held[trajectory] = (group, node, blocks, side is ReadPath.PE)

    def drop(self, trajectory: str) -> None:
        """The prefetch of `trajectory` is gone (consumed, cancelled or evicted). A turn already
        pinned to a PE node stays there."""
        self._held.pop(trajectory, None)

    def _pin_pe(self, node: int, r: Request, de: int, held_blocks: int) -> bool:
        """Pins a turn placed on DE `de` to PE `node` (that node's own queue), which holds its
        first `held_blocks` hit blocks, when the pin lengthens neither its read nor its compute:
        the node's read queue plus the hit it still reads is no longer than the shortest other
        PE node's queue plus the whole hit (`pe_pin_wins`), and `honor_affinity` holds over the
        PE nodes' tokens."""
        totals = self.pe_node_totals()
        if not pe_pin_wins(
            node, totals, self._read_q, r.cached_tokens, held_blocks, self.block_tokens
        ):
            return False
        if not honor_affinity(node, totals, r.tokens, self.affinity_slack):
            return False
        self._pe_pinned.setdefault(node, collections.deque()).append((r, de))
        self._n_pinned += 1
        return True

    def _set_de(self, x: EngineLoad) -> None:
        old = self._de.get(x.engine)
        if old is x:
            return
        self._de[x.engine] = x
        tot = self._group_tok
        if old is not None and old.group == x.group:  # the usual case: one change of the total
            if old.tok_e != x.tok_e:
                tot[x.group] = tot[x.group] - old.tok_e + x.tok_e
            return
        if old is not None:
            tot[old.group] -= old.tok_e
        tot[x.group] = tot.total(x.group) + x.tok_e

    def fetch_pe(self, group: int, loads: Sequence[EngineLoad]) -> tuple[Assignment, ...]:
        """A PE group leader fetches: Algorithm 1 on the PE waiting queue, then the read sides.

        `loads`: the group's fresh reports. The turns pinned to a node of these PEs (a PE-side
        prefetch) go first, Algorithm 1 over that node's PEs alone; then the shared queue.
        Returns the finished assignments, FIFO within each queue.
        """
        self.report(loads, "pe")
        if not (self._pe_wait or self._n_pinned):
            return ()
        pairs: list[tuple[Request, int, int]] = []
        now = list(loads)
        if self._n_pinned:
            for node in dict.fromkeys(x.node for x in loads):
                pq = self._pe_pinned.get(node)
                if not pq:
                    continue
                idx = [i for i, x in enumerate(now) if x.node == node]
                key = ("pe_pinned", node)
                res = self.policy.pe_fetch(
                    map(_first, pq),
                    [now[i] for i in idx],
                    alpha=self.alpha,
                    beta=self.beta,
                    cursor=self._cursor.get(key, 0),
                )
                self._cursor[key] = res.cursor
                for _, pe in res.assigned:
                    r, de = pq.popleft()
                    pairs.append((r, pe, de))
                self._n_pinned -= len(res.assigned)
                for i, x in zip(idx, res.loads):
                    now[i] = x
        if self._pe_wait:
            key = ("pe", group)
            res = self.policy.pe_fetch(
                map(_first, self._pe_wait),  # lazy: Algorithm 1 reads only the head it takes
                now,
                alpha=self.alpha,
                beta=self.beta,
                cursor=self._cursor.get(key, 0),
            )
            self._cursor[key] = res.cursor
            for _, pe in res.assigned:
                r, de = self._pe_wait.popleft()
                pairs.append((r, pe, de))
            now = list(res.loads)
        if not pairs:
            return ()
        for x in now:
            self._pe[x.engine] = x
        pe_node = {x.engine: x.node for x in loads}
        de_node = {de: self._de[de].node if de in self._de else -1 for _, _, de in pairs}
        held = None
        if self._held:
            held = {
                t: (h[1], h[2], ReadPath.PE if h[3] else ReadPath.DE) for t, h in self._held.items()
            }
        out, self._read_q = self.policy.assign_paths(
            pairs,
            pe_node,
            de_node,
            self._read_q,
            block_tokens=self.block_tokens,
            pe_read_rate=self.pe_read_rate,
            de_read_rate=self.de_read_rate,
            turns=self._path_turns,
            recompute=self.recompute,
            held=held,
        )
        for a in out:  # round robin keeps one PE/DE turn per DE
            if a.pe_read_blocks + a.de_read_blocks > 0:
                self._path_turns[a.de] = self._path_turns.get(a.de, 0) + 1
        return out


_first = operator.itemgetter(0)


def _with_read_q(x: EngineLoad, q: int) -> EngineLoad:
    return EngineLoad(x.engine, x.node, x.group, x.seq_e, x.tok_e, q, x.free_hbm_tokens)
