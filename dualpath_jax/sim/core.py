"""The discrete-event core of the simulator: a virtual clock and a heap of timed callbacks.

Why a hand-written heap loop and not SimPy: the cluster model is callback driven (a link grants a
chunk, a transfer completes, a forward batch ends), it never needs SimPy's process/generator
machinery, and a bare `heapq` loop costs one push and one pop per event. SimPy is not a
dependency of the project; `bench/sim_speed.py` reports this loop's events per second. The heap
holds the `Event`s themselves, ordered by `(time, seq)` with their own `__lt__`: compiled (`make
native`) that is one native comparison, where `(time, seq, event)` tuples cost a tuple per event
and two rich comparisons per step of a sift (3x the heap's time in a micro-benchmark; the pure
modules pay about 1 us more per event for the Python `__lt__`).

Lifecycle: build an `EventLoop`, schedule callbacks with `at` / `after` / `soon`, then `run()`.
Callbacks run one at a time in time order (FIFO among equal times, by scheduling order) and may
schedule more. Times are seconds of the virtual clock `now`, which starts at 0 and never moves
backwards. Nothing here reads a wall clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

Callback = Callable[..., Any]
_push = heapq.heappush


class Event:
    """A scheduled callback; `cancel()` makes the loop skip it (O(1), the entry stays queued).
    Events order by `(time, seq)`: `seq` counts the loop's scheduling, FIFO among equal times."""

    __slots__ = ("time", "seq", "fn", "args")

    def __init__(self, time: float, seq: int, fn: Callback, args: tuple[Any, ...]):
        self.time = time
        self.seq = seq
        self.fn: Callback | None = fn
        self.args = args

    def __lt__(self, other: Event) -> bool:
        return self.time < other.time or (self.time == other.time and self.seq < other.seq)

    def cancel(self) -> None:
        self.fn = None

    @property
    def cancelled(self) -> bool:
        return self.fn is None


class EventLoop:
    """A virtual clock plus a min-heap of `Event`s (by time, then scheduling order).

    `events`: callbacks run so far (cancelled ones excluded), for events-per-second reports.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[Event] = []
        self._seq = 0  # events scheduled so far: FIFO order among equal times
        self._stopped = False

    def __len__(self) -> int:
        """Entries in the heap (cancelled ones included until they are popped)."""
        return len(self._heap)

    def at(self, time: float, fn: Callback, *args: Any) -> Event:
        """Runs `fn(*args)` at virtual time `time` (seconds; clamped to `now` if earlier)."""
        if not time >= self.now:  # also catches NaN
            if math.isnan(time):
                raise ValueError(f"event time is NaN for {fn!r}")
            time = self.now
        self._seq += 1
        ev = Event(time, self._seq, fn, args)
        _push(self._heap, ev)
        return ev

    def after(self, delay: float, fn: Callback, *args: Any) -> Event:
        """Runs `fn(*args)` `delay` seconds from now (`delay >= 0`)."""
        if not delay >= 0:  # also catches NaN
            raise ValueError(f"negative or NaN delay {delay} for {fn!r}")
        self._seq += 1  # the hot path: `at` inlined
        ev = Event(self.now + delay, self._seq, fn, args)
        _push(self._heap, ev)
        return ev

    def soon(self, fn: Callback, *args: Any) -> Event:
        """Runs `fn(*args)` at the current time, after the callbacks already due now."""
        return self.at(self.now, fn, *args)

    def stop(self) -> None:
        """Makes `run` return after the current callback."""
        self._stopped = True

    def run(self, until: float = math.inf, max_events: int = 0) -> int:
        """Runs callbacks in time order until the heap is empty, the next event lies after
        `until`, `stop()` was called, or `max_events` (> 0) ran. Returns the callbacks run."""
        heap, pop = self._heap, heapq.heappop
        ran = 0
        self._stopped = False
        while heap and not self._stopped:
            ev = pop(heap)
            t = ev.time
            if t > until:
                _push(heap, ev)
                self.now = until
                break
            fn = ev.fn
            if fn is None:
                continue
            ev.fn = None
            self.now = t
            fn(*ev.args)
            ran += 1
            if max_events and ran >= max_events:
                break
        self.events += ran
        return ran
