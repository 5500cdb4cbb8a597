"""The prefill engine (PE): intra-engine batching under the compute quota and layerwise prefill.

Loop (one thread owns the control socket): fetch work and heartbeat, start each job's loads,
move requests whose reads finished into the `PrefillQueue`, and run one forward batch at a time.
A batch is chosen by `pack_prefill_batch` (FIFO under the compute quota, the overflowing request
cut by binary search: chunked prefill). In layerwise mode each layer's cached KV is taken from
the request's `LayerReadiness` just before the layer runs and its new KV goes to the DE right
after; in `basic` mode (layerwise off) the whole hit is loaded before one monolithic forward.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engine import messages as M
from dualpath_jax.engine.common import failed, is_stop, job_from_msg, pump, register
from dualpath_jax.engine.params import ParamsSlot
from dualpath_jax.engine.rpc import RpcClient
from dualpath_jax.model.decode import sample_at
from dualpath_jax.model.pages import CachedPages, DeviceRowRun, LayerPages, segment_tokens
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.sched.intra import PendingPrefill, PrefillQueue, batch_kv_bound
from dualpath_jax.sched.policy import make_policy
from dualpath_jax.transfer.loader import DeviceRows, LoaderContext, PrefillLoad

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Req:
    msg: M.LoadJobMsg
    load: PrefillLoad
    t_start: float
    hit: int = -1  # effective hit in blocks loaded (after the lead), once the reads are done
    lead: int = 0  # leading prompt tokens recomputed before the loaded hit (0: none)
    hit_rows: dict[int, list] = dataclasses.field(default_factory=dict)  # layer -> hit segments
    lead_rows: dict[int, list] = dataclasses.field(default_factory=dict)  # the lead's rows
    done_rows: dict[int, list] = dataclasses.field(default_factory=dict)  # earlier chunks' rows
    t_read: float = 0.0


class PrefillEngine:
    """One PE. `attention_time(pairs)` predicts a batch's attention-layer seconds."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        engine: int,
        node: int,
        group: int,
        rpc: RpcClient,
        runner: ModelRunner,
        ctx: LoaderContext,
        attention_time: Callable[[Sequence[tuple[int, int]]], float],
        clock: Callable[[], float] = time.monotonic,
        params: ParamsSlot | None = None,
        prefill_cost: M.PrefillCost | None = None,  # the model behind attention_time, reported
        outbox: queue.Queue[M.Msg] | None = None,  # messages of other threads (store KVEvents)
    ):
        self.prefill_cost = prefill_cost
        self.outbox: queue.Queue[M.Msg] = queue.Queue() if outbox is None else outbox
        self.cfg, self.engine, self.node, self.group = cfg, engine, node, group
        self.rpc, self.runner, self.ctx = rpc, runner, ctx
        self.params = params or ParamsSlot(runner, "", engine)
        self.attention_time = attention_time
        self.clock = clock
        self.bt = cfg.store.block_tokens
        self.reqs: dict[str, _Req] = {}
        self.last_batch = 0  # requests in the latest forward (reported with each Fetch)
        self.reading: list[str] = []
        self.queue = PrefillQueue()
        self.stopped = False
        self.last_fetch = -1e9
        self._no_rows = np.zeros((0, cfg.model.kv_width), cfg.model.kv_dtype)
        # The context one forward batch may hold on the device (the router sends this policy's
        # layerwise flag with every request).
        self.max_kv_tokens = batch_kv_bound(
            cfg.cluster.prefill_max_kv_tokens,
            cfg.model.num_layers,
            make_policy(cfg.scheduler).layerwise,
        )

    # ------------------------------------------------------------------ loop

    def register(self) -> None:
        register(
            self.rpc,
            "prefill",
            self.engine,
            self.node,
            self.group,
            self.ctx.channel.address,
            self.params.version,
            self.prefill_cost,
            runner=self.runner,
            kv_pieces=self.ctx.row_pieces,
        )

    def run(self) -> None:
        self.register()
        while not self.stopped:
            pump(self.rpc, self.handle, 0 if len(self.queue) else 5)
            while not self.outbox.empty():
                self.rpc.send(self.outbox.get_nowait())
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
        links = traffic.snapshot() if traffic is not None else {}
        self.rpc.send(
            M.Fetch(
                engine=self.engine,
                load=M.Load(read_q=read_q, batch=self.last_batch),
                links=json.dumps(links),
            )
        )

    def handle(self, msg: M.Msg) -> None:
        match msg:
            case M.Work(jobs=jobs):
                for m in jobs:
                    self.start(m)
            case M.Cancel(request=r):
                self.drop(r)
            case M.LoadParams() | M.CommitParams():
                self.params.handle(msg, self.rpc.send)
            case _:
                stop = is_stop(msg)
                if stop is None:
                    log.warning("unexpected %s", type(msg).__name__)
                self.stopped |= bool(stop)

    def start(self, m: M.LoadJobMsg) -> None:
        try:
            self.params.check_job(m)
        except RuntimeError as e:
            self.rpc.send(failed(m.request, self.engine, e, m.attempt))
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
        if request in self.reading:
            self.reading.remove(request)
        self.queue.remove(request)
        r.load.close()

    def fail(self, request: str, exc: BaseException) -> None:
        r = self.reqs.get(request)
        self.rpc.send(failed(request, self.engine, exc, r.msg.attempt if r else 0))
        self.drop(request)

    def poll_reads(self) -> None:
        for rid in list(self.reading):
            r = self.reqs[rid]
            if not r.load.reads_done():
                continue
            self.reading.remove(rid)
            job = r.load.job
            if job.pe_blocks and not job.oracle:
                if self.ctx.traffic is not None:
                    self.ctx.traffic.read_queue_done(job.pe_node, job.pe_blocks * self.bt)
                self.rpc.send(M.ReadsDone(request=rid, engine=self.engine, attempt=job.attempt))
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
                r.hit_rows[layer] = hit.segments() if hit is not None else []
                r.load.consumed()
            parts = [*r.lead_rows.get(layer, []), *r.hit_rows[layer], *r.done_rows.get(layer, [])]
        got = sum(segment_tokens(x, self.bt) for x in parts)
        assert got == cached, (got, cached)
        return parts

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
        try:
            batch = PrefillBatch.build(
                c.model,
                [r.msg.prompt[ch.cached : ch.cached + ch.bsz] for r, ch in zip(reqs, chunks)],
                [ch.cached for ch in chunks],
                self.runner.min_bucket,
            )
        except ValueError as e:
            for ch in chunks:
                self.fail(ch.request_id, e)
            return
        for r, ch in zip(reqs, chunks):
            r.load.begin_chunk(
                ch.cached, ch.cached + ch.bsz, plan.finishes(ch.request_id), batch.n_pad
            )

        def load_layer(i: int) -> LayerPages:
            # Each request's cached rows (its hit's layer blocks, then earlier chunks' rows) in
            # pages of block_tokens: a hit block is one page as it is, and nothing is padded to
            # the batch's longest context.
            segments = [
                self.cached_rows(r, i, ch.cached) if ch.cached else [self._no_rows]
                for r, ch in zip(reqs, chunks)
            ]
            return LayerPages.assemble(
                segments,
                self.bt,
                c.model.kv_width,
                c.model.kv_dtype,
                placement=self.runner.pages_sharding,  # on a mesh: split by KV head
            )

        def emit_layer(i: int, rows) -> None:
            # Each request's rows go to its DE from the device, padded to the batch's length (one
            # program per batch shape, not per request length). A request with chunks to come
            # keeps this chunk's rows on the device for its next forward.
            for b, (r, ch) in enumerate(zip(reqs, chunks)):
                if not plan.finishes(ch.request_id):
                    kept = r.lead_rows if ch.cached < r.lead else r.done_rows
                    kept.setdefault(i, []).append(DeviceRowRun(rows, b, ch.bsz))
                r.load.send_layer(i, DeviceRows(rows, b, ch.bsz))

        try:
            if all(r.msg.layerwise for r in reqs):
                res = self.runner.prefill_layerwise(batch, load_layer, emit_layer)
            else:
                # Basic: the whole hit is loaded before the forward starts and the forward is
                # one program; the new rows go to the DE after it. Hit pages assembled on the
                # device (a pinned PE buffer copies its blocks there) stay there; host pages go
                # to pinned host memory, and the program copies each layer's pages to the
                # device as the layer runs.
                kv = None
                if batch.c_pad:
                    kv = CachedPages.from_layers([load_layer(i) for i in range(c.model.num_layers)])
                    if not isinstance(kv.pages, jax.Array):
                        kv = kv.to_host(self.runner.pages_sharding(kv.pages.shape))
                res, new = self.runner.prefill_program(batch, kv)
                for i, rows in enumerate(_layers(new)):
                    emit_layer(i, rows)
            logits = np.asarray(res.last_logits)
            pad = [0] * (logits.shape[0] - len(reqs))
            first = sample_at(  # the first generated token sits at position len(prompt)
                logits,
                [r.msg.seed for r in reqs] + pad,
                [len(r.msg.prompt) for r in reqs] + pad,
                [r.msg.temperature for r in reqs] + pad,
                [r.msg.top_p for r in reqs] + [1.0] * len(pad),
            )
        except Exception as e:  # noqa: BLE001
            for ch in chunks:
                self.fail(ch.request_id, e)
            return
        dt = self.clock() - t0
        for b, (r, ch) in enumerate(zip(reqs, chunks)):
            if not plan.finishes(ch.request_id):
                continue
            self.rpc.send(
                M.PrefillDone(
                    request=ch.request_id,
                    engine=self.engine,
                    first_token=int(first[b]),
                    hit_blocks=r.hit,
                    recomputed_blocks=len(r.msg.keys) - r.msg.lead_blocks - r.hit,
                    read_s=r.t_read,
                    prefill_s=dt,
                    lead_blocks=r.msg.lead_blocks,
                )
            )
            del self.reqs[ch.request_id]
            self.ctx.pool.submit(_finish_sends, r.load, self.ctx.timeout_s)


@jax.jit
def _layers(rows):
    """`[L, B, N, W]` -> L device arrays `[B, N, W]` (one program per shape)."""
    return tuple(rows[i] for i in range(rows.shape[0]))


def _finish_sends(load: PrefillLoad, timeout_s: float) -> None:
    try:
        load.flush(timeout_s)
    except Exception as e:  # noqa: BLE001 - the DE side times out and reports the request
        log.warning("sending KV of %s failed: %s", load.job.request_id, e)
    finally:
        load.close()
