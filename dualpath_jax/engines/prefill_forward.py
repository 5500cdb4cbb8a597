"""A prefill engine's forward batch, as its leader and its followers run it: `forward` (one
batch, layerwise or Basic), the rows a chunked request keeps on the device (`keep_rows`), and for
an engine spanning processes the cached rows each layer needs told to the followers
(`describe` / `resolve`) and the followers' replay of the leader's forwards (`PrefillReplay`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dualpath_jax.config import ExperimentConfig
from dualpath_jax.engines.params import ParamsSlot, replay_params
from dualpath_jax.model.cached_kv import CachedPages, DeviceRowRun, LayerPages
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.transfer.prefill_load import row_bytes_split
from dualpath_jax.transfer.row_offers import HitPieces, RowOffers, SpanPages

log = logging.getLogger(__name__)


@jax.jit
def _layers(rows):
    """`[L, B, N, W]` -> L device arrays `[B, N, W]` (one program per shape)."""
    return tuple(rows[i] for i in range(rows.shape[0]))


@dataclasses.dataclass(frozen=True)
class BatchChunk:
    """One request's part of a forward: `bsz` tokens after `cached`; `finishes`: its last
    prompt token is among them; `lead`: its recomputed lead's tokens (0: none)."""

    request_id: str
    cached: int
    bsz: int
    finishes: bool
    lead: int


def forward(runner: ModelRunner, num_layers: int, batch, layerwise: bool, load_layer, emit_layer):
    """One forward batch. Layerwise: each layer's cached KV is taken (`load_layer`) just before
    the layer runs and its new rows go out (`emit_layer`) right after. Basic: the whole cached
    KV is taken before one monolithic program; the new rows go out after it. Hit pages
    assembled on the device stay there; host pages go to pinned host memory, and the program
    copies each layer's pages to the device as the layer runs. On CPU
    (`ModelRunner.one_program_prefill` false) Basic keeps that order over the per-layer
    programs."""
    if layerwise:
        return runner.prefill_layerwise(batch, load_layer, emit_layer)
    cached = [load_layer(i) for i in range(num_layers)] if batch.c_pad else []
    if not runner.one_program_prefill:
        # CPU: Basic's order (every layer's KV first, the new rows after) over the per-layer
        # programs, which trace and compile in a fraction of the one program's time
        rows: list = []
        res = runner.prefill_layerwise(batch, cached.__getitem__, lambda i, r: rows.append(r))
        for i, r in enumerate(rows):
            emit_layer(i, r)
        return res
    kv = None
    if cached:
        kv = CachedPages.from_layers(cached)
        if not isinstance(kv.pages, jax.Array):
            kv = kv.to_host(runner.pages_sharding(kv.pages.shape))
    res, new = runner.prefill_program(batch, kv)
    for i, rows in enumerate(_layers(new)):
        emit_layer(i, rows)
    return res


def keep_rows(kept: dict, work: Sequence[BatchChunk], layer: int, rows) -> None:
    """A forward's layer rows of requests with chunks to come, kept on the device for their
    next forward: a recomputed lead's apart from later chunks' (`kept[request]`: the two
    per-layer lists)."""
    for b, w in enumerate(work):
        if not w.finishes:
            lead_rows, done_rows = kept[w.request_id]
            into = lead_rows if w.cached < w.lead else done_rows
            into.setdefault(layer, []).append(DeviceRowRun(rows, b, w.bsz))


def describe(segments: Sequence, lead_rows: dict, done_rows: dict, layer: int) -> list:
    """A request's cached segments of one layer as the followers of an engine spanning
    processes get them: host rows as they are, hit pages by the offers of their pieces (each
    process pulls its own), kept rows by their place in the kept lists (each holds its own)."""
    out = []
    for x in segments:
        if isinstance(x, DeviceRowRun):
            for kind, runs in (
                ("lead", lead_rows.get(layer, [])),
                ("done", done_rows.get(layer, [])),
            ):
                at = next((j for j, y in enumerate(runs) if y is x), -1)
                if at >= 0:
                    out.append([kind, at])
                    break
            else:
                raise ValueError("a kept row run of no request")
        elif isinstance(x, SpanPages):  # each process pulled (or pulls) its own pieces
            out.append(["pieces", x.meta])
        elif isinstance(x, np.ndarray):
            out.append(["rows", x])
        else:  # hit pages reach every process in pieces (`RowOffers`), never from this one
            raise TypeError(f"a cached segment the followers cannot be told: {type(x).__name__}")
    return out


def resolve(
    desc: Sequence,
    lead_rows: dict,
    done_rows: dict,
    layer: int,
    hit: Callable[[dict], SpanPages] | None = None,
) -> list:
    """`describe`'s segments back, with this process's kept rows and, for a DE-read hit layer
    pulled apart, `hit(meta)`: its pages over the mesh."""
    runs = {"lead": lead_rows.get(layer, []), "done": done_rows.get(layer, [])}
    out = []
    for x in desc:
        if x[0] == "rows":
            out.append(x[1])
        elif x[0] == "pieces":
            out.append(hit(x[1]))
        else:
            out.append(runs[x[0]][x[1]])
    return out


class PrefillReplay:
    """A prefill engine's follower: replays each forward batch of its leader on the same mesh,
    with the cached rows the leader sends layer by layer and the rows it keeps itself, and
    offers the DE the pieces of the new rows its devices computed (over `channel`)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        runner: ModelRunner,
        channel,
        params: ParamsSlot | None = None,
    ):
        self.cfg, self.runner, self.channel = cfg, runner, channel
        self.offers = RowOffers.for_mesh(cfg.model, runner.mesh)
        self.offered = 0  # row pieces offered to DEs
        self.pulled = 0  # DE-read hit layers whose pieces it pulled
        self.kept: dict[str, tuple[dict, dict]] = {}  # request -> (lead rows, later chunks' rows)
        # request -> its hit layers pulled, by (kind, layer): DE-read ("de") and PE-read ("pe")
        self.hits: dict[str, dict[tuple, SpanPages]] = {}
        self.params = params or ParamsSlot(runner, "", -1)

    def __call__(self, follower, method: str, args: list, kwargs: dict) -> None:
        if replay_params(self.params, method, args):
            return
        if method == "drop":
            self.kept.pop(args[0], None)
            self.hits.pop(args[0], None)
            return
        if method == "abort":  # the leader gave up a batch between two layers
            return
        if method != "batch":
            raise RuntimeError(f"unexpected call {method!r} from the leader")
        m, bt = self.cfg.model, self.cfg.store.block_tokens
        work = [BatchChunk(*x) for x in kwargs["chunks"]]
        batch = PrefillBatch.build(m, kwargs["prompts"], kwargs["starts"], self.runner.min_bucket)
        kept = {w.request_id: self.kept.setdefault(w.request_id, ({}, {})) for w in work}

        def load_layer(i: int) -> LayerPages:
            call, got, kw = follower.recv()
            if call != "layer" or got[0] != i:
                raise Aborted(f"the leader sent {call!r} while layer {i} was awaited")
            segments = [
                resolve(d, *kept[w.request_id], i, self._hit) for d, w in zip(kw["requests"], work)
            ]
            return LayerPages.assemble(
                segments,
                bt,
                m.kv_width,
                m.kv_dtype,
                placement=self.runner.pages_sharding,
                pad_to_table=self.runner.gathers_pages,
            )

        def emit_layer(i: int, rows) -> None:
            keep_rows(kept, work, i, rows)
            for b, (request, attempt, chunk) in enumerate(kwargs["sends"]):
                x = row_bytes_split(rows, b, self.offers.split)  # as the leader, in step
                self.offered += self.offers.offer(self.channel, request, attempt, chunk, i, x)

        try:
            forward(self.runner, m.num_layers, batch, kwargs["layerwise"], load_layer, emit_layer)
        except Aborted as e:
            log.warning("%s: the batch is dropped", e)
            for w in work:
                self.kept.pop(w.request_id, None)
                self.hits.pop(w.request_id, None)
            return
        for w in work:
            if w.finishes:
                self.kept.pop(w.request_id, None)
                self.hits.pop(w.request_id, None)

    def _hit(self, meta: dict) -> SpanPages:
        """A hit layer over the mesh: this process's pieces pulled the first time (from the DE,
        or from the leader for its PE-read blocks; a later chunk of the request reuses them),
        joined with the others' in step."""
        mine = self.hits.setdefault(meta["request"], {})
        key = (meta["kind"], meta["layer"])
        if key not in mine:
            m, bt = self.cfg.model, self.cfg.store.block_tokens
            width = BlockLayout.for_model(m, bt).bytes_per_token_per_layer
            got = self.offers.pull_hit(
                self.channel, meta, bt, width, self.cfg.cluster.transfer_timeout_s
            )
            hit = HitPieces(got, meta["blocks"], meta)
            self.pulled += 1
            mine[key] = self.offers.hit_pages(hit, m.kv_width, m.kv_dtype)
        return mine[key]


class Aborted(RuntimeError):
    """The leader gave a batch up part way."""
