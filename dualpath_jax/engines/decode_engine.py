"""The decode engine (DE): gathers prompt KV in the DE buffer, decodes continuously, persists.

Loop (one thread owns the control socket): fetch and heartbeat; start each job's DE half of the
load (reads its hit blocks, serves them to the PE, receives the PE's rows); once a request's
prompt KV is complete, its first token has arrived and its pages fit the KV pool, its blocks
become pages of a free decode slot and the buffer is freed; step every active slot (the next
step is dispatched before the last one's tokens are read); a request that has its `gen` tokens
persists its new Full Blocks (prompt + generated, whole blocks only, read from its pages) to the
store and reports its tokens. Forks (group sampling, `FirstToken.forks`) start from the prompt
pages of the round they follow once it has its slot: no load, no prefill. Told by the router
that it was declared dead (`Error(kind="rejoin")`: it was paused or cut off beyond the
heartbeat timeout, and its rounds were requeued), it drops every request (slots, buffers,
loads) and registers again (`rejoin`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engines.common import (
    LinkReports,
    failed,
    finish_reads,
    handle_common,
    job_from_msg,
    register,
    rejoin,
)
from dualpath_jax.engines.core import ControlLink, EngineId
from dualpath_jax.engines.params import ParamsSlot
from dualpath_jax.kvstore.identity import block_keys, model_fingerprint
from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.model.page_pool import budget_pages, pages_for
from dualpath_jax.model.sampler import row_logprobs
from dualpath_jax.model.sharding import host_value
from dualpath_jax.results import Logprobs
from dualpath_jax.transfer import links, paths
from dualpath_jax.transfer.decode_load import DecodeLoad
from dualpath_jax.transfer.loader import LoaderContext
from dualpath_jax.transfer.readiness import LoadCancelled
from dualpath_jax.wire import messages

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Req:
    msg: messages.LoadJobMsg
    load: DecodeLoad | None
    first: int = -1
    hit: int = 0
    slot: int = -1
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str = ""  # the router asked to complete it with the tokens it has (Finish's reason)
    first_logprobs: Logprobs | None = None  # the first token's (FirstToken), if asked for
    first_version: str = ""  # the params that drew the first token (FirstToken)
    versions: list[tuple[int, str]] = dataclasses.field(
        default_factory=list
    )  # spans, see DecodeDone
    logprobs: Logprobs | None = None  # every token's so far, if the round asked for them
    forks: list[str] = dataclasses.field(default_factory=list)  # forks of it not yet holding
    source: str = ""  # a fork (group sampling): the round whose prompt pages it starts from
    holding: bool = False  # a fork holding those pages (`Decoder.hold`) until it has a slot


def make_decoder(cfg: ExperimentConfig, runner) -> Decoder:
    """The DE's decoder: `cluster.decode_slots` slots of up to `cluster.decode_max_len` tokens
    over a KV page pool of `store.block_tokens`-token pages (a page is one Full Block) sized by
    `cluster.decode_kv_bytes` (the pool's bytes on all the engine's devices) /
    `decode_kv_fraction` (of each device's memory) (default: every slot full)."""
    c, bt = cfg.cluster, cfg.store.block_tokens
    full = c.decode_slots * pages_for(c.decode_max_len, bt)
    # On a mesh each page is split by KV head: a device holds its share of every page.
    page = (1, cfg.model.num_layers, bt, cfg.model.kv_width)
    at = runner.pages_sharding(page)
    shards = page[-1] // at.shard_shape(page)[-1] if at is not None else 1
    pages = budget_pages(
        BlockLayout.for_model(cfg.model, bt).nbytes,  # a page is one Full Block
        budget_bytes=c.decode_kv_bytes,
        fraction=c.decode_kv_fraction,
        default_pages=full,
        device=runner.mesh.devices.flat[0] if runner.mesh is not None else None,
        shards=shards,
    )
    return Decoder(
        runner, c.decode_slots, c.decode_max_len, page_size=bt, num_pages=min(pages, full)
    )


class DecodeEngine:
    """One DE with `cluster.decode_slots` slots of `cluster.decode_max_len` tokens."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        who: EngineId,
        control: ControlLink,
        ctx: LoaderContext,
        decoder: Decoder,
        params: ParamsSlot | None = None,
        *,
        outbox: queue.Queue[messages.Msg] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`outbox`: messages other threads send through the engine's socket (its store's
        `KVEvents`, a worker's `DecodeDone`), in the order they were put."""
        self.cfg, self.who, self.control, self.ctx, self.dec = cfg, who, control, ctx, decoder
        self.engine, self.node = who.engine, who.node
        self.clock = clock
        self.params = params or ParamsSlot(decoder.runner, "", who.engine)
        self.bt = cfg.store.block_tokens
        self.reqs: dict[str, _Req] = {}
        self.waiting: list[str] = []  # jobs whose DE buffer could not be reserved yet
        self.slot_req: dict[int, str] = {}
        self.outbox: queue.Queue[messages.Msg] = queue.Queue() if outbox is None else outbox
        self.stopped = False
        self.registering = False  # a Register not yet answered (rejoin orders are ignored)
        self.last_fetch = -1e9
        self.link_reports = LinkReports()  # what each Fetch carries of the links
        self.inflight = None  # (tokens, {slot: request}, ...) of the step dispatched last
        self.decode_paused = False  # PauseDecode: the slots stay, no step runs

    # ------------------------------------------------------------------ loop (engine.core.drive)

    def register(self) -> None:
        self.registering = True
        register(
            self.control,
            self.who,
            self.ctx.channel.address,
            self.params.version,
            runner=self.dec.runner,
        )

    def rejoin(self, why: str) -> None:
        """The router declared this engine dead and requeued its rounds: every request is
        dropped (its slot, buffer and loads freed) and the engine registers again. Orders that
        answer messages sent before that `Register` (they arrive before its `Ack`) are ignored;
        a persist already running still reports, with its old attempt, which the router
        ignores."""
        rejoin(self, why)

    def busy(self) -> bool:
        return bool(self.slot_req)

    def step(self) -> None:
        now = self.clock()
        if now - self.last_fetch >= self.cfg.cluster.fetch_interval_s:
            self.fetch(now)
        self.start_waiting()
        self.admit()
        if self.slot_req and not self.decode_paused:
            self.decode()
        else:
            self.drain()  # (halted: the step in flight is taken, the slots stay)

    def fetch(self, now: float) -> None:
        self.last_fetch = now
        traffic = self.ctx.traffic
        c = self.cfg.cluster
        load = messages.Load(
            read_q=traffic.read_q(f"node{self.node}") if traffic is not None else 0,
            hbm_capacity_tokens=self.dec.num_pages * self.dec.page_size,
            slots=c.decode_slots,
            batch=len(self.slot_req),
        )
        links = self.link_reports.due(traffic, now, busy=bool(self.reqs))
        self.control.send(messages.Fetch(engine=self.engine, load=load, links=links))

    def handle(self, msg: messages.Msg) -> None:
        match msg:
            case messages.Work(jobs=jobs):
                for m in jobs:
                    try:
                        self.params.check_job(m)
                    except RuntimeError as e:
                        self.control.send(failed(m.request, self.engine, e, m.attempt))
                        continue
                    self.reqs[m.request] = _Req(m, None)
                    self.waiting.append(m.request)
                self.start_waiting()
            case messages.FirstToken(
                request=r, token=t, hit_blocks=h, logprobs=lp, params_version=version
            ):
                if r in self.reqs:
                    self.reqs[r].first, self.reqs[r].hit = t, h
                    self.reqs[r].first_logprobs = lp
                    self.reqs[r].first_version = version or self.reqs[r].msg.params_version
                self.take_forks(r, msg.forks)
            case messages.PauseDecode(paused=paused):
                self.decode_paused = paused
            case messages.Finish(request=rid, reason=reason):
                r = self.reqs.get(rid)
                if r is not None:
                    r.finish = reason or "finished"
                    if r.slot >= 0 and r.tokens:  # (a fork completes after its first token)
                        self.complete(r, r.finish)
            case messages.Retain(session=session, state="ended"):
                # the session is closed: its claims on the blocks this engine persisted go too
                # (the blocks stay), or the index would remember every session ever served
                self.ctx.store.disown(session)
            case messages.Retain(session=session, state=state, priority=priority, ttl_s=ttl):
                self.ctx.store.retain(session, state, priority, ttl)
            case _:
                handle_common(self, msg)

    def start_waiting(self) -> None:
        """Starts the DE half of queued jobs, FIFO, while the DE buffer has room."""
        while self.waiting:
            rid = self.waiting[0]
            r = self.reqs[rid]
            job = job_from_msg(r.msg)
            load = DecodeLoad(self.ctx, job)
            if self.ctx.buffer.free_blocks < load.n_blocks:
                if load.n_blocks > self.ctx.buffer.capacity_blocks:
                    self.waiting.pop(0)
                    self.fail(
                        rid,
                        RuntimeError(f"prompt of {job.prompt_tokens} tokens exceeds the DE buffer"),
                    )
                    continue
                return  # back-pressure: wait for a release
            self.waiting.pop(0)
            traffic = self.ctx.traffic
            if job.de_blocks and not job.oracle:
                if traffic is not None:
                    traffic.read_queue_add(job.de_node, job.de_blocks * self.bt)
                load.on_read_done = lambda rid=rid, load=load: self.reads_done(rid, load)
            r.load = load.start()
            self.control.send(
                messages.DeReady(request=rid, engine=self.engine, attempt=job.attempt)
            )

    def take_forks(self, source: str, forks: list[messages.LoadJobMsg]) -> None:
        """Rounds of `source`'s prompt (group sampling) to start from its prompt pages: each
        takes a hold on them when `source` gets its slot (`admit`), then a slot of its own."""
        leader = self.reqs.get(source)
        for m in forks:
            if leader is None or leader.slot >= 0:  # gone, or admitted and maybe done already
                why = LoadCancelled(f"the round {source} it forks from is no longer here")
                self.control.send(failed(m.request, self.engine, why, m.attempt))
                continue
            try:
                self.params.check_job(m)
            except RuntimeError as e:
                self.control.send(failed(m.request, self.engine, e, m.attempt))
                continue
            # its prompt's whole blocks are the leader's to persist
            self.reqs[m.request] = _Req(m, None, hit=len(m.prompt) // self.bt, source=source)
            leader.forks.append(m.request)

    def reads_done(self, request: str, load: DecodeLoad) -> None:
        """Called on a loader thread once the DE's storage reads for `request` finished."""
        job = load.job
        tokens = job.de_blocks * self.bt
        self.outbox.put(
            finish_reads(self.engine, request, load, job.de_node, tokens, self.ctx.traffic)
        )

    def drop(self, request: str) -> None:
        r = self.reqs.pop(request, None)
        if r is None:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if r.slot >= 0:
            self.dec.free(r.slot)
            self.slot_req.pop(r.slot, None)
        if r.load is not None:
            r.load.close()
        if r.holding:
            self.dec.release(f"fork:{request}")
        for fork in r.forks:  # its prompt never reached a slot: they run on their own
            if fork in self.reqs:
                why = LoadCancelled(f"the round {request} it forks from was dropped")
                self.fail(fork, why)

    def fail(self, request: str, exc: BaseException) -> None:
        r = self.reqs.get(request)
        self.control.send(failed(request, self.engine, exc, r.msg.attempt if r else 0))
        self.drop(request)

    # ------------------------------------------------------------------ decode

    def admit(self) -> None:
        """Moves requests whose prompt KV and first token are here into free slots, in arrival
        order, while their pages (prompt + gen tokens) fit the KV pool; the first that does not
        fit waits for pages to be freed (one that could never fit fails)."""
        free = self.dec.free_slots()
        for rid, r in list(self.reqs.items()):
            if not free:
                return
            if r.holding and r.slot < 0:
                if not self.admit_fork(r, free):
                    return  # back-pressure: wait for pages
                continue
            if r.slot >= 0 or r.load is None or r.first < 0 or not r.load.done():
                continue
            job = r.load.job
            reserve = job.prompt_tokens + r.msg.gen
            if not self.dec.can_insert(reserve):
                if self.dec.pages_needed(reserve) > self.dec.num_pages:
                    self.fail(
                        rid,
                        RuntimeError(
                            f"a request of {reserve} tokens needs more KV pages than the DE's"
                            f" budget of {self.dec.num_pages} pages"
                        ),
                    )
                    continue
                return  # back-pressure: wait for pages
            try:
                r.load.wait(0)
                blocks = r.load.prompt_blocks()
            except Exception as e:  # noqa: BLE001 - transfer/store failures fail the request
                self.fail(rid, e)
                continue
            self.ctx.charge(
                job,
                paths.h2d_path(job.de_engine, job.de_node),
                blocks.nbytes,
                links.TrafficClass.HIGH,
            )
            r.slot = free.pop(0)
            self.dec.insert_blocks(
                r.slot,
                blocks,
                job.prompt_tokens,
                r.first,
                reserve,
                sampling=r.msg.sampling,
                stop_tokens=r.msg.stop_tokens,  # none drawn before sampling.min_tokens
            )
            r.load.close()
            for fork in r.forks:  # they hold its prompt's pages from now on
                if fork in self.reqs:
                    self.dec.hold(f"fork:{fork}", r.slot, job.prompt_tokens)
                    self.reqs[fork].holding = True
            r.forks = []
            self.slot_req[r.slot] = rid
            r.tokens = [r.first]
            r.versions = [(0, r.first_version or r.msg.params_version)]
            if r.msg.sampling.logprobs is not None:
                r.logprobs = Logprobs()
                if r.first_logprobs is not None:  # (a PE always sends it when asked)
                    r.logprobs.extend(r.first_logprobs)
            reason = self.finish_reason(r)
            if reason:
                self.complete(r, reason)

    def admit_fork(self, r: _Req, free: list[int]) -> bool:
        """Starts fork `r` in a free slot from the prompt pages it holds (`Decoder.fork`: its
        first step draws its first token); False if its new pages do not fit now."""
        m = r.msg
        n, reserve = len(m.prompt), len(m.prompt) + m.gen
        pages = self.dec.fork_pages(n, reserve)
        if pages > self.dec.free_pages:
            if pages <= self.dec.num_pages:
                return False
            self.fail(m.request, RuntimeError(f"a fork needs {pages} KV pages, the DE has fewer"))
            return True
        slot = free[0]
        try:
            self.dec.fork(
                slot,
                f"fork:{m.request}",
                n,
                m.prompt[-1],
                reserve,
                sampling=m.sampling,
                stop_tokens=m.stop_tokens,
            )
        except ValueError as e:  # (a round the leader's checks passed: not expected)
            self.fail(m.request, e)
            return True
        r.slot = free.pop(0)
        r.holding = False
        self.slot_req[r.slot] = m.request
        r.versions = [(0, m.params_version)]
        if m.sampling.logprobs is not None:
            r.logprobs = Logprobs()
        return True

    @staticmethod
    def finish_reason(r: _Req) -> str:
        """Why the request is done after its latest token ("" while it goes on). A stop token
        ends it only once it has `min_tokens` tokens before it (the sampling masks it before)."""
        if r.tokens[-1] in r.msg.stop_tokens and len(r.tokens) > r.msg.sampling.min_tokens:
            return "stop"
        if len(r.tokens) >= r.msg.gen:
            return "length"
        return r.finish

    def decode(self) -> None:
        """Dispatches the next decode steps (`cluster.decode_steps` in one program where the
        slots allow, `Decoder.advance_many`), then takes the tokens of the dispatch before it:
        the device runs dispatch t + 1 (fed with dispatch t's last tokens on the device, sampled
        there with each request's sampling params) while the host reads dispatch t's tokens. A
        request done during dispatch t has ridden the rest of it and dispatch t + 1 too; those
        tokens are dropped. A rider that asks for the top-k log-probabilities makes every
        dispatch a single step (they are taken from each step's logits)."""
        riders = self._riders()
        asked = [r.msg.sampling.logprobs for r in riders.values() if r.logprobs is not None]
        steps = 1 if any(asked) else self.cfg.cluster.decode_steps
        tokens, n = self.dec.advance_many(steps)
        # the drawn tokens' log-probabilities come with every step; the top-k only when asked
        chosen = self.dec.logprobs if asked else None
        top = self.dec.top_logprobs() if any(asked) else None
        prev = self.inflight
        self.inflight = (tokens, n, riders, chosen, top, self.params.version)
        if prev is not None:
            self.consume(*prev)

    def _riders(self) -> dict[int, _Req]:
        return {slot: self.reqs[rid] for slot, rid in self.slot_req.items()}

    def drain(self) -> None:
        """Takes the tokens of the dispatch in flight, if any (once no slot is active)."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.consume(*prev)

    def consume(
        self, tokens, n: int, riders: dict[int, _Req], chosen=None, top=None, version=""
    ) -> None:
        """Takes a dispatch's `n` steps of tokens (`chosen`/`top`: their log-probabilities,
        when some rider asked; `version`: the params it ran with) into its riders, and reports
        its new tokens in one `TokensOut`, an entry per round (before any of its riders'
        `DecodeDone`, which their persistence sends later through the outbox)."""
        steps = host_value(tokens).reshape(n, -1).tolist()  # replicated: this process's copy
        if chosen is not None:
            chosen = host_value(chosen).reshape(n, -1, 2)
            top = tuple(host_value(a) for a in top) if top is not None else None
        out: list[messages.RoundTokens] = []
        for slot, r in riders.items():
            if self.slot_req.get(slot) != r.msg.request or self.reqs.get(r.msg.request) is not r:
                continue  # finished (or dropped) since that dispatch
            if version and r.versions and r.versions[-1][1] != version:
                r.versions.append((len(r.tokens), version))  # an update landed under it
            start, reason = len(r.tokens), ""
            entry = Logprobs() if r.logprobs is not None and chosen is not None else None
            for i, row in enumerate(steps):
                r.tokens.append(row[slot])
                if entry is not None:
                    entry.extend(row_logprobs(r.msg.sampling, chosen[i], top, slot))
                reason = self.finish_reason(r)
                if reason:
                    break  # the rest of the dispatch rode along
            if entry is not None:
                r.logprobs.extend(entry)
            end = len(r.tokens)
            # the router times a fork's first token and every round's second; streams get all
            if r.msg.stream or start < 2 <= end or (start == 0 and r.source):
                out.append(
                    messages.RoundTokens(
                        request=r.msg.request, start=start, tokens=r.tokens[start:], logprobs=entry
                    )
                )
            if reason:
                self.complete(r, reason)
        if out:
            self.control.send(messages.TokensOut(rounds=out))

    def complete(self, r: _Req, reason: str = "length") -> None:
        """Persists the request's new Full Blocks, then reports its tokens (from a worker, so the
        next round of the trajectory finds them in the store)."""
        rid = r.msg.request
        slot = r.slot
        fed = r.msg.prompt + r.tokens[:-1]  # every token whose KV exists
        n_full = len(fed) // self.bt
        start = min(r.hit, n_full)
        blocks = None
        if n_full > start:
            blocks = self.dec.full_blocks(slot, start, n_full)  # its pages as they are
        self.dec.free(slot)
        del self.slot_req[slot]
        del self.reqs[rid]
        self.ctx.pool.submit(self._persist, r, fed, start, n_full, blocks, reason)

    def _persist(
        self, r: _Req, fed: list[int], start: int, n_full: int, blocks, reason: str
    ) -> None:
        """Writes the new Full Blocks, then reports the tokens. A store that fails (full,
        read-only, I/O errors) does not cost the round its tokens: they are reported with the
        store's error text, and the next round recomputes the blocks that are missing."""
        rid = r.msg.request
        job = job_from_msg(r.msg)
        persisted, error = 0, ""
        try:
            fp = model_fingerprint(self.cfg.model, r.msg.params_version)
            chain = block_keys(fed[: n_full * self.bt], self.bt, fp)
            if r.msg.session:  # session retention holds the whole chain, hit included
                self.ctx.store.claim(r.msg.session, chain[:start])
            if blocks is not None:
                keys = chain[start:]
                self.ctx.charge(
                    job,
                    paths.persist_path(job.de_engine, job.de_node),
                    blocks.nbytes,
                    links.TrafficClass.LOW,
                )
                self.ctx.store.write_full(keys, blocks, owner=r.msg.session or None).result(
                    self.ctx.timeout_s
                )
                persisted = n_full - start
        except Exception as e:  # noqa: BLE001 - any store failure; the tokens stand
            error = f"{type(e).__name__}: {e}"
            log.warning("request %s: persisting %d blocks failed: %s", rid, n_full - start, error)
        self.outbox.put(
            messages.DecodeDone(
                request=rid,
                engine=self.engine,
                tokens=r.tokens,
                persisted_blocks=persisted,
                persist_error=error,
                finish_reason=reason,
                attempt=r.msg.attempt,
                logprobs=r.logprobs.head(len(r.tokens)) if r.logprobs is not None else None,
                params_versions=[v for v in r.versions if v[0] < len(r.tokens)],
            )
        )
