"""Intra-engine scheduling (paper section 6.2): forward batches of a PE, admission of a DE.

PE: each forward batch is a list of `(cached, bsz)` pairs (the paper's `(hit_len, miss)`):
`cached` tokens of the request already have KV (storage hit or earlier chunks), `bsz` new tokens
are computed in this batch. Requests are packed FIFO while the predicted attention-layer time
stays within the compute quota; the request that would overflow is cut by binary search to the
largest `bsz'` that still fits (chunked prefill) and its remainder goes first next time. A batch
never exceeds the quota, except one made of a single request cut to one token, which must run
for the engine to make progress.

DE: every admitted request joins the decode batch; admission is FIFO by free HBM and free slots.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

AttentionTime = Callable[[Sequence[tuple[int, int]]], float]
"""Predicted attention-layer time (seconds) of a batch of `(cached, bsz)` pairs; must not
decrease when any `bsz` grows."""


class AttentionTerms(Protocol):
    """An `AttentionTime` that is a function of per-pair terms summed over the batch (the cost
    models of `sched.cost`): `attention_time(pairs) == attention_time_of(elementwise sum of
    attention_terms(c, b))`. Packing with it costs one pair per candidate, not the whole batch."""

    def attention_terms(self, cached: int, bsz: int) -> tuple[float, ...]: ...

    def attention_time_of(self, terms: Sequence[float]) -> float: ...


# The values below spell out their `__init__` (`init=False`): the compiled core compiles a
# written one and would run a generated one as interpreted code (see `sched.types`).


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class PendingPrefill:
    """What is left to prefill of one request on a PE: `new` tokens after `cached` ones.

    `then_cached` / `then_new` (0: none): a second range the request computes once this one is
    done, `then_new` tokens after `then_cached` (a request that recomputes the leading part of
    its hit computes `[0, lead)` first, then its new tokens after the whole hit, the loaded
    middle joining the two). The second range goes to the head of the queue when the first
    finishes; it is never in the same batch."""

    request_id: str
    cached: int
    new: int
    then_cached: int
    then_new: int

    def __init__(
        self, request_id: str, cached: int, new: int, then_cached: int = 0, then_new: int = 0
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "cached", cached)
        object.__setattr__(self, "new", new)
        object.__setattr__(self, "then_cached", then_cached)
        object.__setattr__(self, "then_new", then_new)
        if self.cached < 0 or self.new < 1:
            raise ValueError(f"{self.request_id}: need cached >= 0 and new >= 1, got {self}")
        if then_new < 0 or (then_new and then_cached < cached + new):
            raise ValueError(
                f"{self.request_id}: a second range must start at or after the first one's end,"
                f" got {self}"
            )

    def then(self) -> PendingPrefill | None:
        """The second range, once this one is computed (None: the request is done)."""
        if not self.then_new:
            return None
        return PendingPrefill(self.request_id, self.then_cached, self.then_new)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class PrefillChunk:
    """One request's part of a forward batch: compute `bsz` tokens after `cached` ones."""

    request_id: str
    cached: int
    bsz: int

    def __init__(self, request_id: str, cached: int, bsz: int) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "cached", cached)
        object.__setattr__(self, "bsz", bsz)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class BatchPlan:
    """One forward batch. `taken`: queue items finished by it (all chunks, except a cut last one);
    `rest`: the cut request's remainder, to be put at the head of the queue; `predicted_s`: the
    attention-layer time of the batch under the cost model; `then`: the second ranges of taken
    items that have one (`PendingPrefill.then`), in batch order, to go to the head of the queue
    (before `rest`)."""

    chunks: tuple[PrefillChunk, ...]
    taken: int
    rest: PendingPrefill | None
    predicted_s: float
    then: tuple[PendingPrefill, ...]

    def __init__(
        self,
        chunks: tuple[PrefillChunk, ...],
        taken: int,
        rest: PendingPrefill | None,
        predicted_s: float,
        then: tuple[PendingPrefill, ...] = (),
    ) -> None:
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "taken", taken)
        object.__setattr__(self, "rest", rest)
        object.__setattr__(self, "predicted_s", predicted_s)
        object.__setattr__(self, "then", then)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple((c.cached, c.bsz) for c in self.chunks)

    def finishes(self, request_id: str) -> bool:
        """Whether this batch computes the request's last prompt token."""
        if self.rest is not None and self.rest.request_id == request_id:
            return False
        return not any(x.request_id == request_id for x in self.then)


class _Packer:
    """The running state of one `pack_prefill_batch` (an object rather than closures, which
    would make a reference cycle per batch)."""

    def __init__(
        self,
        attention_time: AttentionTime,
        quota_s: float,
        max_tokens: int,
        max_kv_tokens: int,
        terms: AttentionTerms | None,
    ):
        self.attention_time, self.quota_s = attention_time, quota_s
        self.max_tokens, self.max_kv_tokens, self.terms = max_tokens, max_kv_tokens, terms
        self.pairs: list[tuple[int, int]] = []
        self.chunks: list[PrefillChunk] = []
        self.tokens = 0
        self.kv = 0  # context tokens held by the batch so far
        self.acc: tuple[float, ...] = ()  # summed terms of `pairs`
        if terms is not None:
            self.term_of, self.time_of = terms.attention_terms, terms.attention_time_of

    def time_with(self, cached: int, bsz: int) -> float:
        """The batch's attention time with `(cached, bsz)` added (`terms` only)."""
        t = self.term_of(cached, bsz)
        acc = self.acc
        return self.time_of(tuple(map(operator.add, acc, t)) if acc else t)

    def fits(self, cached: int, bsz: int) -> bool:
        if self.max_tokens and self.tokens + bsz > self.max_tokens:
            return False
        if self.max_kv_tokens and self.chunks and self.kv + cached + bsz > self.max_kv_tokens:
            return False
        if self.terms is not None:
            return self.time_with(cached, bsz) <= self.quota_s
        return self.attention_time([*self.pairs, (cached, bsz)]) <= self.quota_s

    def add(self, request_id: str, cached: int, bsz: int) -> None:
        self.chunks.append(PrefillChunk(request_id, cached, bsz))
        self.pairs.append((cached, bsz))
        if self.terms is not None:
            t = self.term_of(cached, bsz)
            acc = self.acc
            self.acc = tuple(map(operator.add, acc, t)) if acc else t
        self.tokens += bsz
        self.kv += cached + bsz


def pack_prefill_batch(
    queue: Iterable[PendingPrefill],
    attention_time: AttentionTime,
    quota_s: float,
    *,
    max_requests: int = 0,
    max_tokens: int = 0,
    max_kv_tokens: int = 0,
    terms: AttentionTerms | None = None,
) -> BatchPlan:
    """FIFO packing under the compute quota with a binary-search cut of the overflowing request.

    `max_requests` / `max_tokens` (0: no limit) cap the batch's requests / new tokens as well;
    `max_kv_tokens` (0: no limit) caps the context the batch holds on the device, the sum of
    `cached + bsz` over its chunks (a PE's HBM for KV: all layers without layerwise prefill,
    one layer with it). The first chunk of a batch is not held to it: a lone request always
    runs, whatever its context.
    `terms`: the same cost as `attention_time` in additive form (optional; same plan, cheaper).
    """
    p = _Packer(attention_time, quota_s, max_tokens, max_kv_tokens, terms)
    chunks = p.chunks
    rest: PendingPrefill | None = None
    then: list[PendingPrefill] = []
    taken = 0
    for item in queue:
        if max_requests and len(chunks) >= max_requests:
            break
        if p.fits(item.cached, item.new):
            bsz = item.new
        elif terms is not None:
            hi = item.new - 1
            if max_tokens:
                hi = max(0, min(hi, max_tokens - p.tokens))
            if max_kv_tokens and chunks:
                hi = max(0, min(hi, max_kv_tokens - p.kv - item.cached))
            bsz = _largest_fitting(hi, functools.partial(p.time_with, item.cached), quota_s)
            if bsz == 0:
                if chunks:
                    break
                bsz = 1  # a lone request still makes progress
        else:
            lo, hi = 0, item.new - 1  # lo fits (or is 0), hi + 1 does not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if p.fits(item.cached, mid):
                    lo = mid
                else:
                    hi = mid - 1
            bsz = lo
            if bsz == 0:
                if chunks:
                    break
                bsz = 1  # a lone request still makes progress
        p.add(item.request_id, item.cached, bsz)
        if bsz < item.new:
            rest = PendingPrefill(
                item.request_id, item.cached + bsz, item.new - bsz, item.then_cached, item.then_new
            )
            break
        taken += 1
        nxt = item.then()
        if nxt is not None:
            then.append(nxt)
    if not p.pairs:
        predicted = 0.0
    elif terms is not None:
        predicted = terms.attention_time_of(p.acc)
    else:
        predicted = attention_time(p.pairs)
    return BatchPlan(tuple(chunks), taken, rest, predicted, tuple(then))


def _largest_fitting(hi: int, time_of: Callable[[int], float], quota_s: float) -> int:
    """The largest `b` in `[0, hi]` with `time_of(b) <= quota_s` (0 if none) for a nondecreasing
    `time_of`: the binary search's answer, found by secant steps through the last two points
    (kept inside the bracket; a guess that fits is probed one above, where smooth costs usually
    end), then by halving if eight steps were not enough."""
    f_lo = time_of(0)
    if f_lo > quota_s:
        return 0
    f_up = time_of(hi + 1)
    if f_up <= quota_s:
        return hi
    lo, up = 0, hi + 1  # f_lo <= quota_s < f_up
    x1, f1, x2, f2 = lo, f_lo, up, f_up  # the last two points evaluated
    steps = 0
    while up - lo > 1:
        steps += 1
        if steps <= 8 and f2 != f1:
            g = int(x2 + (quota_s - f2) * (x2 - x1) / (f2 - f1))
            g = min(max(g, lo + 1), up - 1)
        else:
            g = (lo + up) // 2
        f = time_of(g)
        x1, f1, x2, f2 = x2, f2, g, f
        if f > quota_s:
            up = g
            continue
        lo = g
        if steps <= 8 and up - lo > 1:
            f = time_of(lo + 1)
            if f > quota_s:
                return lo
            lo = lo + 1
            x1, f1, x2, f2 = x2, f2, lo, f
    return lo


def batch_kv_bound(device_kv_tokens: int, num_layers: int, layerwise: bool) -> int:
    """`pack_prefill_batch`'s `max_kv_tokens` for a PE whose device holds `device_kv_tokens`
    tokens of KV (all layers; 0: unbounded): without layerwise prefill a batch keeps every layer
    of its context resident, with it one layer at a time."""
    return device_kv_tokens * num_layers if device_kv_tokens and layerwise else device_kv_tokens


class PrefillQueue:
    """A PE's FIFO of pending prefills; `next_batch` plans one batch and keeps a cut request's
    remainder at the head. The only state is the deque."""

    def __init__(self) -> None:
        self._q: collections.deque[PendingPrefill] = collections.deque()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, item: PendingPrefill) -> None:
        self._q.append(item)

    def remove(self, request_id: str) -> None:
        """Drops a request's pending prefill (it was cancelled)."""
        self._q = collections.deque(x for x in self._q if x.request_id != request_id)

    def next_batch(
        self,
        attention_time: AttentionTime,
        quota_s: float,
        *,
        max_requests: int = 0,
        max_tokens: int = 0,
        max_kv_tokens: int = 0,
        terms: AttentionTerms | None = None,
    ) -> BatchPlan:
        plan = pack_prefill_batch(
            self._q,
            attention_time,
            quota_s,
            max_requests=max_requests,
            max_tokens=max_tokens,
            max_kv_tokens=max_kv_tokens,
            terms=terms,
        )
        for _ in range(plan.taken):
            self._q.popleft()
        if plan.rest is not None:
            self._q.popleft()
            self._q.appendleft(plan.rest)
        for item in reversed(plan.then):
            self._q.appendleft(item)
        return plan


def admit_decode(
    waiting: Iterable[tuple[str, int]], *, free_hbm_tokens: int, free_slots: int
) -> tuple[str, ...]:
    """DE admission: FIFO over `(request id, KV tokens needed)`; stops at the first request that
    does not fit the free HBM or slots (no overtaking, so large requests do not starve)."""
    out = []
    for rid, need in waiting:
        if free_slots <= 0 or need > free_hbm_tokens:
            break
        out.append(rid)
        free_slots -= 1
        free_hbm_tokens -= need
    return tuple(out)
