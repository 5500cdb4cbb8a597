"""The real processes' links: `Link` (one paced link) and `TrafficManager` (all links of one process).

`transfer.links` has the link names, the rates and the arbitration core (`LinkArbiter`); this
module drives it with threads. Each limited link has one pacing thread that grants chunks at the
link rate; callers block on an event (or a future) and never spin.

Time accounting is exact: the link is busy until `t_free`, which grows by `chunk / rate` per
granted chunk; a chunk may be granted while `t_free - now <= burst_s`, so an idle link passes up to
one burst (`max(chunk_bytes, rate * burst_s)` bytes) plus one chunk back to back, and a saturated
link grants exactly `rate` bytes per second. A transfer's bytes have crossed a link once its last
chunk is granted. The pacing thread wakes about every `burst_s / 2`, which bounds how long a HIGH
request arriving on a link saturated by LOW waits for its first chunk. Links are paced whenever
their rate is > 0 (`links.emulated_links`; `HardwareConfig.emulated` does not switch pacing off),
and the snapshot says `emulated` when any is.
"""

from __future__ import annotations

import array
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dualpath_jax.config import HardwareConfig
from dualpath_jax.transfer.links import (
    DEFAULT_BURST_S,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_WINDOW_S,
    DoneCallback,
    LinkArbiter,
    LinkId,
    LinkRequest,
    TrafficClass,
    emulated_links,
    link_rate,
    link_record,
)

# Windows a link's series keeps before it merges neighbours (16,384 of 0.1 s: the first 27
# minutes at the base step, then 0.2 s, 0.4 s, ...; 256 KiB a link at most).
MAX_WINDOWS = 16384

Clock = Callable[[], float]
Sleep = Callable[[float], None]


class LinkClosedError(RuntimeError):
    """A transfer was started on, or still pending in, a closed TrafficManager / Link."""


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
        # bytes per window and class (HIGH, LOW), dense from `origin`: 16 bytes a window; past
        # `max_windows` neighbours are merged and the window doubles, so a server running for
        # days keeps a bounded series at a coarser step
        self._win = (array.array("d"), array.array("d"))
        self.max_windows = MAX_WINDOWS
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
        a, b = start - self._origin, end - self._origin
        while max(a, b) // self.window_s >= self.max_windows:
            self._fold()
        w, series = self.window_s, self._win[cls]
        last = int(max(a, b) // w)
        if len(series) <= last:
            grow = last + 1 - len(series)
            for col in self._win:
                col.extend(array.array("d", bytes(8 * grow)))
        if b <= a:
            series[int(a // w)] += n
            return
        for i in range(int(a // w), int(math.ceil(b / w))):
            overlap = min(b, (i + 1) * w) - max(a, i * w)
            if overlap > 0:
                series[min(i, last)] += n * overlap / (b - a)

    def _fold(self) -> None:
        """Merges each pair of windows into one of twice the length (lock held)."""
        for col in self._win:
            merged = array.array("d", (sum(col[i : i + 2]) for i in range(0, len(col), 2)))
            del col[:]
            col.extend(merged)
        self.window_s *= 2

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

        `window_s` must be a whole multiple of the link's base window (default: the base window,
        which doubles each time the series reaches `max_windows`).
        A chunk's bytes are spread over the time it occupies the link.
        """
        k = 1 if window_s is None else round(window_s / self.window_s)
        if k < 1 or not math.isclose(k * self.window_s, window_s or self.window_s, rel_tol=1e-9):
            raise ValueError(f"window_s={window_s} is not a multiple of {self.window_s}")
        with self._cond:
            now_i = int((self._clock() - self._origin) // self.window_s)
            cols = (0, 1) if cls is None else (int(TrafficClass(cls)),)
            n = max(now_i + 1, len(self._win[0]))
            per = [sum(self._win[c][i] for c in cols if i < len(self._win[c])) for i in range(n)]
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
            "emulated": bool(emulated_links(self.hw)),
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
