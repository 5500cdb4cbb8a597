"""`InProcessBackend(model, slots=S)` with S > 1: the rounds submitted meanwhile run together.

A worker thread takes the queued rounds in order while the decoder has free slots (a group of
G samples takes G; at most `MAX_PREFILL` rounds, `MAX_PREFILL_TOKENS` appended tokens), prefills
them in one batch (packed where that pays, model/packing.py, each
request over its own cached KV in pages), draws each first token, and decodes every live round
in one `Decoder` of S slots, one step for all; a round leaves when it has its tokens or drew a
stop token, its session's context and KV updated, its future answered. A group's samples fork
the first one's prompt pages (`Decoder.hold` / `fork`), as `submit_group` does with one slot.
Tokens are drawn as with one slot (`sample_at`: keyed by position, the same tokens for the same
seeds; greedy ones equal up to float ties between differently shaped batches).

A session takes one round at a time (another one submitted meanwhile is refused); `close()`
ends the rounds still queued or decoding with kind `engine`; `abort`, `finish` and `cancel` end
one round (or several) early, as a cluster's client does. A params
update waits for the step in progress; rounds in flight go on with the new params, and a round
that saw the update leaves its session without cached KV (the next round recomputes it).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from concurrent import futures

import numpy as np

from dualpath_jax.model.page_pool import pages_for
from dualpath_jax.model.sampling_params import SamplingParams, held_back
from dualpath_jax.results import Logprobs, RoundResult
from dualpath_jax.wire.client import RolloutError

log = logging.getLogger(__name__)

PAGE = 16  # tokens per page of a prefill batch's cached KV
DECODE_PAGE = 64  # tokens per page of the decoder's pool
MAX_PREFILL = 8  # rounds per prefill batch
MAX_PREFILL_TOKENS = 4096  # their appended tokens (a longer round alone goes on)


@dataclasses.dataclass
class Job:
    """One submitted round, or a group of rounds over one context (`sessions`)."""

    sessions: list[str]
    append: list[int]
    gen: int
    samplings: list[SamplingParams]
    stop_tokens: tuple[int, ...]
    futures: list[futures.Future]
    ids: list[str] = dataclasses.field(default_factory=list)  # its rounds' request ids
    prompt: int = 0  # its prompt's tokens (context + append)
    t_submit: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class Live:
    """One sample decoding in a slot."""

    job: Job
    i: int  # its index in the job
    prompt: list[int]
    context: int  # the session's context before the round
    cached: int
    version: str  # the params it started with
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: Logprobs | None = None
    t_first: float = 0.0
    t_second: float = 0.0
    aborted: bool = False  # (`BatchLoop.abort`)
    finish_asked: bool = False  # (`BatchLoop.finish`: it ends once it has a token)

    def __post_init__(self) -> None:
        self.logprobs = Logprobs() if self.sampling.logprobs is not None else None

    @property
    def sampling(self) -> SamplingParams:
        return self.job.samplings[self.i]

    def stopped(self) -> bool:
        stops = self.job.stop_tokens
        return bool(self.out) and self.out[-1] in stops and len(self.out) > self.sampling.min_tokens

    def done(self) -> bool:
        return (
            len(self.out) >= self.job.gen
            or self.stopped()
            or (self.finish_asked and bool(self.out))
        )

    def finish_reason(self) -> str:
        if self.aborted:
            return "abort"
        if self.stopped():
            return "stop"
        return "finished" if self.finish_asked and len(self.out) < self.job.gen else "length"


class BatchLoop:
    """The worker of an `InProcessBackend` with `slots` > 1 (module docstring)."""

    def __init__(self, engine, slots: int, kv_tokens: int = 0):
        self.engine, self.slots = engine, slots
        self.max_len = min(engine.max_len, engine.cfg.max_seq_len)
        # the decoder's KV pool (pages of PAGE_SIZE tokens): kv_tokens, or every slot full
        self.num_pages = pages_for(kv_tokens or slots * self.max_len, DECODE_PAGE)
        self.queue: collections.deque[Job] = collections.deque()
        self.busy: set[str] = set()  # sessions with a round queued or live
        self.live: dict[int, Live] = {}  # slot -> its sample
        self.finish_asked: set[str] = set()  # queued rounds `finish` ended before they started
        self.cond = threading.Condition()
        self.closed = False
        self.dec = None
        self.thread = threading.Thread(target=self._run, name="inprocess-batch", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closed:
                raise RolloutError("the engine was closed", "engine")
            taken = [s for s in job.sessions if s in self.busy]
            if taken:
                raise RolloutError(f"session {taken[0]!r} has a round running", "bad_request")
            if len(job.sessions) > self.slots:
                raise RolloutError(
                    f"a group of {len(job.sessions)} samples needs as many decode slots; the"
                    f" engine has {self.slots}",
                    "bad_request",
                )
            if self._pages(job) > self.num_pages:
                raise RolloutError(
                    f"{job.prompt} + {job.gen} tokens x {len(job.sessions)} samples exceed the"
                    f" engine's KV budget of {self.num_pages * DECODE_PAGE} tokens (kv_tokens)",
                    "bad_request",
                )
            self.busy.update(job.sessions)
            self.queue.append(job)
            self.cond.notify()

    def abort(self, requests: set[str], sessions: set[str], every: bool) -> list[str]:
        """Ends the rounds of `requests` or `sessions` (or `every` one) now with the tokens they
        have (`finish_reason` "abort"): a decoding one with its tokens so far, a queued one (a
        group as a whole) with none; either way its append and tokens join its session's
        context. Waits for the step in progress; returns the request ids ended."""

        def hit(job: Job, k: int) -> bool:
            return every or job.ids[k] in requests or job.sessions[k] in sessions

        with self.engine._run_lock:
            with self.cond:
                queued = [j for j in self.queue if any(hit(j, k) for k in range(len(j.ids)))]
                for job in queued:
                    self.queue.remove(job)
            ended = []
            for job in queued:
                ended += job.ids
                self._end_unstarted(job)
            for slot, lv in list(self.live.items()):
                if hit(lv.job, lv.i):
                    lv.aborted = True
                    ended.append(lv.job.ids[lv.i])
                    self._finish(slot)
            return ended

    def cancel(self, request: str) -> None:
        """Abandons round `request`: its future fails with kind "cancelled" and its session
        keeps the context it had (a queued sample of a group leaves the group). Waits for the
        step in progress; an unknown or finished round is ignored."""
        err = RolloutError(f"round {request} cancelled by the client", "cancelled")
        with self.engine._run_lock:
            with self.cond:
                fut = self._unqueue(request)
            if fut is None:
                slot = next((s for s, lv in self.live.items() if lv.job.ids[lv.i] == request), -1)
                if slot < 0:
                    return
                lv = self.live.pop(slot)
                self.dec.free(slot)
                with self.cond:
                    self.busy.discard(lv.job.sessions[lv.i])
                fut = lv.job.futures[lv.i]
            fut.set_exception(err)

    def _unqueue(self, request: str) -> futures.Future | None:
        """Takes round `request` out of its queued job (under `cond`); returns its future."""
        for job in self.queue:
            if request in job.ids:
                k = job.ids.index(request)
                self.busy.discard(job.sessions[k])
                for field in (job.sessions, job.samplings, job.ids):
                    field.pop(k)
                if not job.sessions:
                    self.queue.remove(job)
                return job.futures.pop(k)
        return None

    def finish(self, request: str) -> None:
        """Ends round `request` now with the tokens it has (`finish_reason` "finished"): a
        decoding one at once (a fork waiting for its first token after it), a queued one once
        its first token is drawn. Its tokens join the session's context."""
        with self.engine._run_lock:
            for slot, lv in list(self.live.items()):
                if lv.job.ids[lv.i] == request:
                    lv.finish_asked = True
                    if lv.out:
                        self._finish(slot)
                    return
            with self.cond:
                if any(request in job.ids for job in self.queue):
                    self.finish_asked.add(request)

    def queued(self) -> int:
        """Rounds waiting for decode slots (a group's samples each)."""
        with self.cond:
            return sum(len(job.ids) for job in self.queue)

    def _end_unstarted(self, job: Job) -> None:
        """An aborted round that had not started: no tokens; its append joins the context."""
        e, now = self.engine, time.monotonic()
        for k, session in enumerate(job.sessions):
            prompt = 0
            with e._lock:
                got = e._sessions.get(session)
                if got is not None:
                    e._sessions[session] = (got[0] + job.append, got[1])
                    prompt = len(got[0]) + len(job.append)
            with self.cond:
                self.busy.discard(session)
            job.futures[k].set_result(
                RoundResult.timed(
                    job.ids[k], [], t_submit=job.t_submit, t_assign=now, t_first=now,
                    t_second=math.nan, t_done=now, cached_tokens=0, prompt_tokens=prompt,
                    read_path="none", finish_reason="abort",
                )
            )  # fmt: skip

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(30)

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not self.queue and not self.live:
                    self.cond.wait()
                if self.closed:  # what is queued or decoding ends here
                    for job in [*self.queue, *(lv.job for lv in self.live.values())]:
                        self._fail(job, RolloutError("the engine was closed", "engine"))
                    self.queue.clear()
                    self.live.clear()
                    return
            with self.engine._run_lock:  # a params update, abort or cancel waits for this turn
                with self.cond:  # (taken under the turn: a cancel finds a round queued or live)
                    jobs = self._take()
                try:
                    if jobs:
                        self._start(jobs)
                    if self.live:
                        self._step()
                except Exception as e:  # noqa: BLE001 - every round in flight learns of it
                    log.exception("in-process batch failed")
                    for job in jobs + [lv.job for lv in self.live.values()]:
                        self._fail(job, RolloutError(f"{type(e).__name__}: {e}", "engine"))
                    self.live.clear()
                    self.dec = None

    def _pages(self, job: Job) -> int:
        """The KV pages `job`'s samples take: the first one's prompt and tokens, each fork its
        own after the prompt's whole pages (the decoder's `pages_needed`, `fork_pages`)."""
        dec, need = self._decoder(), job.prompt + job.gen
        return dec.pages_needed(need) + (len(job.sessions) - 1) * dec.fork_pages(job.prompt, need)

    def _take(self) -> list[Job]:
        """The queued jobs to start now, in order: while slots, KV pages and the prefill
        batch's bounds allow."""
        free, tokens = self.slots - len(self.live), 0
        pages = self._decoder().free_pages
        jobs: list[Job] = []
        while self.queue and len(jobs) < MAX_PREFILL and len(self.queue[0].sessions) <= free:
            job = self.queue[0]
            tokens += len(job.append)
            need = self._pages(job)
            if jobs and tokens > MAX_PREFILL_TOKENS or need > pages:
                break
            self.queue.popleft()
            free -= len(job.sessions)
            pages -= need
            jobs.append(job)
        return jobs

    def _decoder(self):
        from dualpath_jax.model.decode import Decoder

        if self.dec is None:
            e = self.engine
            self.dec = Decoder(
                e.runner, self.slots, self.max_len, page_size=DECODE_PAGE, num_pages=self.num_pages
            )
        return self.dec

    def _start(self, jobs: list[Job]) -> None:
        """Prefills `jobs` in one batch and starts their samples in free slots."""
        from dualpath_jax.model.cached_kv import LayerPages
        from dualpath_jax.model.runner import PrefillBatch

        e, cfg = self.engine, self.engine.cfg
        ready = []
        with e._lock:
            for job in jobs:
                got = e._sessions.get(job.sessions[0])
                missing = [s for s in job.sessions if s not in e._sessions]
                if missing:
                    self._fail(job, RolloutError(f"unknown session {missing[0]!r}", "bad_request"))
                    continue
                context, kv = got
                prompt = context + job.append
                if len(prompt) + job.gen > e.max_len:
                    self._fail(job, RolloutError(
                        f"context of {len(prompt)} + {job.gen} tokens exceeds the limit of"
                        f" {e.max_len}", "bad_request"))  # fmt: skip
                    continue
                ready.append((job, context, prompt, kv, e.params_version))
        if not ready:
            return
        cached = [0 if kv is None else kv.shape[1] for _, _, _, kv, _ in ready]
        try:
            batch = PrefillBatch.build(
                cfg, [p[c:] for (_, _, p, _, _), c in zip(ready, cached)], cached,
                e.runner.min_bucket,
            )  # fmt: skip
        except ValueError as err:
            for job, *_ in ready:
                self._fail(job, RolloutError(str(err), "bad_request"))
            return
        empty = np.zeros((0, cfg.kv_width), np.dtype(cfg.kv_dtype))

        def load_layer(i: int) -> LayerPages:
            rows = [empty if kv is None else kv[i] for _, _, _, kv, _ in ready]
            return LayerPages.from_rows(rows, PAGE, cfg.kv_width, cfg.kv_dtype,
                                        pad_to_table=e.runner.gathers_pages)  # fmt: skip

        new: dict[int, object] = {}
        res = e.runner.prefill_layerwise(
            batch, load_layer if batch.c_pad else None, new.__setitem__
        )
        layers = [np.asarray(new[i]) for i in range(cfg.num_layers)]
        last = np.asarray(res.last_logits)
        dec = self._decoder()
        free = dec.free_slots()
        for b, ((job, context, prompt, kv, version), c) in enumerate(zip(ready, cached)):
            n = len(prompt) - c
            prompt_kv = np.stack([layers[i][b, :n] for i in range(cfg.num_layers)])
            if kv is not None:
                prompt_kv = np.concatenate([kv, prompt_kv], axis=1)
            lives = [
                Live(job, i, prompt, len(context), c if i == 0 else len(prompt) - 1, version)
                for i in range(len(job.sessions))
            ]
            with self.cond:
                for lv in lives:
                    lv.finish_asked = job.ids[lv.i] in self.finish_asked
                    self.finish_asked.discard(job.ids[lv.i])
            first = self._draw(last[b : b + 1], [lives[0]])[0]
            slots = [free.pop(0) for _ in lives]
            reserve = len(prompt) + job.gen
            dec.insert(slots[0], prompt_kv, len(prompt), first, reserve)
            for k in range(1, len(lives)):  # each fork draws its first token next step
                owner = f"fork:{id(job)}:{k}"
                dec.hold(owner, slots[0], len(prompt))
                dec.fork(slots[k], owner, len(prompt), prompt[-1], reserve)
            self.live.update(zip(slots, lives))
            self._note(lives[0], first)
        self._finish_done()

    def _draw(self, logits: np.ndarray, lives: list[Live]) -> list[int]:
        """Each sample's next token from its row of `logits` (`sample_at`, host side)."""
        from dualpath_jax.model.sampler import sample_at

        stops = [lv.job.stop_tokens for lv in lives]
        tokens, entries = sample_at(
            logits,
            [lv.sampling for lv in lives],
            [len(lv.prompt) + len(lv.out) for lv in lives],
            [held_back(lv.sampling, s, len(lv.out)) for lv, s in zip(lives, stops)],
            logprobs=True,
        )
        for lv, got in zip(lives, entries):
            if lv.logprobs is not None:
                lv.logprobs.extend(got)
        return [int(t) for t in tokens]

    @staticmethod
    def _note(lv: Live, token: int) -> None:
        lv.out.append(token)
        now = time.monotonic()
        if len(lv.out) == 1:
            lv.t_first = lv.t_second = now
        elif len(lv.out) == 2:
            lv.t_second = now

    def _step(self) -> None:
        """One decode step of every live sample."""
        dec = self.dec
        logits = np.asarray(dec.step())
        slots = sorted(self.live)
        lives = [self.live[s] for s in slots]
        for lv, token in zip(lives, self._draw(logits[slots], lives)):
            self._note(lv, token)
        nxt = np.zeros((self.slots,), np.int32)
        for s, lv in zip(slots, lives):
            nxt[s] = lv.out[-1]
        dec.set_next(nxt)
        self._finish_done()

    def _finish_done(self) -> None:
        for slot in [s for s, lv in self.live.items() if lv.done()]:
            self._finish(slot)

    def _finish(self, slot: int) -> None:
        """Slot `slot`'s sample leaves: its session takes its tokens (and their KV), its future
        its result."""
        e, dec = self.engine, self.dec
        lv = self.live.pop(slot)
        job, session = lv.job, lv.job.sessions[lv.i]
        with e._lock:
            if session in e._sessions:
                fresh = lv.version == e.params_version  # (else its KV is stale)
                kv = dec.rows(slot, 0, len(lv.prompt) + len(lv.out) - 1) if fresh else None
                e._sessions[session] = (lv.prompt + lv.out, kv)
        dec.free(slot)
        with self.cond:
            self.busy.discard(session)
        now = time.monotonic()
        job.futures[lv.i].set_result(
            RoundResult.timed(
                job.ids[lv.i],
                lv.out,
                t_submit=job.t_submit,
                t_assign=job.t_submit,
                t_first=lv.t_first or now,  # (a fork aborted before its first token)
                t_second=lv.t_second or now,
                t_done=now,
                cached_tokens=lv.cached,
                prompt_tokens=len(lv.prompt),
                read_path="none" if lv.i == 0 else "fork",
                finish_reason=lv.finish_reason(),
                logprobs=lv.logprobs,
            )
        )

    def _fail(self, job: Job, err: RolloutError) -> None:
        with self.cond:
            self.busy.difference_update(job.sessions)
        for f in job.futures:
            if not f.done():
                f.set_exception(err)
