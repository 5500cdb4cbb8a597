"""Continuous batched decode on a simulated DE, one event per span of steps.

A DE's active requests advance one token per step of `cost.decode_step_time(batch, mean
context)`. Admission is `sched.intra.admit_decode` (FIFO under free HBM tokens and slots), as
in the real DE. With `macro_steps` a batch whose members cannot change advances up to its next
finishing request in one event (a span), each step timed at the span's mean context; an
admission cuts the span after the step in progress. Tokens are counted lazily on the engine
(`state.SimEngine`): a request's last step goes on the `finish` heap when it is admitted and
its second token is stamped when the span's first step ends.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator

from dualpath_jax.sched.cost import CostModel
from dualpath_jax.sched.intra import admit_decode
from dualpath_jax.sim.core import EventLoop
from dualpath_jax.sim.leaders import Leader
from dualpath_jax.sim.state import RoundState, SimEngine


class DecodeSteps:
    """Admits requests waiting on a DE and runs its decode steps. `decoded(de, st)` is called
    when a request's last token is out; its HBM is free again by then. `leaders` (DE leader id
    -> `Leader`) are told when their engine starts a span and checked when it ends, as the real
    loop checks between steps (empty: no leader timing)."""

    def __init__(
        self,
        loop: EventLoop,
        cost: CostModel,
        decoded: Callable[[SimEngine, RoundState], object],
        *,
        macro_steps: bool = True,
        leaders: dict[int, Leader] | None = None,
        fetch_interval_s: float = 0.0,
    ):
        self.loop, self.cost, self.decoded = loop, cost, decoded
        self.macro_steps = macro_steps
        self.leaders = leaders or {}
        self.fetch_interval_s = fetch_interval_s
        self._admitted = itertools.count()

    def admit(self, de: SimEngine) -> None:
        """Admits what fits of `de.waiting` (in order) and starts stepping if idle."""
        if not de.waiting:
            return
        ids = admit_decode(
            _needs(de.waiting),
            free_hbm_tokens=de.hbm_tokens - de.hbm_used,
            free_slots=de.slots - len(de.active),
        )
        if ids and de.stepping:
            self._cut_span(de)
        for _ in ids:
            st = de.waiting.popleft()
            if st.generated >= st.request.gen_tokens:
                self.decoded(de, st)
            else:
                de.hbm_used += st.request.hbm_tokens
                k = next(self._admitted)
                # the next step that starts
                first = de.steps + (de.span[2] + 1 if de.stepping else 1)
                de.active[k] = st
                de.ctx_sum += st.request.prompt_tokens + st.generated
                heapq.heappush(de.finish, (first + st.request.gen_tokens - st.generated - 1, k))
                if st.generated == 1:
                    de.seconds.setdefault(first, []).append(st)
        if de.active and not de.stepping:
            self._step(de)

    def step_end_after(self, de: SimEngine, t: float) -> float:
        """The first end of a step of `de`'s current span at or after `t` (the span's last step
        end when `t` is beyond it). `de` must be stepping."""
        t0, dt, k = de.span
        if dt <= 0:
            return t
        j = max(1, math.ceil((t - t0) / dt - 1e-9))
        return t0 + min(j, k) * dt

    def _step(self, de: SimEngine) -> None:
        leader = self.leaders.get(de.id)
        if leader is not None:
            leader.went_busy(self.loop.now)
        n = de.batch_n = len(de.active)
        de.stepping = True
        k = max(1, de.finish[0][0] - de.steps) if self.macro_steps else 1
        dt = self.cost.decode_step_time(n, int(de.ctx_sum / n + (k - 1) / 2))
        de.span = (self.loop.now, dt, k)
        de.span_event = self.loop.after(dt * k, self._step_end, de)

    def _cut_span(self, de: SimEngine) -> None:
        """A request is admitted mid-span: the span ends with the step in progress."""
        t0, dt, k = de.span
        if k == 1:
            return
        m = min(k, int((self.loop.now - t0) / dt) + 1) if dt > 0 else 1
        if m < k:
            assert de.span_event is not None
            de.span_event.cancel()
            # the first m steps, timed at their own mean context (ending no earlier than now)
            dt = self.cost.decode_step_time(de.batch_n, int(de.ctx_sum / de.batch_n + (m - 1) / 2))
            dt = max(dt, (self.loop.now - t0) / m)
            de.span = (t0, dt, m)
            de.span_event = self.loop.at(t0 + m * dt, self._step_end, de)

    def _step_end(self, de: SimEngine) -> None:
        """One token per step for every request of the span; O(requests finishing) per span."""
        t0, dt, k = de.span
        de.steps += k
        step = de.steps
        de.ctx_sum += de.batch_n * k
        seconds = de.seconds.pop(step - k + 1, None)  # joins happen only at span starts
        if seconds:
            for st in seconds:
                st.t_second = t0 + dt
        fin = de.finish
        while fin and fin[0][0] <= step:
            st = de.active.pop(heapq.heappop(fin)[1])
            st.generated = st.request.gen_tokens
            de.ctx_sum -= st.request.prompt_tokens + st.generated
            de.hbm_used -= st.request.hbm_tokens
            self.decoded(de, st)
        de.stepping = False
        # The leader loop's check at a step end (a fetch the group needs is pending).
        leader = self.leaders.get(de.id)
        if leader is not None:
            leader.loop_check(self.loop.now, self.fetch_interval_s)
        if de.waiting:
            self.admit(de)
        if de.active and not de.stepping:
            self._step(de)


def _needs(waiting: Iterable[RoundState]) -> Iterator[tuple[str, int]]:
    """`(request id, KV tokens)` of the waiting rounds, lazily (admission reads only a head)."""
    for s in waiting:
        yield s.request.id, s.request.hbm_tokens
