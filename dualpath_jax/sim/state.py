"""What the simulated cluster keeps per run, per engine and per round, and the model's knobs.

`SimOptions` (the model's own settings), `RoundState` (a round in flight; a finished one becomes
a `results.RoundResult`, the record the router answers with too), `HostBuffer` (an engine's PE
or DE buffer), `SimEngine` (an engine with its router-side load and its PE / DE state) and
`MemoTerms` (the cost model's additive attention terms, remembered). `sim.cluster.SimCluster`
drives them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable

from dualpath_jax.sched.intra import PrefillQueue
from dualpath_jax.sched.types import Assignment, Request
from dualpath_jax.sim.core import Event
from dualpath_jax.sim.network import SimLink


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """Knobs of the model itself (not of the simulated hardware).

    `quantum_s`: link time per granted chunk (see `sim.network`); `window_s`: link time-series
    window; `persist`: charge the DE's Full Block writes; `dispatch_interval_s`: router fetch
    cadence (None: `cluster.fetch_interval_s`); `kv_format`: KV bytes format
    (`model.layout.kv_bytes_per_token`, e.g. "fp8_flashmla"; None: `hardware.kv_format`, which
    the paper presets set); `hbm_tokens`: KV tokens per DE
    (0: `hardware.hbm_bytes / kv bytes per token`, or slots x `decode_max_len` without it);
    `decode_overhead_s`: fixed DE time per request between its last decode step and persisting
    (control-plane messages, admission polling, bookkeeping of the real engines; fitted for the
    CPU engines by `sim.fit`, 0 for the GPU presets); `decode_macro_steps`: a decode batch
    whose members cannot change (no request finishes, none is admitted) advances all those
    steps in one event, each timed at the span's mean context; an admission cuts the span after
    the step in progress (False: one event per step, each at its own context); `fast_links`:
    one event per uncontended transfer (`sim.network`; False: one per chunk per link);
    `pe_hbm_tokens`: KV tokens a PE's HBM holds for one forward batch (None:
    `cluster.prefill_max_kv_tokens`, else the DE's `hardware.hbm_bytes` figure, unbounded
    without either; 0: unbounded). Without layerwise prefill a batch holds every layer of its
    context (`cached + new` summed over its chunks <= this); with it one layer at a time, so the
    bound is `layers` times larger (paper section 2; `sched.intra.batch_kv_bound`).
    `leader_phases`: every group leader fetches when
    the engine loops do, between batches or steps and on its own timer while idle
    (`sim.leaders`); False: one synchronous pass of all groups per interval (module docstring).
    """

    quantum_s: float = 0.05
    window_s: float = 1.0
    persist: bool = True
    dispatch_interval_s: float | None = None
    kv_format: str | None = None
    hbm_tokens: int = 0
    decode_overhead_s: float = 0.0
    decode_macro_steps: bool = True
    fast_links: bool = True
    pe_hbm_tokens: int | None = None
    leader_phases: bool = True


# `RoundState` (one per round) spells out its `__init__` (`init=False`): the compiled core
# compiles a written one and would run a generated one as interpreted code.


@dataclasses.dataclass(eq=False, init=False)
class RoundState:
    """Mutable per-request state; times are virtual seconds (NaN until reached)."""

    request: Request
    agent: int
    t_submit: float
    on_done: Callable[[RoundState], object]
    t_assign: float = math.nan
    t_read: float = math.nan
    t_first: float = math.nan
    t_second: float = math.nan
    pe: SimEngine | None = None
    de: SimEngine | None = None
    assignment: Assignment | None = None
    # Its copies (`transfer.paths.STEP_NAMES` order): bytes (empty until assigned, and for
    # Oracle, which copies nothing) and the links of its engine pair (`SimCluster._links`).
    nbytes: tuple[int, ...] = ()
    links: list[tuple[SimLink, ...] | None] = dataclasses.field(default_factory=list)
    waits: int = 0  # outstanding buffer reservations or store reads
    loaded: bool = False  # the hit KV went to the PE device
    sent: int = 0  # bytes of PE device -> DE buffer issued so far
    sends: int = 0  # of those, transfers whose end is not known yet
    sent_end: float = -math.inf  # the latest end known of those transfers
    prefilled: bool = False
    prefill_s: float = 0.0
    generated: int = 0  # tokens so far (the PE's first one included; not updated while decoding)
    pe_buf: int = 0
    de_buf: int = 0
    read_pe: int = 0  # hit tokens still queued to be read on the PE's node
    read_de: int = 0  # ... on the DE's node
    cached: int = 0  # prompt tokens before the PE's new ones (0 once its hit is recomputed)
    lead: int = 0  # of those, leading tokens the PE recomputes first (load or recompute)

    def __init__(
        self,
        request: Request,
        agent: int,
        t_submit: float,
        on_done: Callable[[RoundState], object],
    ) -> None:
        self.request, self.agent, self.t_submit, self.on_done = request, agent, t_submit, on_done
        self.t_assign = self.t_read = self.t_first = self.t_second = math.nan
        self.pe = self.de = None
        self.assignment = None
        self.nbytes = ()
        self.links = []
        self.waits = 0
        self.loaded = False
        self.sent = self.sends = 0
        self.sent_end = -math.inf
        self.prefilled = False
        self.prefill_s = 0.0
        self.generated = 0
        self.pe_buf = self.de_buf = 0
        self.read_pe = self.read_de = 0
        self.cached = request.cached_tokens
        self.lead = 0


class HostBuffer:
    """A host buffer (PE buffer / DE buffer) of `capacity` bytes; FIFO reservations."""

    def __init__(self, capacity: float):
        self.capacity = capacity
        self.free = capacity
        self.waiting: collections.deque[tuple[int, Callable[[RoundState], object], RoundState]]
        self.waiting = collections.deque()

    def reserve(self, nbytes: int, granted: Callable[[RoundState], object], st: RoundState) -> None:
        """`granted(st)` runs once `nbytes` are reserved (at once if they fit and nobody waits)."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} B do not fit a host buffer of {self.capacity:.0f} B")
        self.waiting.append((nbytes, granted, st))
        self._grant()

    def release(self, nbytes: int) -> None:
        self.free += nbytes
        self._grant()

    def _grant(self) -> None:
        waiting = self.waiting
        while waiting and waiting[0][0] <= self.free:
            n, cb, st = waiting.popleft()
            self.free -= n
            cb(st)


@dataclasses.dataclass(eq=False)
class SimEngine:
    id: int
    node: int
    group: int
    role: str  # "prefill" | "decode"
    buffer: HostBuffer
    # router-side load (requests assigned, tokens, promised HBM tokens)
    seq: int = 0
    tok: int = 0
    hbm_promised: int = 0
    # PE
    queue: PrefillQueue = dataclasses.field(default_factory=PrefillQueue)
    busy: bool = False
    # DE
    hbm_tokens: int = 0
    slots: int = 0
    waiting: collections.deque[RoundState] = dataclasses.field(default_factory=collections.deque)
    # Decoding requests by admission number. Tokens are counted lazily: a request admitted to
    # start with step `j` holding `g0` tokens finishes at the end of step `j + gen - g0 - 1`
    # (`finish` heap), and gets its second token at the end of step `j` (`seconds`).
    # (Typed containers: the compiled core reads their items natively.)
    active: dict[int, RoundState] = dataclasses.field(default_factory=dict)
    # heap of (last step, admission no.)
    finish: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # step -> requests to stamp t_second
    seconds: dict[int, list[RoundState]] = dataclasses.field(default_factory=dict)
    steps: int = 0  # decode steps completed
    batch_n: int = 0  # requests in the step(s) on the device
    span: tuple[float, float, int] = (0.0, 0.0, 0)  # (start, s per step, steps) of the span
    span_event: Event | None = None
    hbm_used: int = 0
    stepping: bool = False
    ctx_sum: int = 0  # sum of prompt + generated tokens over `active`

    @property
    def name(self) -> str:
        return f"{'pe' if self.role == 'prefill' else 'de'}{self.id}"

    @property
    def node_name(self) -> str:
        return f"node{self.node}"


class MemoTerms:
    """A cost model's additive attention terms, remembered per `(cached, bsz)`: packing asks for
    the same pairs again (a queued request at every batch until it is taken; the cut search)."""

    LIMIT = 1 << 20  # pairs kept before the memo starts over

    def __init__(self, cost) -> None:
        self._terms = cost.attention_terms
        self.attention_time_of = cost.attention_time_of
        self._memo: dict[int, tuple[float, ...]] = {}

    def attention_terms(self, cached: int, bsz: int) -> tuple[float, ...]:
        # one int per pair (no tuple to build and hash); exact while `bsz` < 2**32
        key = cached << 32 | bsz if 0 <= bsz < 1 << 32 and cached >= 0 else -1
        out = self._memo.get(key) if key >= 0 else None
        if out is None:
            if len(self._memo) >= self.LIMIT:
                self._memo.clear()
            out = self._terms(cached, bsz)
            if key >= 0:
                self._memo[key] = out
        return out
