"""Batched decode over a per-slot KV cache (`Decoder`, drawing tokens as `sampler.py` does);
`generation.py` builds `generate` and the test oracles on it.

Lifecycle of a decode slot: `insert(slot, prompt_kv, next_token)` puts a prompt's KV rows
`[L, T, W]` into the slot's pages; each `step()` feeds every active slot's pending token, writes
its KV row into the slot's page and returns logits; the caller samples the next pending token
with `set_next`; `free(slot)` returns the slot's pages. KV is one page pool
`[P, L, page_size, W]` on the device (a page is one Full Block), updated in place (donated).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dualpath_jax import copies
from dualpath_jax.kernels.kv_rows import bits_dtype
from dualpath_jax.model import decode_programs as programs
from dualpath_jax.model.batch import bucket_len, validate_tokens
from dualpath_jax.model.layers import resolve_attention_impl
from dualpath_jax.model.layout import np_dtype
from dualpath_jax.model.page_pool import PageAllocator, PagesExhausted, pages_for
from dualpath_jax.model.runner import ModelRunner, runs_on_mesh
from dualpath_jax.model.sampler import top_logprobs
from dualpath_jax.model.sampling_params import (
    GREEDY,
    MAX_HELD_STOP_TOKENS,
    SamplingParams,
    min_tokens_problem,
)
from dualpath_jax.model.sharding import host_value, whole

Array = jax.Array


class Decoder:
    """Continuous batched decode over `slots` slots of up to `max_len` tokens each, with the KV
    in pages (`page_pool.py`) and the decode state on the device.

    The pool is `[num_pages + 1, L, page_size, W]` (page 0 is the null page), held as the bits
    of `kv_dtype` (`kv_rows.bits_dtype`: the kernels convert only what they load). A
    slot holds pages for its tokens; `insert` takes the pages a request will need
    (`reserve_tokens`, at least its prompt and the fed token) and a step adds a page when a slot
    outgrows them. `num_pages` defaults to `slots * max_len / page_size` (every slot full); a
    smaller pool holds more slots than it could fill at once, and `can_insert` says whether a
    request fits now. Slots attend over their own live pages only (`attention_impl="pallas"`)
    or over the gathered pages of the longest slot's bucket (`reference`, `xla`).

    The page table, lengths, active mask, sampling parameters and pending tokens live on the
    device; the host keeps a mirror of all but the pending tokens (lengths grow by the active
    mask, which the host knows) and uploads only what `insert`, `free`, `set_next` or page
    growth changed. `advance()` samples the next tokens in the step program (per-slot seed and
    temperature, as `sample_at`) and feeds them to the next step without a host round trip: a
    warmed step with nothing changed transfers nothing to the device, and the caller reads a
    step's tokens whenever it likes (after dispatching the next one, say). `warmup()` compiles
    every shape a decoder will run ahead of time."""

    def __init__(
        self,
        runner: ModelRunner,
        slots: int,
        max_len: int,
        min_bucket: int = 64,
        *,
        page_size: int = 64,
        num_pages: int | None = None,
    ):
        cfg = runner.cfg
        if max_len > cfg.max_seq_len:
            raise ValueError(
                f"decode max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}"
            )
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.runner, self.slots, self.max_len, self.min_bucket = runner, slots, max_len, min_bucket
        self.page_size = page_size
        self.max_pages = pages_for(max_len, page_size)  # table width: a slot at max_len
        self.num_pages = num_pages if num_pages is not None else slots * self.max_pages
        self.alloc = PageAllocator(self.num_pages)
        self.kv_dtype = jnp.dtype(cfg.kv_dtype)
        shape = (self.num_pages + 1, cfg.num_layers, page_size, cfg.kv_width)
        # On a mesh the pool is split by KV head (`sharding.kv_pages_sharding`) from the start.
        self.pages = jnp.zeros(shape, bits_dtype(cfg.kv_dtype), device=runner.pages_sharding(shape))
        self.table = np.zeros((slots, self.max_pages), np.int32)
        self.lengths = np.zeros((slots,), np.int32)
        self.active = np.zeros((slots,), bool)
        self.seeds = np.zeros((slots,), np.uint32)
        self.temperatures = np.zeros((slots,), np.float32)
        self.top_ps = np.ones((slots,), np.float32)
        # min_tokens: each slot's stop tokens (-1 pads), masked while the drawn token's position
        # lies before held_until (prompt length + min_tokens)
        self.stop_ids = np.full((slots, MAX_HELD_STOP_TOKENS), -1, np.int32)
        self.held_until = np.zeros((slots,), np.int32)
        self.wants_logprobs = np.zeros((slots,), bool)  # `SamplingParams.logprobs` set
        self.paged_kernel = resolve_attention_impl(cfg.attention_impl) == "pallas"
        self._pending = jnp.zeros((slots,), jnp.int32)  # device-side: the tokens fed next
        self.logits = self.logprobs = None  # the latest step's (`top_logprobs`)
        self._dev: dict[str, Array] = {}
        self._dirty = True
        self._width = -1  # table columns on the device
        self._rows = -1  # slots a step runs over (`_rows_for`)
        self._headroom = 0  # steps `_prepare` may take without looking at the slots
        self._longest = 0  # the longest active slot's length, fed at the coming step

    @property
    def mesh(self):
        """The runner's mesh (None: one device); the decoder's programs run under it."""
        return self.runner.mesh

    @property
    def pending(self) -> np.ndarray:
        """The tokens the next step feeds (a device read)."""
        return host_value(self._pending)

    @property
    def free_pages(self) -> int:
        return self.alloc.free_pages

    def free_slots(self) -> list[int]:
        return [i for i in range(self.slots) if not self.active[i]]

    def pages_needed(self, tokens: int) -> int:
        return pages_for(min(tokens, self.max_len), self.page_size)

    def can_insert(self, reserve_tokens: int) -> bool:
        """Whether a request that will hold `reserve_tokens` tokens fits in the free pages now."""
        return self.alloc.can_allocate(self.pages_needed(reserve_tokens))

    def insert(
        self,
        slot: int,
        prompt_kv: np.ndarray | Array,
        length: int,
        next_token: int,
        reserve_tokens: int = 0,
        *,
        sampling: SamplingParams = GREEDY,
        stop_tokens: Sequence[int] = (),
    ) -> None:
        """Loads a prompt's KV rows `[L, >= length, W]` into `slot`'s pages; `next_token` is fed
        next (the first generated token). Pages for `max(reserve_tokens, length + 1)` tokens are
        taken now (`PagesExhausted` if the pool has too few free). `sampling` is how `advance`
        draws the slot's tokens (`sample_at`; the default is greedy); with `sampling.min_tokens`
        it draws none of `stop_tokens` before the slot has generated that many."""
        cfg = self.runner.cfg
        self._check_insert(slot, length, next_token)
        if prompt_kv.shape[0] != cfg.num_layers or prompt_kv.shape[2] != cfg.kv_width:
            raise ValueError(
                f"prompt KV has shape {tuple(prompt_kv.shape)}, expected ({cfg.num_layers}, T, {cfg.kv_width})"
            )
        n = pages_for(length, self.page_size)
        rows = np.zeros((cfg.num_layers, n * self.page_size, cfg.kv_width), self.kv_np)
        rows[:, :length] = np.asarray(prompt_kv[:, :length])
        blocks = rows.reshape(cfg.num_layers, n, self.page_size, cfg.kv_width).transpose(1, 0, 2, 3)
        self._insert(slot, blocks, length, next_token, reserve_tokens, sampling, stop_tokens)

    def insert_blocks(
        self,
        slot: int,
        blocks: np.ndarray,
        length: int,
        next_token: int,
        reserve_tokens: int = 0,
        *,
        sampling: SamplingParams = GREEDY,
        stop_tokens: Sequence[int] = (),
    ) -> None:
        """`insert` from the prompt's KV as Full Blocks `[n, L, page_size, bytes]` uint8 (the
        store's and the DE buffer's layout, whose block size is the page size): each block
        becomes a page as it is. Tokens past `length` in the last block are ignored."""
        cfg = self.runner.cfg
        n = pages_for(length, self.page_size)
        want = (cfg.num_layers, self.page_size, cfg.kv_width * self.kv_dtype.itemsize)
        if blocks.ndim != 4 or blocks.shape[0] < n or tuple(blocks.shape[1:]) != want:
            raise ValueError(
                f"prompt blocks have shape {tuple(blocks.shape)}, expected ({n}, *{want})"
            )
        self._check_insert(slot, length, next_token)
        blocks = blocks[:n].view(self.kv_np)
        self._insert(slot, blocks, length, next_token, reserve_tokens, sampling, stop_tokens)

    def _check_insert(self, slot: int, length: int, next_token: int) -> None:
        if self.active[slot]:
            raise ValueError(f"decode slot {slot} is in use")
        if length + 1 > self.max_len:
            raise ValueError(
                f"prompt of {length} tokens does not fit a decode slot of {self.max_len}"
            )
        validate_tokens(self.runner.cfg, np.array([next_token]), "next token")

    @runs_on_mesh
    def _insert(self, slot, blocks, length, next_token, reserve_tokens, sampling, stop_tokens):
        """blocks `[n, L, page_size, W]` (kv dtype) -> the slot's first n pages."""
        held = self._held(sampling, stop_tokens, self.max_len)
        ids = self.alloc.allocate(slot, self.pages_needed(max(reserve_tokens, length + 1)))
        self.table[slot] = 0
        self.table[slot, : len(ids)] = ids
        n = blocks.shape[0]
        if n:
            nb = self._write_bucket(n)  # padded pages write the null page: few shapes
            cfg = self.runner.cfg
            padded = np.zeros((nb, cfg.num_layers, self.page_size, cfg.kv_width), self.kv_np)
            padded[:n] = blocks
            where = np.zeros((nb,), np.int32)
            where[:n] = ids[:n]
            bits = padded.view(bits_dtype(cfg.kv_dtype))
            # device_put, not jnp.asarray: that compiles a staging program per shape
            self.pages = programs.write_pages(
                self.pages, jax.device_put(where), jax.device_put(bits)
            )
        self._start(slot, length, length, next_token, sampling, held)

    def _start(self, slot, length, prompt, next_token, sampling, held) -> None:
        """Slot `slot` holds `length` tokens' KV and feeds `next_token` next; the first token it
        generates sits at position `prompt` (`held`: the stop tokens `min_tokens` holds back)."""
        self.lengths[slot] = length
        self.active[slot] = True
        self.seeds[slot] = sampling.seed
        self.temperatures[slot], self.top_ps[slot] = sampling.temperature, sampling.top_p
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(held)] = held
        # generated token k sits at position prompt + k; k < min_tokens may not be a stop token
        self.held_until[slot] = prompt + sampling.min_tokens if held else 0
        self.wants_logprobs[slot] = sampling.logprobs is not None
        self._set_pending(np.arange(self.slots) == slot, np.full((self.slots,), next_token))
        self._dirty = True

    @staticmethod
    def _held(sampling, stop_tokens, max_len) -> list[int]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {sampling!r}")
        held = sorted(set(int(t) for t in stop_tokens)) if sampling.min_tokens else []
        problem = min_tokens_problem(sampling, max_len, held)
        if problem:
            raise ValueError(problem)
        return held

    # ------------------------------------------------------------------ forks of one prompt

    def hold(self, owner, slot: int, tokens: int) -> None:
        """`owner` (a string: slots are numbers) takes a share of the pages of `slot` that hold
        its first `tokens` tokens, so they outlive the slot until `fork` (or `release`) gives
        them up: the prompt a group's other samples fork from."""
        if tokens < 1 or tokens > self.lengths[slot]:
            raise ValueError(f"cannot hold {tokens} tokens of a slot holding {self.lengths[slot]}")
        self.alloc.share(owner, self.alloc.pages(slot)[: pages_for(tokens, self.page_size)])

    def release(self, owner) -> None:
        """Gives up `owner`'s hold (`hold`); pages no slot holds return to the pool."""
        self.alloc.free(owner)

    def fork_pages(self, length: int, reserve_tokens: int) -> int:
        """New pages a fork of a `length`-token prompt takes (`fork`): the prompt's last page,
        copied, and the pages for the tokens after it."""
        shared = (length - 1) // self.page_size
        return self.pages_needed(max(reserve_tokens, length)) - shared

    def fork(
        self,
        slot: int,
        owner,
        length: int,
        last_token: int,
        reserve_tokens: int = 0,
        *,
        sampling: SamplingParams = GREEDY,
        stop_tokens: Sequence[int] = (),
    ) -> None:
        """Starts `slot` on the `length`-token prompt whose pages `owner` holds (`hold`), then
        gives up the hold. The slot shares the prompt's whole pages before its last token's
        page (nothing writes them: every slot writes at or past its own length) and copies
        that page; it holds `length - 1` tokens and feeds `last_token` (the prompt's last) at
        position `length - 1`, so its first step draws its first token from the logits there,
        at position `length` with `sampling`, as a prefill's first token is drawn. Pages for
        `max(reserve_tokens, length)` tokens are taken now (`PagesExhausted`, `fork_pages`
        new ones)."""
        held = self._held(sampling, stop_tokens, self.max_len)
        self._check_insert(slot, length - 1, last_token)
        source = self.alloc.pages(owner)
        k = (length - 1) // self.page_size  # the page of the prompt's last token
        if len(source) <= k:
            raise ValueError(f"{owner!r} holds {len(source)} pages, not a {length}-token prompt")
        new = self.fork_pages(length, reserve_tokens)
        if not self.alloc.can_allocate(new):
            raise PagesExhausted(f"{new} KV pages needed, {self.alloc.free_pages} free")
        self.alloc.share(slot, source[:k])
        own = self.alloc.allocate(slot, new)
        ids = self.alloc.pages(slot)  # in table order: the shared pages first
        self.table[slot] = 0
        self.table[slot, : len(ids)] = ids
        self._copy_page(source[k], own[0])
        self.release(owner)
        self._start(slot, length - 1, length, last_token, sampling, held)

    @runs_on_mesh
    def _copy_page(self, src: int, dst: int) -> None:
        where = np.array([src, dst], np.int32)
        self.pages = programs.copy_page(self.pages, jax.device_put(where))

    def _write_bucket(self, n: int) -> int:
        return min(bucket_len(n, 1, 64), bucket_len(self.max_pages, 1, 64))

    @property
    def kv_np(self) -> np.dtype:
        return np_dtype(self.runner.cfg.kv_dtype)

    def free(self, slot: int) -> None:
        self.active[slot] = False
        self.lengths[slot] = 0
        self.held_until[slot] = 0
        self.wants_logprobs[slot] = False
        self.alloc.free(slot)
        self.table[slot] = 0
        self._dirty = True

    def rows(self, slot: int, start: int, end: int) -> np.ndarray:
        """The slot's KV rows of tokens `start..end` `[L, end - start, W]` (numpy, kv dtype)."""
        if not 0 <= start <= end <= self.lengths[slot]:
            raise ValueError(f"rows {start}..{end} of a slot holding {self.lengths[slot]} tokens")
        ps = self.page_size
        first, last = start // ps, pages_for(end, ps)
        if last == first:
            return np.zeros((self.runner.cfg.num_layers, 0, self.runner.cfg.kv_width), self.kv_np)
        got = self._read(self.table[slot, first:last]).view(self.kv_np)  # [n, L, ps, W]
        got = got.transpose(1, 0, 2, 3).reshape(got.shape[1], -1, got.shape[-1])
        return got[:, start - first * ps : end - first * ps]

    def full_blocks(self, slot: int, first: int, end: int) -> np.ndarray:
        """Blocks `first..end` of the slot as Full Blocks `[n, L, page_size, bytes]` uint8: its
        pages as they are (the store's block size is the page size)."""
        if end * self.page_size > self.lengths[slot]:
            raise ValueError(f"block {end - 1} of slot {slot} is not full")
        return self._read(self.table[slot, first:end]).view(np.uint8)

    @runs_on_mesh
    def _read(self, ids: np.ndarray) -> np.ndarray:
        """Pages `ids` `[n, L, ps, W]` (bits) to the host, read in bucketed counts."""
        where = np.zeros((self._write_bucket(len(ids)),), np.int32)
        where[: len(ids)] = ids
        got = whole(programs.read_pages(self.pages, jax.device_put(where)), self.mesh)
        return host_value(got)[: len(ids)]

    def set_next(self, tokens: np.ndarray) -> None:
        """Sets the pending token of every active slot (`tokens` `[S]`): for callers that
        sample the logits of `step` themselves."""
        self._set_pending(self.active, np.asarray(tokens, np.int32))

    @runs_on_mesh
    def _set_pending(self, mask: np.ndarray, tokens: np.ndarray) -> None:
        self._pending = programs.merge(
            self._pending,
            copies.snapshot(mask),
            copies.snapshot(tokens.astype(np.int32, copy=False)),
        )

    def _grow(self) -> None:
        """Gives a page to every active slot whose next token starts a page it does not have."""
        ps = self.page_size
        held = (self.table != 0).sum(axis=1)  # pages each slot holds (0 is the null page)
        for slot in np.flatnonzero(self.active & (self.lengths // ps + 1 > held)):
            need = int(self.lengths[slot]) // ps + 1
            have = len(self.alloc.pages(int(slot)))
            if need > have:
                ids = self.alloc.allocate(int(slot), need - have)
                self.table[slot, have:need] = ids
                self._dirty = True

    def _columns(self, need: int) -> int:
        """Table columns a step passes: all of them for the paged kernel (one shape); for the
        dense backends up to the bucket of the longest slot (they gather that much)."""
        if self.paged_kernel:
            return self.max_pages
        bucket = min(bucket_len(need + 1, self.min_bucket), self.max_len)
        return pages_for(bucket, self.page_size)

    def _rows_for(self) -> int:
        """The slots a step runs over: the first B, B the power of two (at most `slots`) that
        holds every active slot (slots are taken lowest first, so the active ones sit at the
        front), so idle slots cost no attention; on a mesh every slot (its shards split them)."""
        top = int(np.flatnonzero(self.active)[-1]) + 1 if self.active.any() else 1
        return self._row_bucket(top)

    def _row_bucket(self, n: int) -> int:
        if self.mesh is not None:
            return self.slots
        return min(self.slots, 1 << (n - 1).bit_length())

    def _row_buckets(self) -> list[int]:
        return sorted({self._row_bucket(n) for n in range(1, self.slots + 1)})

    @runs_on_mesh
    def _run(self, width: int, steps: int = 1, rows: int | None = None):
        rows = self._rows_for() if rows is None else rows
        if self._dirty or width != self._width or rows != self._rows:
            # Snapshots, never views: insert/free/_grow change these host mirrors in place while
            # a dispatched step may still be queued (copies.snapshot).
            self._dev = {
                "table": copies.snapshot(self.table[:rows, :width]),
                "lengths": copies.snapshot(self.lengths[:rows]),
                "active": copies.snapshot(self.active[:rows]),
                "seeds": copies.snapshot(self.seeds[:rows]),
                "temps": copies.snapshot(self.temperatures[:rows]),
                "top_ps": copies.snapshot(self.top_ps[:rows]),
                "stop_ids": copies.snapshot(self.stop_ids[:rows]),
                "held_until": copies.snapshot(self.held_until[:rows]),
                "wants_logprobs": copies.snapshot(self.wants_logprobs[:rows]),
            }
            self._dirty, self._width, self._rows = False, width, rows
        d = self._dev
        args = (
            self.runner.stacked_leaves[1],
            self.pages,
            d["table"],
            d["lengths"],
            self._pending,
            d["active"],
            d["seeds"],
            d["temps"],
            d["top_ps"],
            d["stop_ids"],
            d["held_until"],
            d["wants_logprobs"],
        )
        self.lengths = self.lengths + steps * self.active  # the host mirror of d["lengths"]
        if steps > 1:
            tokens, self._pending, self.logprobs, self.pages, d["lengths"] = programs.steps_fn(
                self.runner, steps
            )(*args)
            self.logits = None
            return tokens
        logits, self._pending, self.logprobs, self.pages, d["lengths"] = programs.step_fn(
            self.runner
        )(*args)
        self.logits = logits
        return logits

    def _prepare(self) -> int:
        """Checks the step and grows pages; returns the table width it passes. Between changes
        (insert, free, page growth) a step needs no look at the slots until one of them fills
        its last page or reaches max_len: `_headroom` counts those steps, so most steps run
        only a few lines of Python here."""
        if self._headroom > 0 and not self._dirty:
            self._headroom -= 1
            self._longest += 1
            return self._columns(self._longest)
        if not self.active.any():
            raise ValueError("decode step with no active slot")
        need = int(self.lengths[self.active].max())
        if need + 1 > self.max_len:
            raise ValueError(f"a decode slot reached its max_len {self.max_len}")
        self._grow()
        # Steps after this one that write into pages the slots hold and stay within max_len.
        held = (self.table[self.active] != 0).sum(axis=1) * self.page_size
        room = held - self.lengths[self.active] - 1
        self._headroom = min(int(room.min()), self.max_len - need - 1)
        self._longest = need
        return self._columns(need)

    def step(self) -> Array:
        """Feeds each active slot's pending token; returns logits `[S, V]` (rows of idle slots are
        meaningless). Each active slot's length grows by one, and its pending token becomes the
        one the slot's sampling parameters draw (override it with `set_next`)."""
        logits = self._run(self._prepare())
        if logits.shape[0] < self.slots:  # (the step ran over the first rows: `_rows_for`)
            logits = programs.pad_rows(logits, self.slots)
        return logits

    def advance(self) -> Array:
        """`step`, returning the tokens it drew `[S]` (a device array; idle slots' entries are
        meaningless) instead of the logits: they are already the next step's pending tokens."""
        self._run(self._prepare())
        return self._pending

    def advance_many(self, steps: int) -> tuple[Array, int]:
        """Up to `steps` steps in one dispatch (multi-step decode): `steps` when every active
        slot holds the pages for them and stays within max_len, else one. Returns (the tokens
        drawn, a device array `[n, S]` (row i is step i's, as `advance` would have drawn them;
        `[S]` when n is 1), n); `self.logprobs` is their log-probabilities (`[n, S, 2]`, `[S, 2]`
        when n is 1) and the last row the next step's pending tokens. After more than one step
        there are no logits (`top_logprobs` needs single steps). A slot that is done early (a
        stop token, its last token) decodes to the end of the dispatch: its caller drops those
        tokens."""
        width = self._prepare()
        if steps > 1 and self._headroom >= steps - 1:
            self._headroom -= steps - 1
            self._longest += steps - 1
            return self._run(self._columns(self._longest), steps), steps
        self._run(width)
        return self._pending, 1

    @runs_on_mesh
    def top_logprobs(self) -> tuple[Array, Array]:
        """The model's `MAX_TOP_LOGPROBS` most likely tokens after the latest step, per slot (ids,
        log-probabilities `[S, K]`, device arrays; `sampler.top_logprobs`). The drawn tokens' own
        log-probabilities are `self.logprobs` (`[S, 2]`: under the sampling distribution and
        under the model), set by every step."""
        if self.logits is None:
            raise ValueError("no logits: the latest dispatch ran several steps (advance_many)")
        return top_logprobs(self.logits)

    @runs_on_mesh
    def warmup(self, steps: int = 1) -> int:
        """Compiles every shape this decoder runs (each table width a step may pass, each page
        count `insert` writes; with `steps` > 1 each width's `advance_many(steps)` program too)
        by running them on idle slots, which changes nothing. Returns the number of shapes.
        Afterwards a step compiles nothing new."""
        widths = (
            {self._columns(n) for n in range(self.max_len)}
            if not self.paged_kernel
            else {self.max_pages}
        )
        for rows in self._row_buckets():
            for w in sorted(widths):
                if steps > 1:
                    self._run(w, steps, rows)
                self._run(w, 1, rows)  # (last: `top_logprobs` below reads its logits)
            self.top_logprobs()
        nbs = {self._write_bucket(n) for n in range(1, self.max_pages + 1)}
        cfg = self.runner.cfg
        for nb in sorted(nbs):
            blocks = jnp.zeros((nb, cfg.num_layers, self.page_size, cfg.kv_width), self.pages.dtype)
            self.pages = programs.write_pages(self.pages, jnp.zeros((nb,), jnp.int32), blocks)
            programs.read_pages(self.pages, jnp.zeros((nb,), jnp.int32))
        self.pages = programs.copy_page(
            self.pages, jnp.zeros((2,), jnp.int32)
        )  # the null page: no-op
        self._set_pending(self.active, np.zeros((self.slots,), np.int32))
        return len(self._row_buckets()) * len(widths) * (2 if steps > 1 else 1) + len(nbs)
