"""Named links and their arbitration core: every KV byte that moves is charged to a link (docs/emulation.md).

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
(`LinkArbiter`, a pure core with no clock and no threads); within a class requests are served
FIFO, so a forward's layer blocks arrive in the order they were asked for.

Two drivers share the core: the real processes' `transfer.traffic.TrafficManager` (one pacing
thread per limited link) and the simulator's `sim.network.SimNetwork` (events on a virtual clock).
This module is in the simulator's compiled core (`dualpath_jax.native`): no threads, no
exceptions of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

from dualpath_jax.config import HardwareConfig

DoneCallback = Callable[[BaseException | None], object]

DEFAULT_CHUNK_BYTES = 64 * 1024
DEFAULT_BURST_S = 0.005
DEFAULT_WINDOW_S = 0.1


class TrafficClass(enum.IntEnum):
    """Priority of a transfer on every link it crosses (paper appendix A.1, docs/emulation.md)."""

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


def emulated_links(hw: HardwareConfig) -> dict[str, float]:
    """The links `hw` emulates, kind -> bytes per second: every kind whose rate is > 0, which the
    engines pace as token buckets (`transfer.traffic`) and the scheduler prices reads by. Empty:
    every link runs at the host's speed. Run summaries say `emulated` when it is not empty, and
    the API server logs it and reports it in `GET /health` (docs/emulation.md)."""
    rates = {kind.value: link_rate(hw, kind) for kind in LinkKind}
    return {kind: rate for kind, rate in rates.items() if rate > 0}


# --------------------------------------------------------------------------- arbitration core


@dataclasses.dataclass(eq=False, init=False)
class LinkRequest:
    """One caller's bytes on one link: queued FIFO in its class, served chunk by chunk
    (`remaining` falls to 0), then `on_done(None)`, or `on_done(LinkClosedError)` on close.
    (A written `__init__`: the compiled core runs a generated one as interpreted code.)"""

    nbytes: int
    cls: TrafficClass
    on_done: DoneCallback | None = None
    remaining: int = dataclasses.field(init=False)

    def __init__(self, nbytes: int, cls: TrafficClass, on_done: DoneCallback | None = None) -> None:
        self.nbytes = nbytes
        self.cls = cls
        self.on_done = on_done
        self.remaining = nbytes


class Grant:
    """One chunk served: it occupies the link during `[start, end)` (seconds, link clock).
    (A plain class: one is made per chunk; a frozen dataclass costs several times more, and a
    named tuple's constructor runs as interpreted code even in the compiled core.)"""

    __slots__ = ("request", "nbytes", "start", "end")

    def __init__(self, request: LinkRequest, nbytes: int, start: float, end: float) -> None:
        self.request = request
        self.nbytes = nbytes
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return (
            f"Grant(request={self.request!r}, nbytes={self.nbytes}, "
            f"start={self.start}, end={self.end})"
        )


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

    def grant_alone(self, nbytes: int, cls: TrafficClass, now: float) -> tuple[float, float]:
        """`enqueue(LinkRequest(nbytes, cls)); grant(now)` on an arbiter with nothing queued and
        `nbytes <= chunk_bytes`, with the same state afterwards, minus the request object and the
        queue round trip (the simulator's uncontended transfers). Returns the chunk's (start,
        end)."""
        tag = max(self._vtime, self._last_tag[cls]) + nbytes / self._weight[cls]
        self._vtime = self._last_tag[cls] = tag
        start = max(self.t_free, now)  # not lagging: the backlog emptied at the last grant
        self.t_free = end = start + nbytes / self.rate
        self._backlogged = False
        return start, end

    def drain(self) -> list[LinkRequest]:
        """Removes and returns every queued request (the link is closing)."""
        out = [r for c in TrafficClass for r in self._queue[c]]
        for c in TrafficClass:
            self._queue[c].clear()
            self._head_tag[c] = None
        return out


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
