"""The state of one `run_trajectories` call and the small steps that move it (`Replay`).

A trajectory starts (at its arrival, or after the round of another it starts after), opens its
session and readies its first round; a ready round goes once the trajectories it waits for
have ended and its gap has passed (on a timer; with `tool_calls` the gap gets a `tool_call`
hint as it begins); a round's answer readies the next round, and the last one ends the
trajectory, which releases the rounds waiting for it and starts the trajectories due after it.
Callbacks run on the backend's threads; closing a session and hinting wait for the backend's
answer, so they run on a helper thread of their own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from dualpath_jax.results import RoundResult
from dualpath_jax.rollout.schedule import Schedule
from dualpath_jax.rollout.session import Session
from dualpath_jax.wire.backend import Backend
from dualpath_jax.workload.trace import Trajectory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrajectoryOutput:
    """One trajectory's outcome: each round's generated tokens and `RoundResult`, in order;
    `error`: why it ended early ("" when every round ran)."""

    id: str
    rounds: list[list[int]]
    results: list[RoundResult]
    error: str = ""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What every round and session of a call gets (`run_trajectories`' keywords)."""

    temperature: float = 0.0
    key: Any = None
    top_p: float = 1.0
    logprobs: bool | int = False
    stop_tokens: Sequence[int] = ()
    priorities: Sequence[int] = ()  # one per trajectory
    ttl_s: float = -1.0
    release: bool = False
    tool_calls: bool = False
    max_concurrent: int = 0

    def round_key(self, k: int, i: int) -> Any:
        """Round i of trajectory k is sampled with `fold_in(fold_in(key, k), i)`."""
        import jax

        return None if self.key is None else jax.random.fold_in(jax.random.fold_in(self.key, k), i)


class Replay:
    """One call's run (module docstring). Lifecycle: made over checked trajectories and their
    `Schedule`, then `run` once; it returns one `TrajectoryOutput` per trajectory."""

    def __init__(
        self,
        backend: Backend,
        trajs: Sequence[Trajectory],
        schedule: Schedule,
        opts: RunOptions,
        progress: bool,
    ):
        from tqdm.auto import tqdm

        self.backend, self.trajs, self.schedule, self.opts = backend, trajs, schedule, opts
        self.outputs = [TrajectoryOutput(t.id, [], []) for t in trajs]
        self.spawns = {at: list(c) for at, c in schedule.spawns.items()}  # (taken as they go)
        self.ended: list[float | None] = [None] * len(trajs)  # when each ended (monotonic s)
        self.waiting: dict[int, list[tuple[int, int]]] = {}  # k -> rounds waiting for its end
        self.pending: dict[tuple[int, int], list] = {}  # (k, i) -> [ends awaited, ready at]
        self.sessions: dict[int, Session] = {}
        self.lock = threading.Lock()
        self.limit = threading.Semaphore(opts.max_concurrent or max(1, len(trajs)))
        self.remaining = len(trajs)
        self.done_all = threading.Event()
        self.stopped = threading.Event()  # timed out: no new round starts, late ones dropped
        self.timers: list[threading.Timer] = []
        # Closing blocks on the backend's answer: never on its thread (the callbacks').
        self.closer = futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-close")
        total = sum(len(t.rounds) for t in trajs)
        self.bar = tqdm(total=total, desc="rounds", disable=not progress, unit="round")

    # ------------------------------------------------------------------ the call

    def run(self, arrivals: Sequence[float] | None, timeout_s: float | None) -> list:
        """Starts every trajectory at its arrival (those due after another's round when
        that round ends), waits until all ended or `timeout_s` passed, closes what is open."""
        t0 = time.monotonic()
        spawned = self.schedule.spawned
        for k in range(len(self.trajs)):
            if k in spawned:
                continue  # it starts after another trajectory's round (`spawn`)
            if arrivals is not None:
                wait = t0 + arrivals[k] - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            self.start(k)
        finished = self.done_all.wait(timeout_s)
        with self.lock:
            self.stopped.set()
            for timer in self.timers:
                timer.cancel()
        self.bar.close()
        if not finished:
            self._time_out(timeout_s)
        self.closer.shutdown(wait=True)
        # Sessions still open: all of them with `release` (the blocks go now), else the
        # unfinished trajectories' after a timeout (their late rounds are dropped).
        for k, (o, t) in enumerate(zip(self.outputs, self.trajs)):
            timed_out = len(o.rounds) < len(t.rounds) and o.error.startswith("timed out")
            if k in self.sessions and (self.opts.release or timed_out):
                self.close(k)
        return self.outputs

    def _time_out(self, timeout_s: float | None) -> None:
        for o, t in zip(self.outputs, self.trajs):
            if not o.error and len(o.rounds) < len(t.rounds):
                o.error = (
                    f"timed out after {timeout_s} s with {len(o.rounds)} of {len(t.rounds)}"
                    " rounds done"
                )

    # ------------------------------------------------------------------ trajectories

    def start(self, k: int) -> None:
        """Trajectory k starts: its session opens and its first round gets ready."""
        self.limit.acquire()
        try:
            self.sessions[k] = Session(
                self.backend, self.trajs[k].id, priority=self.opts.priorities[k],
                ttl_s=self.opts.ttl_s,
            )  # fmt: skip
            self.advance(k, 0)
        except Exception as e:  # noqa: BLE001 - reported on the trajectory, others go on
            self.outputs[k].error = str(e)
            self.end(k)

    def spawn(self, k: int, upto: int) -> None:
        """Starts the trajectories due after round `upto` (or an earlier one) of trajectory k,
        each after its delay."""
        with self.lock:
            due = [at for at in self.spawns if at[0] == k and at[1] <= upto]
            started = [c for at in due for c in self.spawns.pop(at)]
        for c, delay in started:
            if self.stopped.is_set():
                return
            self._later(delay, self.start, c)

    def end(self, k: int) -> None:
        """Trajectory k ended (every round ran, or one failed): what waited for it goes on,
        its session closes (unless the call closes them all), its slot is free."""
        if self.spawns:  # it ended before the rounds others start after: they start now
            self.spawn(k, len(self.trajs[k].rounds))
        self._release_waiters(k)
        if k in self.sessions:
            if self.stopped.is_set():
                return  # timed out: the call closes every session
            if not self.opts.release:
                self.closer.submit(self.close, k)
        self.limit.release()
        with self.lock:
            self.remaining -= 1
            if self.remaining == 0:
                self.done_all.set()

    def _release_waiters(self, k: int) -> None:
        """The rounds waiting for trajectory k whose last awaited trajectory it was go now."""
        now = time.monotonic()
        go = []
        with self.lock:
            self.ended[k] = now
            for w, i in self.waiting.pop(k, ()):
                self.pending[w, i][0] -= 1
                if self.pending[w, i][0] == 0:
                    go.append((w, i, self.pending.pop((w, i))[1]))
        for w, i, ready in go:
            self.submit_after(w, i, self.schedule.delay(self.trajs, w, i, ready, now, self.ended))

    def close(self, k: int) -> None:
        try:
            self.sessions[k].close(release=self.opts.release)
        except Exception as e:  # noqa: BLE001 - reported on the trajectory, others go on
            self.outputs[k].error = self.outputs[k].error or f"closing the session failed: {e}"

    # ------------------------------------------------------------------ rounds

    def advance(self, k: int, i: int) -> None:
        """Round i of trajectory k is ready: its previous round ended (or it arrived)."""
        if i == len(self.trajs[k].rounds):
            self.end(k)
            return
        if self.stopped.is_set():
            return
        now = time.monotonic()
        with self.lock:
            running = [w for w in self.schedule.waits_of.get((k, i), ()) if self.ended[w] is None]
            if running:  # it goes when the last of them ends (`_release_waiters`)
                self.pending[k, i] = [len(running), now]
                for w in running:
                    self.waiting.setdefault(w, []).append((k, i))
                return
            delay = self.schedule.delay(self.trajs, k, i, now, now, self.ended)
        self.submit_after(k, i, delay)

    def submit_after(self, k: int, i: int, delay: float) -> None:
        """Submits round i of trajectory k after `delay` seconds: on a timer, the gap before
        it a tool call (with `tool_calls`, hinted as it begins), or at once."""
        if self.stopped.is_set():
            return
        if delay <= 0:
            self.step(k, i)
            return
        if self.opts.tool_calls and i and self.trajs[k].rounds[i].tool_call:
            # (its answer is awaited on the helper thread; a think time gets no hint)
            self.closer.submit(self._hint_tool_call, k, delay)
        self._later(delay, self.step, k, i)

    def _hint_tool_call(self, k: int, gap_s: float) -> None:
        try:
            self.sessions[k].hint("tool_call", expected_s=gap_s)
        except Exception as e:  # noqa: BLE001 - a hint that fails costs its prefetch only
            log.warning("trajectory %s: the tool_call hint failed: %s", self.trajs[k].id, e)

    def _later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        timer = threading.Timer(delay, fn, args)
        timer.daemon = True
        with self.lock:
            self.timers.append(timer)
        timer.start()

    def step(self, k: int, i: int) -> None:
        """Submits round i of trajectory k; its answer moves the trajectory on (`landed`)."""
        rd, o = self.trajs[k].rounds[i], self.opts
        try:
            fut = self.sessions[k].step_async(
                rd.append, rd.gen, temperature=o.temperature, key=o.round_key(k, i),
                top_p=o.top_p, logprobs=o.logprobs, stop_tokens=o.stop_tokens,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - e.g. bad input in a later round
            self.outputs[k].error = str(e)
            self.end(k)
            return
        fut.add_done_callback(lambda f: self.landed(k, i, f))

    def landed(self, k: int, i: int, fut: futures.Future[RoundResult]) -> None:
        if self.stopped.is_set():  # after the timeout: the call has returned its outputs
            return
        try:
            res = fut.result()
        except Exception as e:  # noqa: BLE001
            self.outputs[k].error = str(e)
            self.end(k)
            return
        self.outputs[k].rounds.append(list(res.tokens))
        self.outputs[k].results.append(res)
        with self.lock:
            self.bar.update(1)
        if self.spawns:
            self.spawn(k, i)
        self.advance(k, i + 1)
