"""Named links and the TrafficManager: every KV byte that moves is charged to a link (DESIGN 2.2).

A link is one direction of one piece of hardware: a node's storage NIC (`SNIC_RX` = storage ->
node reads, `SNIC_TX` = node -> storage writes), an engine's compute NIC (`CNIC_RX`/`CNIC_TX`, full
duplex), an engine's host<->device copies (`H2D`, `D2H`) and a node's DRAM (`DRAM`, half duplex:
reads and writes both count). Rates come from `HardwareConfig` in bytes per second; 0 means
unlimited (real hardware: the transfer itself is the limit, bytes are only counted).

A limited link is an emulated token bucket with weighted arbitration between two traffic classes,
like the InfiniBand virtual lanes of the paper (appendix A.1): while both classes have pending
bytes HIGH gets `high_weight / (high_weight + low_weight)` of the link (99:1 by default), LOW never
starves, and an idle HIGH class leaves the whole link to LOW. Bytes are served in chunks
(`chunk_bytes`, 64 KiB by default), chosen by weighted fair queueing on virtual finish tags
(`LinkArbiter`, a pure core with no clock and no threads that the simulator can drive too); within
a class requests are served FIFO, so a forward's layer blocks arrive in the order they were asked
for. Each limited link has one pacing thread that grants chunks at the link rate; callers block on
an event (or a future) and never spin.

Time accounting is exact: the link is busy until `t_free`, which grows by `chunk / rate` per
granted chunk; a chunk may be granted while `t_free - now <= burst_s`, so an idle link passes up to
one burst (`max(chunk_bytes, rate * burst_s)` bytes) plus one chunk back to back, and a saturated
link grants exactly `rate` bytes per second. A transfer's bytes have crossed a link once its last
chunk is granted. The pacing thread wakes about every `burst_s / 2`, which bounds how long a HIGH
request arriving on a link saturated by LOW waits for its first chunk. Links are paced whenever
their rate is > 0; `HardwareConfig.emulated` only labels the snapshot.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from dualpath_jax.config import HardwareConfig

Clock = Callable[[], float]
Sleep = Callable[[float], None]
DoneCallback = Callable[[BaseException | None], None]

DEFAULT_CHUNK_BYTES = 64 * 1024
DEFAULT_BURST_S = 0.005
DEFAULT_WINDOW_S = 0.1


class TrafficClass(enum.IntEnum):
    """Priority of a transfer on every link it crosses (paper appendix A.1, DESIGN 2.2)."""

    HIGH = 0  # the running forward's layer blocks, PE -> DE results, decode H2D
    LOW = 1  # prefetch reads (store -> buffer), persistence writes (device -> store)


class LinkKind(enum.StrEnum):
    SNIC_RX = "snic_rx"  # a node's storage NIC, storage -> node (reads)
    SNIC_TX = "snic_tx"  # a node's storage NIC, node -> storage (writes)
    CNIC_RX = "cnic_rx"  # an engine's compute NIC, receive direction
    CNIC_TX = "cnic_tx"  # an engine's compute NIC, send direction
    H2D = "h2d"  # an engine's host -> device copies
    D2H = "d2h"  # an engine's device -> host copies
    DRAM = "dram"  # a node's memory bandwidth (reads and writes both count)


class LinkClosedError(RuntimeError):
    """A transfer was started on, or still pending in, a closed TrafficManager / Link."""


@dataclasses.dataclass(frozen=True)
class LinkId:
    """One link: its kind and its owner (a node id for SNIC/DRAM, an engine id otherwise)."""

    kind: LinkKind
    owner: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LinkKind(self.kind))
        if not isinstance(self.owner, str) or not self.owner or ":" in self.owner:
            raise ValueError(f"link owner must be a non-empty str without ':', got {self.owner!r}")

    @property
    def name(self) -> str:
        """`"<kind>:<owner>"`, e.g. `"snic_rx:pe-node0"`: the key of snapshots and expectations."""
        return f"{self.kind.value}:{self.owner}"

    @classmethod
    def parse(cls, name: str) -> LinkId:
        kind, sep, owner = name.partition(":")
        if not sep:
            raise ValueError(f"link name {name!r}: expected '<kind>:<owner>'")
        return cls(LinkKind(kind), owner)

    def __str__(self) -> str:
        return self.name


def link_rate(hw: HardwareConfig, kind: LinkKind) -> float:
    """Bytes per second of a link of `kind` under `hw` (0: unlimited)."""
    kind = LinkKind(kind)
    if kind in (LinkKind.SNIC_RX, LinkKind.SNIC_TX):
        return float(hw.snic_bytes_per_s)
    if kind in (LinkKind.CNIC_RX, LinkKind.CNIC_TX):
        return float(hw.cnic_bytes_per_s)
    return float(
        {
            LinkKind.H2D: hw.h2d_bytes_per_s,
            LinkKind.D2H: hw.d2h_bytes_per_s,
            LinkKind.DRAM: hw.dram_bytes_per_s,
        }[kind]
    )


# --------------------------------------------------------------------------- arbitration core


@dataclasses.dataclass(eq=False)
class LinkRequest:
    """One caller's bytes on one link: queued FIFO in its class, served chunk by chunk
    (`remaining` falls to 0), then `on_done(None)`, or `on_done(LinkClosedError)` on close."""

    nbytes: int
    cls: TrafficClass
    on_done: DoneCallback | None = None
    remaining: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.remaining = self.nbytes


class Grant(NamedTuple):
    """One chunk served: it occupies the link during `[start, end)` (seconds, link clock).
    (A named tuple: one is made per chunk, and a frozen dataclass costs several times more.)"""

    request: LinkRequest
    nbytes: int
    start: float
    end: float


class LinkArbiter:
    """Weighted fair queueing between HIGH and LOW over a token bucket; pure (no clock, no threads).

    Each class's head-of-line chunk carries a virtual finish tag `S + chunk / weight`, where `S` is
    the class's previous tag while it stays backlogged and `max(V, previous tag)` when it becomes
    backlogged again (`V` = tag of the last served chunk, self-clocked fair queueing). `grant`
    serves the smaller tag (ties go to HIGH), so with both classes backlogged HIGH gets
    `w_high / (w_high + w_low)` of the bytes to within one chunk, and a lone class gets everything.

    The caller owns time: `grant(now)` is allowed once `now >= ready_at()`. While the backlog
    never empties, chunks are served back to back from `t_free` even if `grant` comes late (by up
    to `max_lag_s`), so a pacer's sleep jitter does not cost link time.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        *,
        high_weight: float = 99.0,
        low_weight: float = 1.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        burst_bytes: float | None = None,
        max_lag_s: float = 0.1,
    ):
        if not rate_bytes_per_s > 0 or not math.isfinite(rate_bytes_per_s):
            raise ValueError(f"a paced link needs a finite rate > 0, got {rate_bytes_per_s!r}")
        if not (high_weight > 0 and low_weight > 0):
            raise ValueError(
                f"weights must be > 0 (LOW must never starve), got {high_weight}:{low_weight}"
            )
        if not (isinstance(chunk_bytes, int) and chunk_bytes > 0):
            raise ValueError(f"chunk_bytes must be an int > 0, got {chunk_bytes!r}")
        self.rate = float(rate_bytes_per_s)
        self.chunk_bytes = chunk_bytes
        self.burst_bytes = float(max(chunk_bytes, burst_bytes or 0.0))
        self.burst_s = self.burst_bytes / self.rate
        self.t_free = -math.inf  # the link is busy until then (seconds)
        self.max_lag_s = max_lag_s
        self._backlogged = False  # requests were pending without a break since the last grant
        self._weight = {TrafficClass.HIGH: float(high_weight), TrafficClass.LOW: float(low_weight)}
        self._queue: dict[TrafficClass, collections.deque[LinkRequest]] = {
            c: collections.deque() for c in TrafficClass
        }
        self._head_tag: dict[TrafficClass, float | None] = dict.fromkeys(TrafficClass)
        self._last_tag = dict.fromkeys(TrafficClass, 0.0)
        self._vtime = 0.0

    def _tag_after(self, cls: TrafficClass, start: float) -> float:
        return start + min(self.chunk_bytes, self._queue[cls][0].remaining) / self._weight[cls]

    def enqueue(self, req: LinkRequest) -> None:
        if req.remaining <= 0:
            raise ValueError("a queued request needs bytes > 0")
        q = self._queue[req.cls]
        q.append(req)
        if len(q) == 1:
            self._head_tag[req.cls] = self._tag_after(
                req.cls, max(self._vtime, self._last_tag[req.cls])
            )

    def pending(self) -> bool:
        q = self._queue
        return bool(q[TrafficClass.HIGH] or q[TrafficClass.LOW])

    def pending_bytes(self, cls: TrafficClass | None = None) -> int:
        classes = TrafficClass if cls is None else (TrafficClass(cls),)
        return sum(r.remaining for c in classes for r in self._queue[c])

    def ready_at(self) -> float:
        """Earliest time the next chunk may be granted (the bucket holds a chunk again)."""
        return self.t_free - self.burst_s

    def can_grant(self, now: float) -> bool:
        """True when something is pending and the bucket allows a chunk at `now`."""
        return self.pending() and now >= self.ready_at() - 1e-9

    def wake_at(self) -> float:
        """When a pacer should look again: half a burst before the link drains (fewer wakeups)."""
        return self.t_free - self.burst_s / 2

    def grant(self, now: float) -> Grant:
        heads = self._head_tag
        high, low = heads[TrafficClass.HIGH], heads[TrafficClass.LOW]
        if high is None and low is None:
            raise RuntimeError("grant() with nothing pending")
        if now < self.ready_at() - 1e-9:
            raise RuntimeError(f"grant() at {now} before ready_at() {self.ready_at()}")
        # The smaller tag; ties go to HIGH.
        if low is None or (high is not None and high <= low):
            tag, cls = high, TrafficClass.HIGH
        else:
            tag, cls = low, TrafficClass.LOW
        assert tag is not None
        q = self._queue[cls]
        req = q[0]
        n = min(self.chunk_bytes, req.remaining)
        req.remaining -= n
        self._vtime = self._last_tag[cls] = tag
        if req.remaining == 0:
            q.popleft()
        self._head_tag[cls] = self._tag_after(cls, tag) if q else None
        # A late pacer must not idle a link whose backlog never emptied: serve from t_free (up to
        # max_lag_s in the past) so the long-run rate stays exact despite sleep jitter.
        lagging = self._backlogged and now - self.max_lag_s <= self.t_free < now
        start = self.t_free if lagging else max(self.t_free, now)
        self.t_free = start + n / self.rate
        self._backlogged = self.pending()
        return Grant(req, n, start, self.t_free)

    def drain(self) -> list[LinkRequest]:
        """Removes and returns every queued request (the link is closing)."""
        out = [r for c in TrafficClass for r in self._queue[c]]
        for c in TrafficClass:
            self._queue[c].clear()
            self._head_tag[c] = None
        return out


# --------------------------------------------------------------------------- one link


class Link:
    """One named link: counters, a utilisation series and, when paced by `arbiter`, a pacing
    thread. Without an arbiter the link is unlimited: requests complete at once, only counted.

    Lifecycle: built by `TrafficManager.link`; `request` from any thread; `close` fails what is
    still queued and stops the pacing thread (after its current sleep). Times are seconds of
    `clock`; the windows of the series start at `origin`.
    """

    def __init__(
        self,
        link_id: LinkId,
        arbiter: LinkArbiter | None,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
        origin: float | None = None,
    ):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.id, self._arb = link_id, arbiter
        self.rate = 0.0 if arbiter is None else arbiter.rate
        self.window_s = float(window_s)
        self._clock, self._sleep = clock, sleep
        self._origin = clock() if origin is None else origin
        self._cond = threading.Condition(threading.Lock())
        self._bytes = [0, 0]  # by TrafficClass value
        self._win: dict[int, list[float]] = {}  # window index -> bytes [HIGH, LOW]
        self._thread: threading.Thread | None = None
        self._closed = False

    def request(self, nbytes: int, cls: TrafficClass, on_done: DoneCallback | None = None) -> None:
        """Queues `nbytes` in class `cls`; `on_done(None)` runs once they have crossed the link.

        Non-blocking. `on_done` runs on the pacing thread (or at once, in the caller, for an
        unlimited link or 0 bytes) and must not block.
        """
        if not (isinstance(nbytes, int) and nbytes >= 0):
            raise ValueError(f"{self.id}: nbytes must be an int >= 0, got {nbytes!r}")
        cls = TrafficClass(cls)
        with self._cond:
            if self._closed:
                raise LinkClosedError(f"{self.id} is closed")
            if self._arb is None or nbytes == 0:
                now = self._clock()
                self._account(cls, nbytes, now, now)
            else:
                self._arb.enqueue(LinkRequest(nbytes, cls, on_done))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name=f"link-{self.id.name}", daemon=True
                    )
                    self._thread.start()
                self._cond.notify()
                return
        _notify(on_done, None)

    def _run(self) -> None:
        """The pacing thread: grants every chunk the bucket allows, then sleeps until `wake_at`."""
        arb = self._arb
        assert arb is not None
        while True:
            finished: list[LinkRequest] = []
            delay = 0.0
            with self._cond:
                while not arb.pending() and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                now = self._clock()
                while arb.can_grant(now):
                    g = arb.grant(now)
                    self._account(g.request.cls, g.nbytes, g.start, g.end)
                    if g.request.remaining == 0:
                        finished.append(g.request)
                if arb.pending():
                    delay = arb.wake_at() - now
            for req in finished:
                _notify(req.on_done, None)
            if delay > 0:
                self._sleep(delay)

    def _account(self, cls: TrafficClass, n: int, start: float, end: float) -> None:
        """Counts `n` bytes of `cls`, spread over `[start, end)` in the window series (lock held)."""
        self._bytes[cls] += n
        if n == 0:
            return
        w = self.window_s
        a, b = start - self._origin, end - self._origin
        if b <= a:
            self._win.setdefault(int(a // w), [0.0, 0.0])[cls] += n
            return
        for i in range(int(a // w), int(math.ceil(b / w))):
            overlap = min(b, (i + 1) * w) - max(a, i * w)
            if overlap > 0:
                self._win.setdefault(i, [0.0, 0.0])[cls] += n * overlap / (b - a)

    def bytes(self, cls: TrafficClass | None = None) -> int:
        """Bytes granted so far, of one class or of both."""
        with self._cond:
            return sum(self._bytes) if cls is None else self._bytes[TrafficClass(cls)]

    def busy_until(self) -> float:
        """Seconds after `origin` until which granted bytes occupy the link (0 if never busy)."""
        with self._cond:
            t = -math.inf if self._arb is None else self._arb.t_free
            return max(0.0, t - self._origin)

    def window_bytes(
        self, window_s: float | None = None, cls: TrafficClass | None = None
    ) -> list[tuple[float, float]]:
        """`[(t_start, bytes)]` per window from `origin` up to now (or the last busy window).

        `window_s` must be a whole multiple of the link's base window (default: the base window).
        A chunk's bytes are spread over the time it occupies the link.
        """
        k = 1 if window_s is None else round(window_s / self.window_s)
        if k < 1 or not math.isclose(k * self.window_s, window_s or self.window_s, rel_tol=1e-9):
            raise ValueError(f"window_s={window_s} is not a multiple of {self.window_s}")
        with self._cond:
            now_i = int((self._clock() - self._origin) // self.window_s)
            cols = (0, 1) if cls is None else (int(TrafficClass(cls)),)
            per = [
                sum(self._win.get(i, (0.0, 0.0))[c] for c in cols)
                for i in range(max([now_i, *self._win]) + 1)
            ]
        return [(j * self.window_s, sum(per[j : j + k])) for j in range(0, len(per), k)]

    def utilisation(
        self, window_s: float | None = None, cls: TrafficClass | None = None
    ) -> list[tuple[float, float]]:
        """`[(t_start, fraction of the link busy)]` per window; ValueError for an unlimited link."""
        if self._arb is None:
            raise ValueError(f"{self.id} is unlimited: no utilisation (use window_bytes)")
        w = self.window_s if window_s is None else window_s
        return [(t, b / (self.rate * w)) for t, b in self.window_bytes(window_s, cls)]

    def close(self) -> None:
        """Fails every queued request with LinkClosedError and stops the pacing thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped = [] if self._arb is None else self._arb.drain()
            self._cond.notify_all()
        for req in dropped:
            _notify(req.on_done, LinkClosedError(f"{self.id} closed, {req.remaining} B pending"))


# --------------------------------------------------------------------------- the manager


def link_record(
    link_id: LinkId, rate: float, high: int, low: int, busy_s: float, span_s: float
) -> dict[str, Any]:
    """One link's entry of a `snapshot()` (shared with the simulator's links): bytes by class,
    rate, busy time and utilisation over `span_s` (None for an unlimited link)."""
    return {
        "kind": link_id.kind.value,
        "owner": link_id.owner,
        "rate_bytes_per_s": rate,
        "bytes": high + low,
        "bytes_high": high,
        "bytes_low": low,
        "busy_s": busy_s,
        "utilisation": (busy_s / span_s if span_s > 0 else 0.0) if rate else None,
    }


class TrafficManager:
    """All links of one process, created on demand by LinkId, plus the read queue per node.

    Lifecycle: build with the node kind's `HardwareConfig`; call `transfer` / `submit` from any
    thread; read `bytes`, `utilisation`, `snapshot` at any time; `close` (or leave the `with`
    block) fails pending transfers with LinkClosedError and stops the pacing threads.

    A transfer over a path charges the full byte count to every link of the path concurrently (a
    link listed twice is charged twice): it completes when the slowest link has served it, which
    models a pipelined, cut-through copy whose rate is its bottleneck link's share. No link waits
    for another and nothing is held while waiting, so overlapping paths cannot deadlock.
    """

    def __init__(
        self,
        hw: HardwareConfig,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        burst_s: float = DEFAULT_BURST_S,
        window_s: float = DEFAULT_WINDOW_S,
    ):
        if not (hw.high_weight > 0 and hw.low_weight > 0):
            raise ValueError(
                f"high_weight and low_weight must be > 0, got {hw.high_weight}:{hw.low_weight}"
            )
        self.hw = hw
        self._clock, self._sleep = clock, sleep
        self._chunk_bytes, self._burst_s, self._window_s = chunk_bytes, burst_s, window_s
        self._origin = clock()
        self._lock = threading.Lock()
        self._links: dict[LinkId, Link] = {}
        self._read_q: dict[str, int] = {}
        self._done_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    # ----- links

    def link(self, link_id: LinkId) -> Link:
        """The link `link_id`, created at its HardwareConfig rate on first use."""
        if not isinstance(link_id, LinkId):
            raise TypeError(f"expected a LinkId, got {link_id!r}")
        with self._lock:
            if self._closed:
                raise LinkClosedError("TrafficManager is closed")
            ln = self._links.get(link_id)
            if ln is None:
                rate, hw = link_rate(self.hw, link_id.kind), self.hw
                arb = None
                if rate > 0:
                    arb = LinkArbiter(
                        rate,
                        high_weight=hw.high_weight,
                        low_weight=hw.low_weight,
                        chunk_bytes=self._chunk_bytes,
                        burst_bytes=rate * self._burst_s,
                    )
                ln = Link(
                    link_id,
                    arb,
                    window_s=self._window_s,
                    clock=self._clock,
                    sleep=self._sleep,
                    origin=self._origin,
                )
                self._links[link_id] = ln
            return ln

    @property
    def origin(self) -> float:
        """The clock reading that window start times are relative to."""
        return self._origin

    def links(self) -> list[LinkId]:
        """Every link used so far, sorted by name."""
        with self._lock:
            return sorted(self._links, key=lambda x: x.name)

    # ----- transfers

    def _start(
        self,
        path: Sequence[LinkId],
        nbytes: int,
        cls: TrafficClass,
        deliver: Callable[[BaseException | None], None],
    ) -> None:
        if isinstance(path, LinkId | str) or not path:
            raise ValueError(f"path must be a non-empty sequence of LinkId, got {path!r}")
        if not (isinstance(nbytes, int) and nbytes >= 0):
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        cls = TrafficClass(cls)
        links = [self.link(x) for x in path]
        lock, left, errors = threading.Lock(), [len(links)], []

        def one_done(exc: BaseException | None) -> None:
            with lock:
                errors.append(exc)
                left[0] -= 1
                if left[0]:
                    return
            deliver(next((e for e in errors if e is not None), None))

        for ln in links:
            ln.request(nbytes, cls, one_done)

    def transfer(self, path: Sequence[LinkId], nbytes: int, cls: TrafficClass) -> None:
        """Blocks until `nbytes` of class `cls` have crossed every link of `path`.

        Raises LinkClosedError if the manager closes first.
        """
        done = threading.Event()
        err: list[BaseException | None] = []

        def deliver(exc: BaseException | None) -> None:
            err.append(exc)
            done.set()

        self._start(path, nbytes, cls, deliver)
        done.wait()
        if err[0] is not None:
            raise LinkClosedError(str(err[0])) from err[0]

    def submit(
        self, path: Sequence[LinkId], nbytes: int, cls: TrafficClass
    ) -> concurrent.futures.Future[None]:
        """Starts `transfer(path, nbytes, cls)` and returns its future at once.

        The bytes are queued on every link before this returns (so arbitration sees them at
        once); no worker thread is held per transfer. The future resolves to None, or fails with
        LinkClosedError; it cannot be cancelled. Done-callbacks run on the manager's one
        completion thread: they may start transfers but must not wait on its other futures.
        """
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()

        def resolve(exc: BaseException | None) -> None:
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(LinkClosedError(str(exc)))

        def deliver(exc: BaseException | None) -> None:
            try:
                self._completion_pool().submit(resolve, exc)
            except RuntimeError:  # closing: no completion thread any more
                resolve(exc)

        self._start(path, nbytes, cls, deliver)
        return fut

    def _completion_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise LinkClosedError("TrafficManager is closed")
            if self._done_pool is None:
                self._done_pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="traffic-done"
                )
            return self._done_pool

    # ----- counters

    def bytes(self, link_id: LinkId, cls: TrafficClass | None = None) -> int:
        """Bytes that crossed `link_id` (of one class or both); 0 for a link never used."""
        with self._lock:
            ln = self._links.get(link_id)
        return 0 if ln is None else ln.bytes(cls)

    def window_bytes(
        self, link_id: LinkId, window_s: float | None = None, cls: TrafficClass | None = None
    ) -> list[tuple[float, float]]:
        """`[(t_start, bytes)]` per window since this manager was built (see Link.window_bytes)."""
        return self.link(link_id).window_bytes(window_s, cls)

    def utilisation(
        self, link_id: LinkId, window_s: float | None = None, cls: TrafficClass | None = None
    ) -> list[tuple[float, float]]:
        """`[(t_start, busy fraction)]` per window of a limited link (ValueError if unlimited)."""
        return self.link(link_id).utilisation(window_s, cls)

    def snapshot(self) -> dict[str, Any]:
        """All counters as a JSON-ready dict: per link bytes by class, rate, busy time, mean
        utilisation since the manager was built (None when unlimited; bytes granted ahead within
        the burst count up to the time they occupy the link), and the read queue per node."""
        elapsed = self._clock() - self._origin
        with self._lock:
            links = sorted(self._links.values(), key=lambda x: x.id.name)
            read_q = dict(sorted(self._read_q.items()))
        out: dict[str, Any] = {}
        for ln in links:
            hi, lo = ln.bytes(TrafficClass.HIGH), ln.bytes(TrafficClass.LOW)
            busy = (hi + lo) / ln.rate if ln.rate else 0.0
            span = max(elapsed, ln.busy_until())
            out[ln.id.name] = link_record(ln.id, ln.rate, hi, lo, busy, span)
        return {
            "emulated": bool(self.hw.emulated),
            "elapsed_s": elapsed,
            "links": out,
            "read_q": read_q,
        }

    # ----- the scheduler's read queue (read_q of paper section 6), in tokens per node

    def read_queue_add(self, node: str | int, tokens: int) -> None:
        """`tokens` more hit tokens are queued for reading by `node`'s storage NIC."""
        _check_tokens(tokens)
        with self._lock:
            self._read_q[str(node)] = self._read_q.get(str(node), 0) + tokens

    def read_queue_done(self, node: str | int, tokens: int) -> None:
        """`tokens` queued on `node` have been read; ValueError if more than are queued."""
        _check_tokens(tokens)
        with self._lock:
            q = self._read_q.get(str(node), 0)
            if tokens > q:
                raise ValueError(f"read queue of {node}: {tokens} done but only {q} queued")
            self._read_q[str(node)] = q - tokens

    def read_q(self, node: str | int) -> int:
        with self._lock:
            return self._read_q.get(str(node), 0)

    # ----- lifecycle

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
            pool, self._done_pool = self._done_pool, None
        for ln in links:
            ln.close()
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self) -> TrafficManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _notify(on_done: DoneCallback | None, exc: BaseException | None) -> None:
    """Runs a completion callback; an error in it is logged, never kills a pacing thread."""
    if on_done is not None:
        try:
            on_done(exc)
        except Exception:
            logging.getLogger(__name__).exception("transfer completion callback failed")


def _check_tokens(tokens: int) -> None:
    if not (isinstance(tokens, int) and tokens >= 0):
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
