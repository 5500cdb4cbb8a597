"""The prefill engine (PE): intra-engine batching under the compute quota and layerwise prefill.

Loop (one thread owns the control socket): fetch work and heartbeat, start each job's loads,
move requests whose reads finished into the `PrefillQueue`, and run one forward batch at a time.
Told by the router that it was declared dead (`Error(kind="rejoin")`: it was paused or cut off
beyond the heartbeat timeout, and its rounds were requeued), it drops every request and
registers again (`rejoin`).
A batch is chosen by `pack_prefill_batch` (FIFO under the compute quota, the overflowing request
cut by binary search: chunked prefill). In layerwise mode each layer's cached KV is taken from
the request's `LayerReadiness` just before the layer runs and its new KV goes to the DE right
after; in `basic` mode (layerwise off) the whole hit is loaded before one monolithic forward.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable

import numpy as np

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
from dualpath_jax.engines.prefill_forward import BatchChunk, describe, forward, keep_rows
from dualpath_jax.engines.span import MirrorLeader
from dualpath_jax.model.cached_kv import (
    LayerPages,
    segment_tokens,
)
from dualpath_jax.model.runner import ModelRunner, PrefillBatch, batch_bucket
from dualpath_jax.model.sampler import sample_at
from dualpath_jax.model.sampling_params import GREEDY, held_back
from dualpath_jax.model.sharding import host_value
from dualpath_jax.sched.cost import FittedCostModel
from dualpath_jax.sched.intra import PendingPrefill, PrefillQueue, batch_kv_bound
from dualpath_jax.sched.policy import make_policy
from dualpath_jax.transfer.loader import LoaderContext
from dualpath_jax.transfer.prefill_load import DeviceRows, PrefillLoad, SplitRows, row_bytes_split
from dualpath_jax.transfer.row_offers import HitPieces
from dualpath_jax.wire import messages

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Req:
    msg: messages.LoadJobMsg
    load: PrefillLoad
    t_start: float
    hit: int = -1  # effective hit in blocks loaded (after the lead), once the reads are done
    lead: int = 0  # leading prompt tokens recomputed before the loaded hit (0: none)
    hit_rows: dict[int, list] = dataclasses.field(default_factory=dict)  # layer -> hit segments
    lead_rows: dict[int, list] = dataclasses.field(default_factory=dict)  # the lead's rows
    done_rows: dict[int, list] = dataclasses.field(default_factory=dict)  # earlier chunks' rows
    t_read: float = 0.0


class PrefillEngine:
    """One PE (the `engines.core.Engine` contract). `cost` is the prefill cost model it batches
    with (the model behind `attention_time`), reported to the router when it registers."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        who: EngineId,
        control: ControlLink,
        ctx: LoaderContext,
        runner: ModelRunner,
        params: ParamsSlot | None = None,
        cost: messages.PrefillCost | None = None,
        *,
        outbox: queue.Queue[messages.Msg]
        | None = None,  # messages of other threads (store KVEvents)
        span: MirrorLeader | None = None,  # an engine spanning processes: its followers
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg, self.who, self.control, self.ctx, self.runner = cfg, who, control, ctx, runner
        self.engine, self.node = who.engine, who.node
        self.prefill_cost = cost
        self.span = span
        self.outbox: queue.Queue[messages.Msg] = queue.Queue() if outbox is None else outbox
        self.params = params or ParamsSlot(runner, "", who.engine)
        self.attention_time = (
            FittedCostModel(prefill=cost.prefill).attention_time if cost is not None else None
        )
        self.clock = clock
        self.bt = cfg.store.block_tokens
        self.reqs: dict[str, _Req] = {}
        self.last_batch = 0  # requests in the latest forward (reported with each Fetch)
        self.reading: list[str] = []
        self.queue = PrefillQueue()
        self.stopped = False
        self.registering = False  # a Register not yet answered (rejoin orders are ignored)
        self.last_fetch = -1e9
        self.link_reports = LinkReports()  # what each Fetch carries of the links
        self._no_rows = np.zeros((0, cfg.model.kv_width), cfg.model.kv_dtype)
        # The context one forward batch may hold on the device (the router sends this policy's
        # layerwise flag with every request).
        self.max_kv_tokens = batch_kv_bound(
            cfg.cluster.prefill_max_kv_tokens,
            cfg.model.num_layers,
            make_policy(cfg.scheduler).layerwise,
        )

    # ------------------------------------------------------------------ loop (engine.core.drive)

    def register(self) -> None:
        self.registering = True
        offers = self.ctx.row_offers
        register(
            self.control,
            self.who,
            self.ctx.channel.address,
            self.params.version,
            self.prefill_cost,
            runner=self.runner,
            kv_pieces=offers.pieces if offers else self.ctx.row_pieces,
            kv_piece_addresses=offers.addresses if offers else (),
            kv_piece_holders=offers.holders if offers else (),
        )

    def rejoin(self, why: str) -> None:
        """The router declared this engine dead and requeued its rounds: every request is
        dropped and the engine registers again. Orders that answer messages sent before that
        `Register` (they arrive before its `Ack`) are ignored."""
        rejoin(self, why)

    def busy(self) -> bool:
        return bool(len(self.queue))

    def step(self) -> None:
        self.poll_reads()
        now = self.clock()
        if now - self.last_fetch >= self.cfg.cluster.fetch_interval_s:
            self.fetch(now)
        if len(self.queue):
            self.run_batch()

    def fetch(self, now: float) -> None:
        self.last_fetch = now
        traffic = self.ctx.traffic
        read_q = traffic.read_q(f"node{self.node}") if traffic is not None else 0
        self.control.send(
            messages.Fetch(
                engine=self.engine,
                load=messages.Load(read_q=read_q, batch=self.last_batch),
                links=self.link_reports.due(traffic, now, busy=self.busy()),
            )
        )

    def handle(self, msg: messages.Msg) -> None:
        match msg:
            case messages.Work(jobs=jobs):
                for m in jobs:
                    self.start(m)
            case _:
                handle_common(self, msg)

    def start(self, m: messages.LoadJobMsg) -> None:
        try:
            self.params.check_job(m)
        except RuntimeError as e:
            self.control.send(failed(m.request, self.engine, e, m.attempt))
            return
        job = job_from_msg(m)
        traffic = self.ctx.traffic
        if traffic is not None and job.pe_blocks and not job.oracle:
            traffic.read_queue_add(job.pe_node, job.pe_blocks * self.bt)
        load = PrefillLoad(self.ctx, job).start()
        self.reqs[m.request] = _Req(m, load, self.clock())
        self.reading.append(m.request)

    def drop(self, request: str) -> None:
        r = self.reqs.pop(request, None)
        if r is None:
            return
        if self.span is not None and (r.lead_rows or r.done_rows):
            self.span.send("drop", (request,))  # the followers' rows kept for its next chunk
        if request in self.reading:
            self.reading.remove(request)
        self.queue.remove(request)
        r.load.close()

    def fail(self, request: str, exc: BaseException) -> None:
        r = self.reqs.get(request)
        self.control.send(failed(request, self.engine, exc, r.msg.attempt if r else 0))
        self.drop(request)

    def poll_reads(self) -> None:
        for rid in list(self.reading):
            r = self.reqs[rid]
            if not r.load.reads_done():
                continue
            self.reading.remove(rid)
            job = r.load.job
            if job.pe_blocks and not job.oracle:
                tokens = job.pe_blocks * self.bt
                self.control.send(
                    finish_reads(self.engine, rid, r.load, job.pe_node, tokens, self.ctx.traffic)
                )
            try:
                r.hit = r.load.hit_blocks()
            except Exception as e:  # noqa: BLE001 - store/transfer failures fail the request
                self.fail(rid, e)
                continue
            r.t_read = self.clock() - r.t_start
            r.load.stream()
            n = len(r.msg.prompt)
            if r.hit and r.msg.lead_blocks:
                # A recomputed lead: its tokens first, then the new tokens after the whole hit
                # (the loaded blocks join the two).
                r.lead = r.msg.lead_blocks * self.bt
                cached = r.lead + r.hit * self.bt
                self.queue.add(PendingPrefill(rid, 0, r.lead, cached, n - cached))
            else:  # nothing loaded after a lead computes the whole prompt
                cached = r.hit * self.bt
                self.queue.add(PendingPrefill(rid, cached, n - cached))

    # ------------------------------------------------------------------ forward

    def cached_rows(self, r: _Req, layer: int, cached: int) -> list:
        """Layer `layer`'s KV of the request's first `cached` prompt tokens, as the segments
        `LayerPages.assemble` takes: a recomputed lead's rows (kept on the device), the hit's
        (`HitLayer.segments`: PE-read rows on the host, DE-read blocks on the device), then
        earlier chunks' rows. A chunk of the lead itself takes only the lead's earlier rows."""
        if cached <= r.lead:
            parts = r.lead_rows.get(layer, [])
        else:
            if layer not in r.hit_rows:
                hit = r.load.readiness.wait(layer, self.ctx.timeout_s)
                segs = hit.segments() if hit is not None else []
                # pieces pulled apart (spanning processes): one array over the mesh, in step
                # with the other processes, which pull theirs when they hear of the layer
                r.hit_rows[layer] = [self._over_mesh(x) for x in segs]
                r.load.consumed()
            parts = [*r.lead_rows.get(layer, []), *r.hit_rows[layer], *r.done_rows.get(layer, [])]
        got = sum(segment_tokens(x, self.bt) for x in parts)
        assert got == cached, (got, cached)
        return parts

    def _over_mesh(self, x):
        if not isinstance(x, HitPieces):
            return x
        return self.ctx.row_offers.hit_pages(x, self.cfg.model.kv_width, self.cfg.model.kv_dtype)

    def run_batch(self) -> None:
        c = self.cfg
        plan = self.queue.next_batch(
            self.attention_time,
            c.scheduler.compute_quota_ms / 1e3,
            max_requests=c.cluster.prefill_max_batch,
            max_tokens=c.cluster.prefill_max_tokens,
            max_kv_tokens=self.max_kv_tokens,
        )
        chunks = [ch for ch in plan.chunks if ch.request_id in self.reqs]
        if not chunks:
            return
        reqs = [self.reqs[ch.request_id] for ch in chunks]
        self.last_batch = len(reqs)
        t0 = self.clock()
        span = self.span
        # Warmed up, the batch is padded to the batch sizes the warm-up compiled (requests of
        # one token, nothing cached; their rows are dropped). A span's followers build their
        # batches from the leader's prompts, unpadded.
        pad = 0
        if c.cluster.warmup and span is None:
            pad = batch_bucket(len(reqs), c.cluster.prefill_max_batch) - len(reqs)
        try:
            batch = PrefillBatch.build(
                c.model,
                [r.msg.prompt[ch.cached : ch.cached + ch.bsz] for r, ch in zip(reqs, chunks)]
                + [[0]] * pad,
                [ch.cached for ch in chunks] + [0] * pad,
                self.runner.min_bucket,
            )
        except ValueError as e:
            for ch in chunks:
                self.fail(ch.request_id, e)
            return
        layerwise = all(r.msg.layerwise for r in reqs)
        work = [
            BatchChunk(ch.request_id, ch.cached, ch.bsz, plan.finishes(ch.request_id), r.lead)
            for r, ch in zip(reqs, chunks)
        ]
        for r, w in zip(reqs, work):
            r.load.begin_chunk(w.cached, w.cached + w.bsz, w.finishes, batch.n_pad)
        kept = {r.msg.request: (r.lead_rows, r.done_rows) for r in reqs}
        if span is not None:
            span.send(
                "batch",
                (),
                {
                    "prompts": [
                        r.msg.prompt[w.cached : w.cached + w.bsz] for r, w in zip(reqs, work)
                    ],
                    "starts": [w.cached for w in work],
                    "chunks": [dataclasses.astuple(w) for w in work],
                    "layerwise": layerwise,
                    # what the followers' row pieces are offered under (`piece_uuid`)
                    "sends": [[r.msg.request, r.msg.attempt, r.load.chunk] for r in reqs],
                },
            )

        def load_layer(i: int) -> LayerPages:
            # Each request's cached rows (a recomputed lead's, its hit's layer blocks, then
            # earlier chunks' rows) in pages of block_tokens: a hit block is one page as it is,
            # and nothing is padded to the batch's longest context.
            segments = [
                self.cached_rows(r, i, w.cached) if w.cached else [self._no_rows]
                for r, w in zip(reqs, work)
            ] + [[self._no_rows]] * pad
            if span is not None:  # the followers assemble the same pages from what they are
                # told (host rows, their own kept rows and hit pieces: what `segments` hold here)
                desc = [describe(seg, *kept[w.request_id], i) for seg, w in zip(segments, work)]
                span.send("layer", (i,), {"requests": desc})
            return LayerPages.assemble(
                segments,
                self.bt,
                c.model.kv_width,
                c.model.kv_dtype,
                placement=self.runner.kv_placement,  # on a mesh: split by KV head
                pad_to_table=self.runner.gathers_pages,  # one page count per table shape
            )

        def emit_layer(i: int, rows) -> None:
            # Each request's rows go to its DE from the device, padded to the batch's length (one
            # program per batch shape, not per request length). A request with chunks to come
            # keeps this chunk's rows on the device for its next forward.
            keep_rows(kept, work, i, rows)
            offers = self.ctx.row_offers
            if offers is not None:  # a mesh over processes: each sends the pieces it computed
                for b, (r, w) in enumerate(zip(reqs, work)):
                    r.load.send_layer(i, SplitRows(row_bytes_split(rows, b, offers.split), w.bsz))
                return
            for b, (r, w) in enumerate(zip(reqs, work)):
                r.load.send_layer(i, DeviceRows(rows, b, w.bsz))

        try:
            res = forward(self.runner, c.model.num_layers, batch, layerwise, load_layer, emit_layer)
            logits = host_value(res.last_logits)
            first, first_lp = sample_at(  # the first generated token sits at len(prompt)
                logits,
                [r.msg.sampling for r in reqs] + [GREEDY] * pad,
                [len(r.msg.prompt) for r in reqs] + [0] * pad,
                # with min_tokens > 0 the first token is no stop token
                [held_back(r.msg.sampling, r.msg.stop_tokens, 0) for r in reqs] + [[]] * pad,
                logprobs=True,
            )
        except Exception as e:  # noqa: BLE001
            if span is not None:
                span.send("abort")  # a follower waiting for a layer gives its forward up too
            for ch in chunks:
                self.fail(ch.request_id, e)
            return
        dt = self.clock() - t0
        for b, (r, ch) in enumerate(zip(reqs, chunks)):
            if not plan.finishes(ch.request_id):
                continue
            self.control.send(
                messages.PrefillDone(
                    request=ch.request_id,
                    engine=self.engine,
                    first_token=int(first[b]),
                    hit_blocks=r.hit,
                    recomputed_blocks=len(r.msg.keys) - r.msg.lead_blocks - r.hit,
                    read_s=r.t_read,
                    prefill_s=dt,
                    lead_blocks=r.msg.lead_blocks,
                    attempt=r.msg.attempt,
                    first_logprobs=first_lp[b],
                    params_version=self.params.version,
                )
            )
            del self.reqs[ch.request_id]
            self.ctx.pool.submit(_finish_sends, r.load, self.ctx.timeout_s)


def _finish_sends(load: PrefillLoad, timeout_s: float) -> None:
    try:
        load.flush(timeout_s)
    except Exception as e:  # noqa: BLE001 - the DE side times out and reports the request
        log.warning("sending KV of %s failed: %s", load.job.request_id, e)
    finally:
        load.close()
