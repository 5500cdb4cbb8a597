"""`DecodeLoad`: the DE half of one request's load (loader.py has the protocol): reserve the DE
buffer for the prompt, read the DE's blocks and offer them to the PE layer by layer, then receive
the PE's rows into the buffer until the prompt's KV is complete."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures

import numpy as np

from dualpath_jax import copies
from dualpath_jax.kvstore.buffers import BufferReservation
from dualpath_jax.model.layout import bytes_to_kv_rows
from dualpath_jax.transfer import links, paths
from dualpath_jax.transfer.loader import LoaderContext, LoadJob, Part, column_pieces, padded_blocks
from dualpath_jax.transfer.row_offers import hit_piece_uuid, piece_uuid


class DecodeLoad:
    """The DE half of one request's load. Lifecycle: `start()` -> `wait()` (the prompt KV is
    complete in the DE buffer) -> `prompt_kv()` -> `close()` (frees the DE buffer)."""

    def __init__(self, ctx: LoaderContext, job: LoadJob):
        self.ctx, self.job = ctx, job
        bt = ctx.layout.block_tokens
        self.n_blocks = -(-job.prompt_tokens // bt)
        self._abort = threading.Event()  # set by close(): ends this load's waiting pulls
        self._res: BufferReservation | None = None
        self._done: futures.Future[None] | None = None
        self.de_hits = 0
        self.de_read_bytes = 0
        self.held_blocks = 0  # of its blocks, taken from the engine's prefetch memory
        self.read_s = 0.0  # from the start of its half until its store reads ended
        self.on_read_done: Callable[[], None] | None = (
            None  # e.g. the node's read queue bookkeeping
        )

    def start(self) -> DecodeLoad:
        self._res = self.ctx.buffer.reserve(
            self.n_blocks, owner=self.job.request_id, timeout_s=self.ctx.timeout_s
        )
        self._done = self.ctx.pool.submit(self._run)
        return self

    def _run(self) -> None:
        ctx, job = self.ctx, self.job
        bt, p, d = ctx.layout.block_tokens, job.pe_blocks, job.de_blocks
        res = self._res
        first = job.lead + p  # the DE's blocks sit at their prompt positions in its buffer
        if d:
            t0 = time.monotonic()
            keys = job.keys[first : first + d]
            self.de_hits, self.held_blocks = ctx.read_hit(job, keys, res, first, job.de_node)
            self.de_read_bytes = (self.de_hits - self.held_blocks) * ctx.layout.nbytes
            self.read_s = time.monotonic() - t0
            if self.on_read_done is not None:
                self.on_read_done()
            ctx.channel.offer(job.uuid(Part.DE_HITS), [np.array([self.de_hits], np.int32)])
            if self.de_hits:
                path = paths.engine_to_engine_path(
                    job.de_engine, job.pe_engine, job.de_node, job.pe_node, False, True
                )
                padded = padded_blocks(self.de_hits)
                nbytes = self.de_hits * bt * ctx.layout.bytes_per_token_per_layer
                # A PE spanning processes: each of its processes pulls the pieces it holds.
                holders = job.pe_piece_holders
                for i in range(ctx.cfg.num_layers):
                    blocks = res.layer_pages(first, self.de_hits, i, padded, purpose="de_offer")
                    ctx.charge(job, path, nbytes, links.TrafficClass.HIGH)
                    pieces = column_pieces(blocks, job.pe_pieces)
                    if not holders:
                        ctx.channel.offer(job.uuid(Part.DE_LAYER, layer=i), pieces)
                        continue
                    for j, piece in enumerate(pieces):
                        for rank in holders[j]:
                            uuid = hit_piece_uuid(job.request_id, job.attempt, i, j, rank)
                            ctx.channel.offer(uuid, [piece])
        # Receive the PE's pieces into the DE buffer.
        k, last = 0, False
        width = ctx.layout.bytes_per_token_per_layer
        while not last:
            # The PE offers a chunk's meta when it begins the chunk: waiting for it is waiting
            # in the PE's queue, which under load can take longer than any one transfer.
            (meta,) = ctx.channel.pull(
                job.pe_address,
                job.uuid(Part.PE_PIECE, k),
                [((6,), np.int32)],
                ctx.start_timeout_s or ctx.timeout_s,
                abort=self._abort,
            )
            t0, t1, last_flag, prefix, n_pad, splits = (int(x) for x in np.asarray(meta))
            last = bool(last_flag)
            new = t1 - t0 - prefix
            # the PE's prefix blocks come padded to a power of two (`padded_blocks`)
            specs = [((padded_blocks(prefix // bt), bt, width), np.uint8)] if prefix else []
            piece = ((n_pad, width // splits), np.uint8)
            # A PE spanning processes offers each piece from where it was computed.
            apart = bool(job.pe_piece_addresses) and new > 0
            if apart and len(job.pe_piece_addresses) != splits:
                raise ValueError(
                    f"request {job.request_id}: the PE sends {splits} pieces and registered"
                    f" {len(job.pe_piece_addresses)} places for them"
                )
            if new and not apart:
                specs += [piece] * splits
            path = paths.engine_to_engine_path(
                job.pe_engine, job.de_engine, job.pe_node, job.de_node, True, False
            )
            for i in range(ctx.cfg.num_layers):
                arrays = []
                if specs:
                    arrays = ctx.channel.pull(
                        job.pe_address,
                        job.uuid(Part.PE_LAYER, k, i),
                        specs,
                        ctx.timeout_s,
                        abort=self._abort,
                    )
                for j, where in enumerate(job.pe_piece_addresses if apart else ()):
                    uuid = piece_uuid(job.request_id, job.attempt, k, i, j)
                    arrays += ctx.channel.pull(
                        where, uuid, [piece], ctx.timeout_s, abort=self._abort
                    )
                # Into the DE buffer (host memory); the new rows' padding is dropped.
                parts = [copies.to_host(a, "de_buffer") for a in arrays]
                if prefix:
                    parts[0] = parts[0][: prefix // bt].reshape(prefix, width)
                if new:  # the column splits side by side, the padding dropped
                    cols = parts[len(parts) - splits :]
                    joined = cols[0] if splits == 1 else np.concatenate(cols, axis=1)
                    parts[len(parts) - splits :] = [joined[:new]]
                data = np.concatenate(parts) if len(parts) > 1 else parts[0]
                ctx.charge(job, path, data.nbytes, links.TrafficClass.HIGH)
                self._write_rows(i, t0, data)
            k += 1

    def _write_rows(self, layer: int, t0: int, data: np.ndarray) -> None:
        bt = self.ctx.layout.block_tokens
        t = t0
        while t < t0 + data.shape[0]:
            b, off = divmod(t, bt)
            n = min(bt - off, t0 + data.shape[0] - t)
            self._res.block(b)[layer, off : off + n] = data[t - t0 : t - t0 + n]
            t += n

    def done(self) -> bool:
        return self._done is not None and self._done.done()

    def wait(self, timeout_s: float | None = None) -> None:
        assert self._done is not None, "start() first"
        self._done.result(timeout_s if timeout_s is not None else self.ctx.timeout_s)

    def prompt_blocks(self) -> np.ndarray:
        """The prompt's KV as Full Blocks `[n, L, bt, bytes]` uint8 (a copy out of the DE
        buffer; the last block may be partly filled)."""
        return np.stack(self._res.blocks())

    def prompt_kv(self) -> np.ndarray:
        """The full prompt's KV rows `[L, prompt_tokens, W]` (a copy out of the DE buffer)."""
        blocks = self.prompt_blocks()  # [n, L, bt, bytes]
        flat = blocks.transpose(1, 0, 2, 3).reshape(self.ctx.cfg.num_layers, -1, blocks.shape[-1])
        return bytes_to_kv_rows(flat[:, : self.job.prompt_tokens], self.ctx.cfg)

    def close(self) -> None:
        self._abort.set()
        if self._res is not None:
            self._res.release()
            self._res = None
