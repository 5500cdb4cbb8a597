"""Links of the simulated cluster, arbitrated by the real `LinkArbiter` on the virtual clock.

Every named link (`transfer.links.LinkId`: SNIC RX/TX and DRAM per node, CNIC RX/TX and H2D/D2H
per engine) is a `SimLink`. A limited link (rate > 0) owns a `LinkArbiter` (the same pure
weighted-fair core the `TrafficManager` pacing threads drive) and is paced by events: whenever
the link falls idle with bytes pending, it grants one chunk, which occupies it for
`chunk / rate` seconds; the next grant happens when that chunk ends. An unlimited link (rate 0)
only counts bytes.

A transfer over a path queues its bytes on every link of the path at once and completes when
the slowest link has served them, exactly like `TrafficManager.submit`.

One event per uncontended transfer (`fast=True`, the default): a link that is idle with
nothing queued grants a transfer that fits one chunk at once, through the same arbiter, and
needs no event at the chunk's end unless another request arrives before it (then the pacing
event is scheduled at that end, where the per-chunk model has it). A transfer whose links all
grant it so completes with one event at the latest chunk end instead of one per link; the links
serve the same bytes over the same intervals. `fast=False` keeps one event per chunk per link.

One-class links (`fifo` kinds, fast mode only): weighted fair queueing with a single class is a
FIFO served back to back, so a link that only ever carries one class (in the simulated cluster:
storage NICs LOW, compute NICs and H2D HIGH, each engine's D2H one of them) grants every
transfer at once, queued behind the bytes granted before it: completion times are those of the
per-chunk arbiter, with no event per chunk and no arbiter round trip; a transfer over such links
completes with one event. Bytes of the other class on such a link are a model error
(ValueError).

Chunk size: the real links grant 64 KiB chunks, which at the paper's scale would mean billions
of events. Here a link grants `rate * quantum_s` bytes per chunk (50 ms of the link by
default; never below 64 KiB): the long-run rates and the HIGH:LOW shares are the same, and a
HIGH transfer arriving on a link saturated by LOW waits at most one quantum for its first
chunk (the real links: about half a burst, 2.5 ms). Measured (`bench/sim_speed.py`, DS 660B
2P4D, 256 agents, full 64K trace): quanta of 10, 50 and 200 ms give the same JCT to 12 digits,
with 1.11M, 0.73M and 0.73M events (most transfers then fit one chunk per link).

Accounting: bytes per link and class, and bytes per time window (`window_s`, a chunk spread
over the windows it occupies), in the shape of the engines' link reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dualpath_jax.sim.core import EventLoop
from dualpath_jax.transfer.links import (
    DEFAULT_CHUNK_BYTES,
    LinkArbiter,
    LinkId,
    LinkRequest,
    TrafficClass,
    link_record,
)

Done = Callable[[], object]


# `int(cls)` by class (an int() call on an enum is a generic call in the compiled core)
_CLS_INDEX = {TrafficClass.HIGH: 0, TrafficClass.LOW: 1}


def _window(t: float, w: float) -> int:
    """`int(t // w)`, the window of time `t`: with `w == 1` the same number as `floor(t)`, which
    the compiled core computes 8x faster than a float floor division."""
    return math.floor(t) if w == 1.0 else int(t // w)


@dataclasses.dataclass(eq=False, init=False)
class _TimedRequest(LinkRequest):
    """A `LinkRequest` whose `at_end(t)` runs when its last chunk is granted, with that chunk's
    end time (`SimLink.request_timed`); its `on_done` stays None."""

    at_end: Callable[[float], object] | None = None

    def __init__(
        self, nbytes: int, cls: TrafficClass, at_end: Callable[[float], object] | None
    ) -> None:
        super().__init__(nbytes, cls)
        self.at_end = at_end


class SimLink:
    """One link on the virtual clock. Built by `SimNetwork.link`; lives as long as the run."""

    __slots__ = (
        "id",
        "rate",
        "arb",
        "loop",
        "_hi",
        "_lo",
        "windows",
        "_win",
        "_acc",
        "window_s",
        "_busy",
        "_last",
        "_free_at",
        "_chunk",
        "_cls",
        "fifo",
        "background",
    )

    def __init__(
        self,
        link_id: LinkId,
        rate: float,
        loop: EventLoop,
        *,
        quantum_s: float,
        high_weight: float,
        low_weight: float,
        window_s: float,
        fifo: bool = False,
    ):
        self.id = link_id
        self.fifo = fifo
        self._cls = -1  # the traffic class a `fifo` link carries (-1: none yet)
        self.rate = float(rate)
        self.loop = loop
        self.arb: LinkArbiter | None = None
        self._chunk = 0
        if self.rate > 0:
            chunk = self._chunk = max(DEFAULT_CHUNK_BYTES, int(self.rate * quantum_s))
            self.arb = LinkArbiter(
                self.rate, high_weight=high_weight, low_weight=low_weight, chunk_bytes=chunk
            )
        self._hi = self._lo = 0  # bytes by class (`bytes`)
        # Bytes per time window (both classes): a link's chunks start in time order, so windows
        # fill in order; the open one (`_win`, -1: none yet) sums in `_acc` (a native float
        # when compiled) and joins `windows`, the closed ones by index, when a later one opens.
        self.windows: list[float] = []
        self._win = -1
        self._acc = 0.0
        self.window_s = window_s
        self._busy = False  # a chunk is on the wire (a pacing event is scheduled)
        self._last: LinkRequest | None = None  # the request of the chunk on the wire
        self._free_at = -math.inf  # end of a chunk granted by `serve_now` (no event of its own)
        # Reads below LOW that only fill idle time (`sim.prefetch.Background`), or None.
        self.background: Any = None

    def request(self, nbytes: int, cls: TrafficClass, on_done: Callable[..., object]) -> None:
        """Queues `nbytes`; `on_done()` runs (as an event) once the last byte has crossed (it is
        called with one argument, None, when a chunk completes it)."""
        if self.arb is None or nbytes == 0:
            self._account(_CLS_INDEX[cls], nbytes, self.loop.now, self.loop.now)
            self.loop.soon(on_done)
            return
        self._enqueue(LinkRequest(nbytes, cls, on_done))

    def _enqueue(self, req: LinkRequest) -> None:
        """Queues `req` in the arbiter and starts pacing if the link is not already paced."""
        assert self.arb is not None
        self.arb.enqueue(req)
        if not self._busy:
            self._busy = True
            if self.loop.now < self._free_at:  # a chunk granted without an event is on the wire
                self.loop.at(self._free_at, self._pace)
            else:
                self._pace()

    def serve_now(self, nbytes: int, cls: TrafficClass) -> float | None:
        """Grants `nbytes` now, without an event of its own, when that is what the arbiter would
        do; returns the time the last byte crosses, or None (then use `request`).

        - Unlimited links: always (only counted).
        - `fifo` links carry one traffic class, and weighted fair queueing with one class is a
          FIFO served back to back: the bytes start when those granted before them end,
          whatever their size (exact). Bytes of the other class raise ValueError.
        - Other links: only when the link is idle, nothing is queued and the bytes fit one
          chunk (`LinkArbiter.grant_alone`).
        """
        arb = self.arb
        now = self.loop.now
        if arb is None:
            self._account(_CLS_INDEX[cls], nbytes, now, now)
            return now
        if nbytes <= 0:
            return None
        c = _CLS_INDEX[cls]
        if self.fifo:
            if self._cls != c:
                if self._cls >= 0:
                    raise ValueError(
                        f"link {self.id.name} is served as one-class FIFO but carried "
                        f"both traffic classes"
                    )
                self._cls = c
            start = self._free_at if self._free_at > now else now
            self._free_at = end = start + nbytes / self.rate
            if self.background is not None:  # background bytes on the wire yield at once
                self.background.yield_to(now, end)
            w = self.window_s
            a = _window(start, w)
            if a == self._win and a >= _window(end - 1e-9 * w, w):  # `_account`'s common case
                if c:
                    self._lo += nbytes
                else:
                    self._hi += nbytes
                self._acc += nbytes
            else:
                self._account(c, nbytes, start, end)
            return end
        if self._busy or nbytes > self._chunk or now < self._free_at:
            return None
        start, end = arb.grant_alone(nbytes, cls, now)
        self._account(c, nbytes, start, end)
        self._free_at = end
        return end

    def request_timed(
        self, nbytes: int, cls: TrafficClass, at_end: Callable[[float], object]
    ) -> None:
        """`request`, but `at_end(t)` runs when the last chunk is granted, with the time `t` its
        last byte crosses (not as an event at `t`), so the caller can merge completions."""
        if self.arb is None or nbytes == 0:
            self._account(_CLS_INDEX[cls], nbytes, self.loop.now, self.loop.now)
            at_end(self.loop.now)
            return
        self._enqueue(_TimedRequest(nbytes, cls, at_end))

    def _pace(self) -> None:
        """Runs when the chunk on the wire ends (or the link was idle): completes the request
        whose last chunk it was, then grants the next chunk if any bytes are pending. A timed
        request learns its end when its last chunk is granted; the link then needs no event at
        that chunk's end unless more bytes are pending."""
        last, self._last = self._last, None
        if last is not None and last.remaining == 0 and last.on_done is not None:
            last.on_done(None)
        arb = self.arb
        assert arb is not None
        if not arb.pending():
            self._busy = False
            return
        g = arb.grant(self.loop.now)
        req = g.request
        self._account(_CLS_INDEX[req.cls], g.nbytes, g.start, g.end)
        if req.remaining == 0 and type(req) is _TimedRequest:
            assert req.at_end is not None
            req.at_end(g.end)
            if not arb.pending():
                self._busy = False
                self._free_at = g.end
                return
        else:
            self._last = req
        self.loop.at(g.end, self._pace)

    @property
    def bytes(self) -> list[int]:
        """Bytes served so far, by `TrafficClass` value (`[HIGH, LOW]`)."""
        return [self._hi, self._lo]

    def _account(self, cls: int, n: int, start: float, end: float) -> None:
        if cls:
            self._lo += n
        else:
            self._hi += n
        if n == 0:
            return
        w = self.window_s
        a, b = _window(start, w), _window(end - 1e-9 * w, w)
        if a >= b or end <= start:
            self._add(a, n)
            return
        span = end - start
        for i in range(a, b + 1):
            lo, hi = max(start, i * w), min(end, (i + 1) * w)
            if hi > lo:
                self._add(i, n * (hi - lo) / span)

    def _add(self, i: int, v: float) -> None:
        """Adds `v` bytes to window `i`."""
        if i == self._win:
            self._acc += v
        elif i > self._win:
            win = self.windows
            if self._win >= 0:
                win.append(self._acc)
            if i > len(win):
                win.extend([0.0] * (i - len(win)))
            self._win = i
            self._acc = 0.0
            self._acc += v
        else:  # an earlier window (chunks start in time order: not expected)
            self.windows[i] += v

    def pending_bytes(self) -> int:
        return 0 if self.arb is None else self.arb.pending_bytes()

    def busy_s(self) -> float:
        return (self._hi + self._lo) / self.rate if self.rate else 0.0

    def window_series(self) -> list[list[float]]:
        """`[[window start (s), bytes]]` for every window up to the last busy one."""
        closed = self.windows
        series = [[i * self.window_s, v] for i, v in enumerate(closed)]
        if self._win >= 0:
            series.append([self._win * self.window_s, self._acc])
        return series


class _Join:
    """One transfer over links that grant it chunk by chunk: `at_end(t)` gets the latest of
    `end` (the links that served the bytes at once) and those links' last chunk ends once all
    of them have granted their last chunk (at that grant's time, so `t >= now`)."""

    __slots__ = ("slow", "left", "end", "at_end")

    def __init__(self, slow: list[SimLink], end: float, at_end: Callable[[float], object]):
        self.slow, self.left, self.end, self.at_end = slow, len(slow), end, at_end

    def request(self, nbytes: int, cls: TrafficClass) -> None:
        for ln in self.slow:
            ln.request_timed(nbytes, cls, self.granted)

    def granted(self, t: float) -> None:
        if t > self.end:
            self.end = t
        self.left -= 1
        if not self.left:
            self.at_end(self.end)


class SimNetwork:
    """Every link of the simulated cluster, by `LinkId`, and transfers over paths.

    `rates(kind)` gives a link kind's bytes per second (0: unlimited), normally
    `transfer.links.link_rate(hw, kind)`.
    """

    def __init__(
        self,
        loop: EventLoop,
        rates: Callable[[LinkId], float],
        *,
        quantum_s: float = 0.05,
        high_weight: float = 99.0,
        low_weight: float = 1.0,
        window_s: float = 1.0,
        fast: bool = True,
        fifo: Iterable[str] = (),
    ):
        self.loop = loop
        self.fast = fast
        self.fifo = frozenset(str(k) for k in fifo) if fast else frozenset()
        self._rates = rates
        self.quantum_s = quantum_s
        self.high_weight, self.low_weight = high_weight, low_weight
        self.window_s = window_s
        self.links: dict[LinkId, SimLink] = {}
        self.by_owner: dict[str, list[SimLink]] = {}
        # `id(link id) -> (link id, link)`: paths repeat the same LinkId objects
        # (`transfer.paths` caches them), and an int key spares the dataclass hash per hop. An
        # entry keeps its LinkId alive, so its id is not reused while it is held; callers that
        # build new LinkIds per transfer would grow it, so it starts over past a bound.
        self._by_ref: dict[int, tuple[LinkId, SimLink]] = {}

    def link(self, link_id: LinkId) -> SimLink:
        ln = self.links.get(link_id)
        if len(self._by_ref) > 4 * len(self.links) + 1024:
            self._by_ref.clear()
        if ln is not None:
            self._by_ref[id(link_id)] = (link_id, ln)
        else:
            ln = self.links[link_id] = SimLink(
                link_id,
                self._rates(link_id),
                self.loop,
                quantum_s=self.quantum_s,
                high_weight=self.high_weight,
                low_weight=self.low_weight,
                window_s=self.window_s,
                fifo=str(link_id.kind) in self.fifo,
            )
            self.by_owner.setdefault(link_id.owner, []).append(ln)
            self._by_ref[id(link_id)] = (link_id, ln)
        return ln

    def resolve(self, path: Sequence[LinkId]) -> tuple[SimLink, ...]:
        """The links of `path`, built on first use: what `send` / `send_timed` take. A caller
        that moves bytes over the same path many times resolves it once."""
        by_ref = self._by_ref
        out = []
        for lid in path:
            ref = by_ref.get(id(lid))
            out.append(ref[1] if ref is not None and ref[0] is lid else self.link(lid))
        return tuple(out)

    def transfer(
        self, path: Sequence[LinkId], nbytes: int, cls: TrafficClass, on_done: Done
    ) -> None:
        """Moves `nbytes` over every link of `path` at once; `on_done()` runs (as an event) when
        the slowest link has served them. 0 bytes complete at once (as an event)."""
        self.send(self.resolve(path), nbytes, cls, on_done)

    def transfer_timed(
        self,
        path: Sequence[LinkId],
        nbytes: int,
        cls: TrafficClass,
        at_end: Callable[[float], object],
    ) -> None:
        """`transfer`, but `at_end(t)` is called as soon as the completion time `t` is known
        (`t >= now`; often at once, inside this call) instead of running as an event at `t`: a
        caller joining several transfers then needs one event for all of them."""
        self.send_timed(self.resolve(path), nbytes, cls, at_end)

    def send(
        self,
        links: Sequence[SimLink],
        nbytes: int,
        cls: TrafficClass,
        fn: Callable[..., object],
        *args: object,
    ) -> None:
        """`transfer` over resolved links (`resolve`): `fn(*args)` runs as an event when the
        slowest link has served the bytes."""
        loop = self.loop
        if nbytes <= 0 or not links:
            loop.at(loop.now, fn, *args)
            return
        if self.fast:
            # `serve_now` on every link that allows it: one event when all do.
            end, slow = self._start(links, nbytes, cls)
            if not slow:
                loop.at(end, fn, *args)
                return
            _Join(slow, end, lambda t: loop.at(t, fn, *args)).request(nbytes, cls)
            return

        def on_done() -> None:
            fn(*args)

        if len(links) == 1:
            links[0].request(nbytes, cls, lambda _exc=None: on_done())
            return
        left = [len(links)]

        def one(_exc: object = None) -> None:
            left[0] -= 1
            if left[0] == 0:
                on_done()

        for ln in links:
            ln.request(nbytes, cls, one)

    def send_timed(
        self,
        links: Sequence[SimLink],
        nbytes: int,
        cls: TrafficClass,
        at_end: Callable[[float], object],
    ) -> None:
        """`transfer_timed` over resolved links (`resolve`)."""
        if nbytes <= 0 or not links:
            at_end(self.loop.now)
            return
        if not self.fast:
            loop = self.loop
            self.send(links, nbytes, cls, lambda: at_end(loop.now))
            return
        end, slow = self._start(links, nbytes, cls)
        if not slow:
            at_end(end)
            return
        _Join(slow, end, at_end).request(nbytes, cls)

    def _start(
        self, links: Sequence[SimLink], nbytes: int, cls: TrafficClass
    ) -> tuple[float, list[SimLink]]:
        """`serve_now` on every link: the latest end among the links that served the bytes at
        once, and the links that did not."""
        end = self.loop.now
        slow: list[SimLink] = []
        for ln in links:
            t = ln.serve_now(nbytes, cls)
            if t is None:
                slow.append(ln)
            elif t > end:
                end = t
        return end, slow

    def totals(self) -> dict[str, int]:
        return {ln.id.name: ln._hi + ln._lo for ln in self.links.values()}

    def snapshot(self, elapsed_s: float, owners: set[str] | None = None) -> dict:
        """The `TrafficManager.snapshot()` shape for the links of `owners` (None: all)."""
        out = {}
        links: Iterable[SimLink] = self.links.values()
        if owners is not None:
            links = [ln for o in owners for ln in self.by_owner.get(o, ())]
        for ln in sorted(links, key=lambda x: x.id.name):
            hi, lo = ln.bytes
            busy = ln.busy_s()
            out[ln.id.name] = link_record(ln.id, ln.rate, hi, lo, busy, elapsed_s)
        return {"elapsed_s": elapsed_s, "links": out}


def unlimited(_: LinkId) -> float:
    return 0.0


def infinite_if_zero(rate: float) -> float:
    return math.inf if rate <= 0 else rate
