"""The simulated cluster: P prefill and D decode nodes of `g` engines, driven by the real scheduler.

Mirrors `router/router.py` + the engines on a virtual clock (`sim.core.EventLoop`):

- Router (`sim.router.SimRouter`): a `GlobalScheduler` (with `make_policy` inside) gets every
  new round when it is submitted; group leaders fetch when the real engine loops do
  (`sim.leaders`), with the router's own in-flight loads. The cluster tells it what the real
  engines' messages would (assigned, reads done, first token, done, batch start and end).
- Data paths (paper Fig. 4): each request's copies are those of `transfer.paths.request_steps`
  (the same list the real loader charges: its links per engine pair, `request_path`, resolved
  once per pair, and each request's bytes, `step_bytes`), moved over `sim.network.SimNetwork`
  links arbitrated by the real `LinkArbiter`. Store reads (LOW) fill the PE buffer / DE buffer
  of the engines (host buffers with capacity, reserved FIFO before reading); the hit KV goes to
  the PE device per forward (HIGH); layer blocks go PE device -> DE buffer (HIGH); then DE
  buffer -> DE device (HIGH); when decoding ends the DE persists the request's new Full Blocks
  (LOW, `persist_path`) and only then reports it done, as the real DE does.
- PE: a `PrefillQueue` per engine; a request joins it when its store reads are done; forward
  batches are `next_batch` under the compute quota, timed by `cost.prefill_time(pairs)`.
  Layerwise: the batch's hit loads start with the forward, layer i needs the first (i+1)/L of
  them, so the forward ends at `max(t0 + compute + load/L, t_loaded + compute/L)`. Basic: the
  forward starts once every load of the batch is done. A batch's context must fit the PE's
  HBM for KV (`SimOptions.pe_hbm_tokens`): every layer of it in Basic, one layer when layerwise.
- DE: admission by `admit_decode` (FIFO, HBM tokens and slots) and continuous batched decode
  timed by `cost.decode_step_time(batch, mean context)`, one event per span of steps
  (`sim.decode.DecodeSteps`).
- Oracle: reads, H2D/D2H, PE->DE copies and persistence are bypassed (appendix A.4).

The simulator has no token ids: a round result's `tokens` is `range(gen)` (a length only).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.model.layout import kv_bytes_per_token
from dualpath_jax.results import RoundResult
from dualpath_jax.sched.cost import CostModel, derive_alpha, derive_beta
from dualpath_jax.sched.intra import PendingPrefill, batch_kv_bound
from dualpath_jax.sched.prefetch import PrefetchRule
from dualpath_jax.sched.scheduler import GlobalScheduler
from dualpath_jax.sched.types import Assignment, ReadPath, Request
from dualpath_jax.sim.core import EventLoop
from dualpath_jax.sim.decode import DecodeSteps
from dualpath_jax.sim.network import SimLink, SimNetwork
from dualpath_jax.sim.prefetch import SimPrefetcher
from dualpath_jax.sim.router import SimRouter
from dualpath_jax.sim.state import (
    HostBuffer,
    MemoTerms,
    RoundState,
    SimEngine,
    SimOptions,
)
from dualpath_jax.transfer import paths
from dualpath_jax.transfer.links import LinkKind, TrafficClass, link_rate

# Link kinds that carry one traffic class in the simulated data paths (`transfer.paths`): store
# reads and persistence (LOW) on the storage NICs; layer blocks (HIGH) on the compute NICs and
# H2D; D2H carries the PE's layer blocks (HIGH) or the DE's persistence (LOW). Node DRAM carries
# both.
_ONE_CLASS_LINKS = (
    LinkKind.SNIC_RX,
    LinkKind.SNIC_TX,
    LinkKind.CNIC_RX,
    LinkKind.CNIC_TX,
    LinkKind.H2D,
    LinkKind.D2H,
)

# A request's copies (`transfer.paths.STEP_NAMES`) by position.
_PE_READ, _DE_READ, _PE_LOAD, _DE_LOAD, _SEND, _DE_H2D = range(6)
_CLS = paths.STEP_CLASSES
# `ReadPath.value` by member (the enum's `value` is a property that runs as interpreted code)
_PATH_VALUE = {p: p.value for p in ReadPath}


class SimCluster:
    """Lifecycle: build with a config and a cost model; `submit_round(...)` rounds (their
    `on_done(state)` callback fires when each finishes); `loop.run()`; read `results`,
    `events`, `link_reports()`. One run per instance."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        cost: CostModel,
        *,
        options: SimOptions | None = None,
        loop: EventLoop | None = None,
        scheduler: GlobalScheduler | type[GlobalScheduler] | None = None,
        ref_request: tuple[int, int] = (512, 32),
    ):
        options = options or SimOptions()
        self.cfg, self.cost, self.opt = cfg, cost, options
        self.loop = loop or EventLoop()
        hw, cl = cfg.hardware, cfg.cluster
        self.bt = cfg.store.block_tokens
        self.kvb = kv_bytes_per_token(cfg.model, options.kv_format or hw.kv_format or None)
        self.layers = cfg.model.num_layers
        self.net = SimNetwork(
            self.loop,
            lambda lid: link_rate(hw, lid.kind),
            quantum_s=options.quantum_s,
            high_weight=hw.high_weight,
            low_weight=hw.low_weight,
            window_s=options.window_s,
            fast=options.fast_links,
            fifo=_ONE_CLASS_LINKS,
        )
        self.alpha = derive_alpha(cfg.scheduler, hw, self.kvb)
        self.beta = derive_beta(
            cfg.scheduler,
            cost,
            ref_cached=ref_request[0],
            ref_new=ref_request[1],
            max_batch=cl.prefill_max_batch or 256,
        )
        rate = hw.snic_bytes_per_s or 1.0
        # An instance is used as given; a class (GlobalScheduler or a subclass, e.g. one that
        # records its fetches) is built with the cluster's alpha, beta and read rates.
        if scheduler is None or isinstance(scheduler, type):
            self.scheduler = (scheduler or GlobalScheduler).from_config(
                cfg.scheduler,
                alpha=self.alpha,
                beta=self.beta,
                block_tokens=self.bt,
                pe_read_rate=rate,
                de_read_rate=rate,
                read_tokens_per_s=rate / self.kvb,
                prefill_s=lambda cached, new: cost.prefill_time([(cached, new)]),
            )
        else:
            self.scheduler = scheduler
        self.policy = self.scheduler.policy
        g = hw.engines_per_node
        hw_kv_tokens = int(hw.hbm_bytes // self.kvb) if hw.hbm_bytes > 0 else 0  # 0: not configured
        hbm = options.hbm_tokens or hw_kv_tokens or cl.decode_slots * cl.decode_max_len
        pe_hbm = options.pe_hbm_tokens
        if pe_hbm is None:
            pe_hbm = cl.prefill_max_kv_tokens or hw_kv_tokens
        # The context one PE forward batch may hold (0: unbounded).
        self.pe_kv_tokens = batch_kv_bound(pe_hbm, self.layers, self.policy.layerwise)
        self.pes: list[SimEngine] = []
        self.des: list[SimEngine] = []
        eid = 0
        for n in range(cl.prefill_nodes + cl.decode_nodes):
            role = "prefill" if n < cl.prefill_nodes else "decode"
            group = self.pes if role == "prefill" else self.des
            size = cl.pe_group_size if role == "prefill" else cl.de_group_size
            for _ in range(g):
                e = SimEngine(
                    eid,
                    n,
                    len(group) // max(1, size),
                    role,
                    HostBuffer(hw.dram_buffer_bytes),
                    hbm_tokens=hbm,
                    slots=cl.decode_slots,
                )
                group.append(e)
                eid += 1
        self.engines = {e.id: e for e in (*self.pes, *self.des)}
        self._persist_links: dict[int, tuple[SimLink, ...]] = {}
        # The links of each copy between a PE and a DE (`_links`), by `pe * engines + de`, each
        # resolved on its first bytes; resolved paths interned, so that pairs share one end's.
        self._pair_links: dict[int, list[tuple[SimLink, ...] | None]] = {}
        self._path_links: dict[tuple[SimLink, ...], tuple[SimLink, ...]] = {}
        self.states: dict[str, RoundState] = {}
        self.results: list[RoundResult] = []
        self.events: list[dict] = []  # router-style events (none: the TTFT breakdown is on results)
        self.counters: collections.Counter[str] = collections.Counter()
        interval = options.dispatch_interval_s
        self.fetch_interval_s = cl.fetch_interval_s if interval is None else interval
        self.router = SimRouter(
            self.loop,
            self.scheduler,
            self.pes,
            self.des,
            fetch_interval_s=self.fetch_interval_s,
            leader_phases=options.leader_phases,
            seed=cfg.workload.seed,
            assign=self._assign,
            place=self._place,
            counters=self.counters,
        )
        self.quota_s = cfg.scheduler.compute_quota_ms / 1e3
        self.decode = DecodeSteps(
            self.loop,
            cost,
            self._decoded,
            macro_steps=options.decode_macro_steps,
            leaders=self.router.de_leaders() if options.leader_phases else {},
            fetch_interval_s=self.fetch_interval_s,
        )
        self.router.decode = self.decode
        # The additive form of the cost model's attention time, when it has one (same plans).
        self._terms = MemoTerms(cost) if hasattr(cost, "attention_terms") else None
        # Tool-gap prefetch (`sim.prefetch`), when the config asks for it and the policy reads.
        self.prefetch: SimPrefetcher | None = None
        if cfg.scheduler.prefetch and self.policy.reads:
            if not options.fast_links:
                raise ValueError(
                    "tool-gap prefetch needs SimOptions.fast_links (FIFO storage NICs)"
                )
            rule = PrefetchRule.from_config(cfg.scheduler, g, hw.dram_buffer_bytes)
            self.prefetch = SimPrefetcher(self, rule)

    # ------------------------------------------------------------------ router

    def submit_round(
        self, request: Request, agent: int, on_done: Callable[[RoundState], object]
    ) -> None:
        """A client submits one round now (the router's `on_submit` after the store lookup)."""
        if request.hbm_tokens > self.des[0].hbm_tokens:
            raise ValueError(
                f"request {request.id} needs {request.hbm_tokens} KV tokens; a DE holds "
                f"{self.des[0].hbm_tokens}"
            )
        self.states[request.id] = RoundState(request, agent, self.loop.now, on_done)
        self.router.submit(request)

    def _place(self, r: Request, de: SimEngine) -> None:
        self.states[r.id].de = de

    def _assign(self, a: Assignment) -> None:
        st = self.states[a.request.id]
        pe, de = self.engines[a.pe], self.engines[a.de]
        st.pe, st.de, st.assignment, st.t_assign = pe, de, a, self.loop.now
        r = a.request
        if not self.policy.reads:  # Oracle: nothing is read or copied
            self.router.assigned(a, pe, 0, 0)
            st.t_read = 0.0
            self._ready_to_prefill(st)
            return
        st.read_pe, st.read_de = a.pe_read_blocks * self.bt, a.de_read_blocks * self.bt
        if a.path is ReadPath.PE:  # a tool-gap prefetch's blocks are not read (not queued)
            st.read_pe -= a.held_blocks * self.bt
        else:
            st.read_de -= a.held_blocks * self.bt
        self.router.assigned(a, pe, st.read_pe, st.read_de)
        lead = min(r.cached_tokens, a.recompute_blocks * self.bt)
        hit = min(r.cached_tokens - lead, (a.pe_read_blocks + a.de_read_blocks) * self.bt)
        de_hit = min(hit, a.de_read_blocks * self.bt)
        path = _PATH_VALUE[a.path] if hit else "none"
        if a.recompute_blocks and not hit:  # the PE computes the whole prompt; nothing is read
            st.cached = 0
        elif a.recompute_blocks:  # it computes the lead first, then the new tokens after the hit
            st.lead = lead
        computed = r.prompt_tokens - st.cached + st.lead
        st.nbytes = paths.step_bytes(path, hit * self.kvb, computed * self.kvb, de_hit * self.kvb)
        if self.prefetch is not None:
            self.prefetch.assigned(a)
            if a.held_blocks:  # read during the tool call: in the node's memory already
                side = _PE_READ if a.path is ReadPath.PE else _DE_READ
                held = min(hit - de_hit if side == _PE_READ else de_hit, a.held_blocks * self.bt)
                nb = list(st.nbytes)
                nb[side] -= held * self.kvb
                st.nbytes = tuple(nb)
        key = pe.id * len(self.engines) + de.id
        links = self._pair_links.get(key)
        if links is None:
            links = self._pair_links[key] = [None] * 6
        st.links = links
        st.pe_buf = (hit - de_hit) * self.kvb
        st.de_buf = r.prompt_tokens * self.kvb
        st.waits = 2
        pe.buffer.reserve(st.pe_buf, self._buffer_ready, st)
        de.buffer.reserve(st.de_buf, self._buffer_ready, st)

    def _links(self, st: RoundState, i: int) -> tuple[SimLink, ...]:
        """The links of copy `i` (`STEP_NAMES` order) between `st`'s PE and DE. Resolved when
        the pair first moves bytes on it: a link exists from its first bytes on, as when each
        request resolved its own paths."""
        out = st.links[i]
        if out is None:
            pe, de = st.pe, st.de
            assert pe is not None and de is not None
            path = paths.request_path(
                i, pe=pe.name, de=de.name, pe_node=pe.node_name, de_node=de.node_name
            )
            links = self.net.resolve(path)
            out = st.links[i] = self._path_links.setdefault(links, links)
        return out

    def _buffer_ready(self, st: RoundState) -> None:
        st.waits -= 1
        if st.waits:
            return
        nb = st.nbytes
        st.waits = int(nb[_PE_READ] > 0) + int(nb[_DE_READ] > 0)
        if not st.waits:
            st.t_read = self.loop.now - st.t_assign
            self._ready_to_prefill(st)
            return
        if nb[_PE_READ] > 0:
            links = self._links(st, _PE_READ)
            self.net.send(links, nb[_PE_READ], _CLS[_PE_READ], self._read_done, st, "pe")
        if nb[_DE_READ] > 0:
            links = self._links(st, _DE_READ)
            self.net.send(links, nb[_DE_READ], _CLS[_DE_READ], self._read_done, st, "de")

    def _dequeue_reads(self, st: RoundState, side: str) -> None:
        """The side's storage reads are over: its node's read queue drops them (the real engines
        send `ReadsDone`)."""
        if side == "pe":
            n, st.read_pe, eng = st.read_pe, 0, st.pe
        else:
            n, st.read_de, eng = st.read_de, 0, st.de
        if n:
            assert eng is not None
            self.router.reads_done(eng.node, n)

    def _read_done(self, st: RoundState, side: str) -> None:
        self._dequeue_reads(st, side)
        st.waits -= 1
        if not st.waits:
            st.t_read = self.loop.now - st.t_assign
            self._ready_to_prefill(st)

    # ------------------------------------------------------------------ prefill engine

    def _ready_to_prefill(self, st: RoundState) -> None:
        r = st.request
        pe = st.pe
        assert pe is not None
        new = r.prompt_tokens - st.cached
        if st.lead:
            pe.queue.add(PendingPrefill(r.id, 0, st.lead, st.cached, new))
        else:
            pe.queue.add(PendingPrefill(r.id, st.cached, new))
        if not pe.busy:
            self._run_batch(pe)

    def _run_batch(self, pe: SimEngine) -> None:
        if pe.busy or not len(pe.queue):
            return
        cl = self.cfg.cluster
        plan = pe.queue.next_batch(
            self.cost.attention_time,
            self.quota_s,
            terms=self._terms,
            max_requests=cl.prefill_max_batch,
            max_tokens=cl.prefill_max_tokens,
            max_kv_tokens=self.pe_kv_tokens,
        )
        pe.busy = True
        t0 = self.loop.now
        self.router.batch_started(pe, t0)
        compute = self.cost.prefill_time(plan.pairs)
        loads: list[tuple[tuple[SimLink, ...], int, int]] = []  # the hit loads: links, bytes, step
        batch = [(self.states[c.request_id], c) for c in plan.chunks]
        for st, c in batch:
            nb = st.nbytes
            if not nb:  # Oracle: nothing is copied
                continue
            if not st.loaded:
                st.loaded = True
                if nb[_PE_LOAD] > 0:
                    loads.append((self._links(st, _PE_LOAD), nb[_PE_LOAD], _PE_LOAD))
                if nb[_DE_LOAD] > 0:
                    loads.append((self._links(st, _DE_LOAD), nb[_DE_LOAD], _DE_LOAD))
            total = nb[_SEND]
            if total > 0:  # this chunk's layer blocks (the PE-side hit with the first)
                computed = st.request.prompt_tokens - st.cached + st.lead
                first = total - computed * self.kvb if not st.sent else 0
                n = total - st.sent if plan.finishes(c.request_id) else first + c.bsz * self.kvb
                if n > 0:
                    st.sent += n
                    st.sends += 1
                    self.net.send_timed(
                        self._links(st, _SEND), n, _CLS[_SEND], functools.partial(self._sent, st)
                    )
        done = [st for st, c in batch if plan.finishes(c.request_id)]
        if not loads:
            self.loop.at(t0 + compute, self._batch_end, pe, done, t0)
            return
        left = [len(loads), t0]  # loads whose end is not known yet, latest end known
        layerwise = self.policy.layerwise

        def loaded(t_end: float) -> None:
            if t_end > left[1]:
                left[1] = t_end
            left[0] -= 1
            if left[0]:
                return
            t = left[1]  # the batch's hit KV is on the device
            end = (
                max(t0 + compute + (t - t0) / self.layers, t + compute / self.layers)
                if layerwise
                else t + compute
            )
            self.loop.at(end, self._batch_end, pe, done, t0)

        # One event for the batch: its end, scheduled once every load's end is known.
        for links, n, i in loads:
            self.net.send_timed(links, n, _CLS[i], loaded)

    def _batch_end(self, pe: SimEngine, done: list[RoundState], t0: float) -> None:
        pe.busy = False
        for st in done:
            self._first_token(st, self.loop.now - t0)
        lead = self.router.batch_ended(pe)
        self._run_batch(pe)
        if lead is not None and not pe.busy:
            self.router.idle(lead)

    def _first_token(self, st: RoundState, prefill_s: float) -> None:
        a, pe = st.assignment, st.pe
        assert a is not None and pe is not None and st.de is not None
        st.t_first = self.loop.now
        st.prefilled = True
        st.prefill_s = prefill_s
        st.generated = 1
        for side in ("pe", "de"):
            self._dequeue_reads(st, side)
        self.router.prefilled(pe, st.request)
        pe.buffer.release(st.pe_buf)
        self.router.wake()
        if not st.sends:
            self._receive_at(st)

    def _sent(self, st: RoundState, t_end: float) -> None:
        """One of the request's layer-block sends ends at `t_end` (known now: `transfer_timed`)."""
        st.sends -= 1
        if t_end > st.sent_end:
            st.sent_end = t_end
        if not st.sends and st.prefilled:
            self._receive_at(st)

    def _receive_at(self, st: RoundState) -> None:
        """Prefill done and every send's end known: the DE side starts when the last send ends."""
        if st.sent_end <= self.loop.now:
            self._de_receive(st)
        else:
            self.loop.at(st.sent_end, self._de_receive, st)

    # ------------------------------------------------------------------ decode engine

    def _de_receive(self, st: RoundState) -> None:
        """The whole prompt KV is in the DE buffer: copy it to the DE device, then admit."""
        nb = st.nbytes
        if not nb or nb[_DE_H2D] <= 0:
            self._de_loaded(st)
        else:
            links = self._links(st, _DE_H2D)
            self.net.send(links, nb[_DE_H2D], _CLS[_DE_H2D], self._de_loaded, st)

    def _de_loaded(self, st: RoundState) -> None:
        de = st.de
        assert de is not None
        de.buffer.release(st.de_buf)
        de.waiting.append(st)
        self.decode.admit(de)

    def _decoded(self, de: SimEngine, st: RoundState) -> None:
        """Every token is out: persist the new Full Blocks, then report done (as the real DE)."""
        if self.opt.decode_overhead_s > 0:
            self.loop.after(self.opt.decode_overhead_s, self._persist, de, st)
        else:
            self._persist(de, st)

    def _persist(self, de: SimEngine, st: RoundState) -> None:
        r = st.request
        n_full = (r.prompt_tokens + r.gen_tokens - 1) // self.bt
        start = min(r.cached_tokens // self.bt, n_full)
        nbytes = (n_full - start) * self.bt * self.kvb
        if self.opt.persist and self.policy.reads and nbytes > 0:
            links = self._persist_links.get(de.id)
            if links is None:
                links = self.net.resolve(paths.persist_path(de.name, de.node_name))
                self._persist_links[de.id] = links
            self.net.send(links, nbytes, TrafficClass.LOW, self._finish, st)
        else:
            self.loop.soon(self._finish, st)

    def _finish(self, st: RoundState) -> None:
        now, r, de = self.loop.now, st.request, st.de
        assert de is not None and st.assignment is not None
        self.router.done(de, r)
        self.results.append(
            RoundResult.timed(
                r.id,
                range(r.gen_tokens),  # no token ids here
                t_submit=st.t_submit,
                t_assign=st.t_assign,
                t_first=st.t_first,
                t_second=st.t_second,
                t_done=now,
                cached_tokens=st.cached - st.lead,
                prompt_tokens=r.prompt_tokens,
                recomputed_blocks=st.assignment.recompute_blocks,
                read_path=_PATH_VALUE[st.assignment.path if self.policy.reads else ReadPath.NONE],
                read_s=st.t_read,
                prefill_s=st.prefill_s,
            )
        )
        del self.states[r.id]
        self.counters["requests_done"] += 1
        st.on_done(st)

    # ------------------------------------------------------------------ reports

    def link_reports(self, elapsed_s: float) -> list[dict]:
        """One report per node in the engines' `links/*.json` shape (`metrics.summary`)."""
        out = []
        by_node: dict[int, list[SimEngine]] = {}
        for e in self.engines.values():
            by_node.setdefault(e.node, []).append(e)
        for node, engines in sorted(by_node.items()):
            owners = {f"node{node}", *(e.name for e in engines)}
            windows = {
                ln.id.name: ln.window_series()
                for o in sorted(owners)
                for ln in self.net.by_owner.get(o, ())
            }
            out.append(
                {
                    "role": engines[0].role,
                    "engine": engines[0].id,
                    "node": node,
                    "snapshot": self.net.snapshot(elapsed_s, owners),
                    "windows": windows,
                }
            )
        return out
